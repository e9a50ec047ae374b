"""Where a fresh verification budget settles at B = 4, with and without its in-round decisions (thirty-fifth session).

For each arm (``auto``: the default, the one-step rule and verified depth decided in the round; ``auto:in_round=false``:
blind rounds, ``BatchBudget.blind``), a new generator and policy run a warm-up call (16 HumanEval requests) and then
one call of ``--prompts`` requests at B = 4 (greedy, 48 new tokens each), and the rounds of that call are counted by
depth (the deepest row's candidates; 0 is a plain step). Writes the counts and the budget's state after the call.

    python docs/results/blind_rounds_depths_b4.py --out docs/results/blind_rounds_depths_b4_bf16_epyc_2026-11-26.json
"""
import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, "bench")
from budget_paired import parse_arm, save_result  # noqa: E402
from specdec_ext import SpeculativeGenerator  # noqa: E402
from specdec_ext.benchmark import machine_description  # noqa: E402
from specdec_ext.prompts import load_prompts  # noqa: E402
from specdec_ext.zoo import load_pair  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--arms", default="auto,auto:in_round=false,auto:in_round=false#b")
ap.add_argument("--prompts", type=int, default=48)
ap.add_argument("--out", type=Path, default=None)
args = ap.parse_args()
pair = load_pair()
prompts = [torch.tensor(pair.tokenizer(t)["input_ids"]) for t in load_prompts("humaneval")[: args.prompts]]
result = {"machine": machine_description(pair), "command": "python docs/results/blind_rounds_depths_b4.py "
          + " ".join(sys.argv[1:]), "arms": {}}
for arm in args.arms.split(","):
    pol = parse_arm(arm.partition("#")[0], pair.heads["greedy"])
    gen = SpeculativeGenerator(pair.target, pair.draft, policy=pol)
    gen.generate_continuous(prompts[:16], 4, max_new_tokens=48, temperature=0)
    stats = gen.generate_continuous(prompts, 4, max_new_tokens=48, temperature=0).stats
    depths = collections.Counter(max(r.candidates) if r.candidates else 0 for r in stats.rounds)
    b = pol.budget
    row = {"rounds_by_depth": dict(sorted(depths.items())), "tokens_per_s": stats.new_tokens / stats.wall_ms * 1e3,
           "head_scale": b.head_scale, "gain": b.gain[:4], "calibration": [b.calibration(k) for k in range(5)]}
    result["arms"][arm] = row
    print(arm, row["rounds_by_depth"], f"{row['tokens_per_s']:.1f} tokens/s")
save_result(args.out, result)
