"""Paired B = 4 trial (thirty-fifth session; not the library's code): the verification budget with rounds that draft
to the plan's depth without the head, as a replicate of ``auto`` (``bench/budget_paired.py``'s A/A mechanism).

- ``auto#hl``: headless rounds. Outside the budget's scored rounds (one in ``score_every``, and its exploration and
  probe rounds, which score every slot) the head is not run: no confidence features, head step, one-step rule or
  verified depth; the batch drafts and verifies the plan's depth. No headroom: without the one-step rule an extra
  slot would always be drafted. This is ``BatchBudget(in_round=False)`` (the arm ``auto:in_round=false``); the runs
  in the results files wrapped the policy's ``should_stop`` by hand for the same rounds, before the library had it.
- ``auto#sticky``: headless rounds, and the plan keeps its last drafting depth unless the best one is expected to beat
  it by more than ``MARGIN`` (hysteresis between drafting depths; between plain steps and drafting the budget's own
  ``switch_margin`` rule holds).

Run from the repository root, as bench/budget_paired.py::

    python docs/results/headless_budget_trial_b4.py --batch-size 4 --arms K2,auto,auto#hl,auto#sticky --passes 6 \\
        --prompts 128
"""
import sys

sys.path.insert(0, "bench")
import budget_paired  # noqa: E402
from specdec_ext.policies.goodput import BatchBudget  # noqa: E402

MARGIN = 0.03


class Sticky(BatchBudget):
    """The plan's drafting depth held while the best depth is expected within ``MARGIN`` of it."""

    def _measured_cap(self, B):
        cap = super()._measured_cap(B)
        if self.forced:  # exploring or probing: as the budget
            return cap
        values = self._values(B)
        best, held = self._best, getattr(self, "_held", None)
        if held is not None and held != best and held > 0 and best > 0 and values[held] >= (1 - MARGIN) * values[best]:
            best = held
        self._held = best
        return best


def parse_arm(name, head, parse=budget_paired.parse_arm):
    policy = parse(name, head)
    if name.endswith(("#hl", "#sticky")):  # blind rounds: BatchBudget(in_round=False), which ignores the headroom
        budget_paired.swap_budget(policy, Sticky if name.endswith("#sticky") else BatchBudget, in_round=False)
    return policy


budget_paired.parse_arm = parse_arm
budget_paired.main(sys.argv[1:])
