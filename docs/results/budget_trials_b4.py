"""The thirty-fifth session's B = 4 trial arms in one run: ``#pin`` and ``#lite`` as in ``pinned_depth_trial_b4.py``,
``#hl`` and ``#sticky`` as in ``headless_budget_trial_b4.py`` (replicates of ``auto``; other arms as in
bench/budget_paired.py). Run from the repository root::

    python docs/results/budget_trials_b4.py --batch-size 4 --arms K2,auto,auto#lite,auto#hl --passes 6 --prompts 128
"""
import sys

sys.path.insert(0, "bench")
sys.path.insert(0, "docs/results")
import budget_paired  # noqa: E402

main, parse = budget_paired.main, budget_paired.parse_arm
budget_paired.main = lambda argv: None  # the trial scripts run main when imported: not yet
import headless_budget_trial_b4 as headless  # noqa: E402
import pinned_depth_trial_b4 as pinned  # noqa: E402


def parse_arm(name, head):
    if name.endswith(("#pin", "#lite")):
        return pinned.parse_arm(name, head, parse=parse)
    if name.endswith(("#hl", "#sticky")):
        return headless.parse_arm(name, head, parse=parse)
    return parse(name, head)


budget_paired.parse_arm = parse_arm
main(sys.argv[1:])
