"""What depths a blind budget (``in_round=False``) plays call by call at B = 4, with and without drafting one slot past
the plan in its scored rounds (``score_deeper``; thirty-sixth session).

For each arm (``budget_paired`` syntax, e.g. ``auto:in_round=false:score_deeper=false``) a new generator and policy
run a warm-up call (16 HumanEval requests), then ``--calls`` calls of 16 requests each at B = 4 (greedy, 48 new tokens
each, the budget kept from call to call as in ``bench/budget_paired.py``'s streams). Per call: the rounds by depth (the
deepest row's candidates; 0 is a plain step), tokens/s, and at the call's first plan the expected goodput of depths
0-3 over plain steps' (``BatchBudget.expected_goodput``) and the depth it chose.

    python docs/results/blind_rounds_trace_b4.py --out docs/results/blind_rounds_trace_b4_bf16_epyc_2026-11-26.json
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
from specdec_ext.policies.goodput import BatchBudget  # noqa: E402
from specdec_ext.prompts import load_prompts  # noqa: E402
from specdec_ext.zoo import load_pair  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--arms", default="auto:in_round=false:score_deeper=false,auto:in_round=false")
ap.add_argument("--calls", type=int, default=7)
ap.add_argument("--out", type=Path, default=None)
args = ap.parse_args()
pair = load_pair()
n = 16 * (args.calls + 1)
prompts = [torch.tensor(pair.tokenizer(t)["input_ids"]) for t in load_prompts("humaneval")[:n]]
first_plans: list = []
plan = BatchBudget.plan


def traced_plan(self, batch_size, width=None):
    drafts = plan(self, batch_size, width)
    if not first_plans:
        values = [self.expected_goodput(batch_size, c) for c in range(4)]
        first_plans.append({"over_plain": [v / values[0] for v in values], "cap": self.cap})
    return drafts


BatchBudget.plan = traced_plan
result = {"machine": machine_description(pair), "command": "python docs/results/blind_rounds_trace_b4.py "
          + " ".join(sys.argv[1:]), "arms": {}}
for arm in args.arms.split(","):
    pol = parse_arm(arm.partition("#")[0], pair.heads["greedy"])
    gen = SpeculativeGenerator(pair.target, pair.draft, policy=pol)
    gen.generate_continuous(prompts[:16], 4, max_new_tokens=48, temperature=0)
    calls = []
    for s in range(16, n, 16):
        first_plans.clear()
        stats = gen.generate_continuous(prompts[s: s + 16], 4, max_new_tokens=48, temperature=0).stats
        depths = collections.Counter(max(r.candidates) if r.candidates else 0 for r in stats.rounds)
        calls.append({"rounds_by_depth": dict(sorted(depths.items())),
                      "tokens_per_s": stats.new_tokens / stats.wall_ms * 1e3, "first_plan": first_plans[0]})
        print(arm, f"call {len(calls)}:", calls[-1]["rounds_by_depth"], f"{calls[-1]['tokens_per_s']:.0f} tokens/s,",
              "first plan", [round(v, 3) for v in first_plans[0]["over_plain"]], "-> depth", first_plans[0]["cap"])
    result["arms"][arm] = calls
save_result(args.out, result)
