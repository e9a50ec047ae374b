"""Paired B = 4 trial (thirty-third session, not kept): the budget with per-slot calibration factors fixed at the
replay's measured a_j (``batch_replay_b4_depth4_bf16_epyc_2026-11-26.json``; an oracle trial, not the library's
code), as the replicate ``auto#cal`` of ``auto``. The plan expects B (1 + sum_{j<=c} a_j g_j) tokens of a round of
depth c, and the one-step rule weighs slot k + 1 by a_{k+1}, where the budget uses one factor a for every slot.

Run from the repository root, as bench/budget_paired.py; this is the script that made
``budget_paired_b4_slot_calibration_trial_bf16_epyc_2026-11-26.json``, rewritten to reuse BatchBudget's methods
(the same arithmetic)::

    python docs/results/slot_calibration_trial_b4.py --batch-size 4 --arms K2,auto,auto#cal --passes 6 --prompts 128
"""
import sys

sys.path.insert(0, "bench")
import budget_paired  # noqa: E402
from specdec_ext.policies.goodput import BatchBudget  # noqa: E402

A = [1.035, 1.137, 1.293, 1.371] + [1.4] * 8  # slots 1-4 measured; deeper slots 1.4


class SlotCalibrated(BatchBudget):
    def _survival_sums(self):  # read by the plan as a * sums[c]: these make it sum_{j<=c} a_j g_j
        sums, out = super()._survival_sums(), [0.0]
        for j in range(len(sums) - 1):
            out.append(out[-1] + A[j] * (sums[j + 1] - sums[j]) / self.head_scale)
        return out

    def go_on(self, k, survival):  # read as a * sum(S) * rho: this makes it a_{k+1} * sum(S) * rho
        return super().go_on(k, survival * (A[k] / self.head_scale))


def parse_arm(name, head, parse=budget_paired.parse_arm):
    policy = parse(name, head)
    if name.endswith("#cal"):
        budget_paired.swap_budget(policy, SlotCalibrated)
    return policy


budget_paired.parse_arm = parse_arm
budget_paired.main(sys.argv[1:])
