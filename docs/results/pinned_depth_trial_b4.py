"""Paired B = 4 trial (thirty-fifth session; a diagnostic, not the library's code): what the verification budget's
per-round work costs, apart from what its decisions gain.

Arms, as replicates of ``auto`` (``bench/budget_paired.py``'s A/A mechanism):

- ``auto#pin``: the budget pinned at depth 2, fixed K = 2's depth, with all of its per-round work still done and its
  decisions computed and then overridden: the plan (:meth:`BatchBudget._measured_cap`), the head's step and the
  one-step rule at slot 1 (``go_on``), the verified depth (``depth``), the update and the round-time measurement.
  Its gap to K2 is what that work costs; ``auto``'s gap to it is what the decisions gain.
- ``auto#lite``: pinned likewise, but the head is not run at slot 1 (no features, head step, one-step rule or
  verified depth there) except in the budget's scored rounds (one in ``score_every``, which score every slot for
  the running survivals); the plan, the update and the round-time measurement still run every round. ``auto#pin``
  over ``auto#lite`` is the head's step at slot 1 and its glue.

Run from the repository root, as bench/budget_paired.py::

    python docs/results/pinned_depth_trial_b4.py --batch-size 4 --arms K2,auto,auto#pin --passes 6 --prompts 128
    python docs/results/pinned_depth_trial_b4.py --batch-size 4 --arms K2,auto,auto#pin,auto#lite --passes 6 \\
        --prompts 128
"""
import sys

import torch

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


def lite(policy):
    """``auto#lite``: the policy's slot-1 head step skipped outside the scored rounds."""
    should_stop, verify_depth = policy.should_stop, policy.verify_depth

    def stop(info):
        if policy.use_budget and not policy.budget.score_last:
            policy._unscored = info.step >= DEPTH
            return torch.full((info.batch_size,), info.step >= DEPTH, dtype=torch.bool)
        return should_stop(info)

    def depth(num_drafted):
        out = verify_depth(num_drafted)
        if policy.use_budget and policy._unscored:  # no slot scored: the round drafted and verifies DEPTH
            policy._drafted = policy._depth = DEPTH
        return out

    policy.should_stop, policy.verify_depth = stop, depth


def parse_arm(name, head, parse=budget_paired.parse_arm):
    policy = parse(name, head)
    if name.endswith(("#pin", "#lite")):
        budget_paired.swap_budget(policy, Pinned)
        if name.endswith("#lite"):
            lite(policy)
    return policy


budget_paired.parse_arm = parse_arm
budget_paired.main(sys.argv[1:])
