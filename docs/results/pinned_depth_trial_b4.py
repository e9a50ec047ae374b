"""Paired B = 4 trial (thirty-fifth session; a diagnostic, not the library's code): what the verification budget's
per-round work costs, apart from what its decisions gain.

Arms, as replicates of ``auto`` (``bench/budget_paired.py``'s A/A mechanism):

- ``auto#pin``: the budget pinned at depth 2, fixed K = 2's depth, with all of its per-round work still done and its
  decisions computed and then overridden: the plan (:meth:`BatchBudget._measured_cap`), the head's step and the
  one-step rule at slot 1 (``go_on``), the verified depth (``depth``), the update and the round-time measurement.
  Its gap to K2 is what that work costs; ``auto``'s gap to it is what the decisions gain.
- ``auto#lite``: pinned likewise, but the head is not run at slot 1 (no features, head step, one-step rule or
  verified depth there) except in the budget's scored rounds (one in ``score_every``, which score every slot for
  the running survivals); the plan, the update and the round-time measurement still run every round: the pinned
  budget with ``in_round=False``. ``auto#pin`` over ``auto#lite`` is the head's step at slot 1 and its glue. (The
  runs in the results files wrapped the policy's ``should_stop`` by hand for this, before the library had
  ``in_round``; the one difference, a round whose rows all ran out of room before slot 2, was counted as two slots
  drafted there and as the slots drafted now.)

Run from the repository root, as bench/budget_paired.py::

    python docs/results/pinned_depth_trial_b4.py --batch-size 4 --arms K2,auto,auto#pin --passes 6 --prompts 128
    python docs/results/pinned_depth_trial_b4.py --batch-size 4 --arms K2,auto,auto#pin,auto#lite --passes 6 \\
        --prompts 128
"""
import sys

sys.path.insert(0, "bench")
import budget_paired  # noqa: E402
from specdec_ext.policies.goodput import BatchBudget  # noqa: E402

DEPTH = 2


class Pinned(BatchBudget):
    """Every decision computed as the budget's, then the round drafts and verifies ``DEPTH`` slots per row."""

    def _measured_cap(self, B):
        super()._measured_cap(B)
        self.forced = False  # plan() makes the scored rounds forced again (score_every), as in the budget
        return DEPTH

    def go_on(self, k, survival):
        super().go_on(k, survival)
        return k < DEPTH

    def depth(self, survivals):
        super().depth(survivals)
        return survivals.shape[1]


def parse_arm(name, head, parse=budget_paired.parse_arm):
    policy = parse(name, head)
    if name.endswith(("#pin", "#lite")):
        # #lite: blind rounds (BatchBudget(in_round=False)), which the first run of this trial wrapped by hand
        budget_paired.swap_budget(policy, Pinned, **({"in_round": False} if name.endswith("#lite") else {}))
    return policy


budget_paired.parse_arm = parse_arm
budget_paired.main(sys.argv[1:])
