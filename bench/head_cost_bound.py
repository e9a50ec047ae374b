"""What the acceptance head's cost takes from SpecDec++ at one request: ``threshold="auto"`` beside the same
rounds without the head, and beside fixed K, on the same prompts in one process.

The *free-head* arm replays, prompt by prompt, the candidate length that ``auto`` chose in each round, through a
policy that reads nothing (no hidden state, no confidence features, no head step, no stop rule). Under greedy
decoding it drafts, verifies and emits exactly what ``auto`` did (checked on every prompt), so its tokens/s is what
``auto`` would reach if the head cost nothing: a bound on every saving in the head's step and the rule. The
difference, divided by the head steps taken, is the head's cost per drafting step as it runs inside the loop
(caches cold from the forwards between its calls), not as a kernel timed alone.

A first pass records ``auto``'s rounds; the timed pass runs every arm on each prompt in a balanced order
(``benchmark.balanced_order``). Prints and writes total tokens/s per arm, each against the best fixed K in total,
and the per-prompt paired medians with bootstrap intervals (``paired.py``).

    python bench/head_cost_bound.py --prompts 164 --max-new-tokens 64 --out docs/results/head_cost_bound_bf16_epyc.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.benchmark import balanced_order, machine_description
from specdec_ext.policies.base import CandidateLengthPolicy
from specdec_ext.prompts import load_prompts
from specdec_ext.zoo import load_pair

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired import paired  # noqa: E402


class ReplayedLengths(CandidateLengthPolicy):
    """Drafts ``lengths[r]`` candidates in round r of a call: the rounds of a recorded run, with no policy cost."""

    name = "replayed lengths"

    def __init__(self, k_max: int):
        self.max_candidates = k_max
        self.lengths: list[int] = []
        self.round = 0

    def reset(self, batch_size, device):
        if batch_size != 1:
            raise ValueError(f"ReplayedLengths replays one request's rounds, got batch size {batch_size}")
        self.round = 0

    def should_stop(self, info):
        k = self.lengths[self.round] if self.round < len(self.lengths) else 1
        return torch.full((info.batch_size,), info.step >= k, dtype=torch.bool)

    def end_round(self, num_drafted, num_accepted):
        self.round += 1


def compare(target, draft, head, ids: list, max_new_tokens: int, ks, k_max: int = 20, costs=None) -> dict:
    """Every arm on every prompt ``ids[i]`` (``[1, T_i]``), greedy: ``{"runs": {arm: {i: (new tokens, seconds)}},
    "lengths": [auto's candidate length per round, per prompt]}``. Arms: ``auto``, ``free-head`` and ``K=<k>`` for
    each of ``ks``. Raises RuntimeError when ``auto`` or ``free-head`` does not repeat the recorded rounds."""
    replay = ReplayedLengths(k_max)
    # auto without its survivals' calibration and its selection, which carry from call to call: the timed pass must
    # repeat the recorded rounds
    gens = {"auto": SpeculativeGenerator(target, draft, policy="specdecpp", head=head, threshold="auto", k_max=k_max,
                                         costs=costs, calibrate=False, select=False),
            "free-head": SpeculativeGenerator(target, draft, policy=replay)}
    for k in ks:
        gens[f"K={k}"] = SpeculativeGenerator(target, draft, policy="fixed", k=k)
    for g in gens.values():
        g.prepare(1)
        g.generate(ids[0][:, :16], max_new_tokens=8, temperature=0)
    recorded = []  # auto's (candidate lengths per round, tokens) per prompt
    for x in ids:
        out = gens["auto"].generate(x, max_new_tokens=max_new_tokens, temperature=0)
        recorded.append(([r.candidates[0] for r in out.stats.rounds], out.new_tokens[0]))
    runs = {m: {} for m in gens}
    for i, x in enumerate(ids):
        lengths, tokens = recorded[i]
        replay.lengths = lengths
        for m in balanced_order(list(gens), i):
            t0 = time.perf_counter()
            out = gens[m].generate(x, max_new_tokens=max_new_tokens, temperature=0)
            runs[m][i] = (len(out.new_tokens[0]), time.perf_counter() - t0)
            if m in ("auto", "free-head") and ([r.candidates[0] for r in out.stats.rounds] != lengths
                                               or out.new_tokens[0] != tokens):
                raise RuntimeError(f"prompt {i}: {m} did not repeat the recorded rounds of auto")
    return {"runs": runs, "lengths": [lengths for lengths, _ in recorded]}


def summary(runs: dict, lengths: list) -> dict:
    """Total tokens/s per arm, against the fixed K of the highest total, totals and paired; the head's cost in us
    per drafting step: (auto's seconds - free-head's) over the candidates auto drafted."""
    total = {m: sum(n for n, _ in r.values()) / sum(s for _, s in r.values()) for m, r in runs.items()}
    best = max((m for m in runs if m.startswith("K=")), key=total.get)
    steps = sum(sum(ks) for ks in lengths)
    head_us = (sum(s for _, s in runs["auto"].values()) - sum(s for _, s in runs["free-head"].values())) / steps * 1e6
    arms = {}
    for m in runs:
        p = paired(runs[m], runs[best])  # its total_ratio: this arm's total tokens/s over the best fixed K's
        arms[m] = {"total_tokens_per_s": total[m], "total_vs_best_fixed": p["total_ratio"], "paired_vs_best_fixed": p}
    return {"best_fixed": best, "head_us_per_step": head_us, "head_steps": steps, "arms": arms}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=164, help="the first N HumanEval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--ks", default="3,4,5", help="fixed candidate lengths K to compare with")
    ap.add_argument("--k-max", type=int, default=20, help="SpecDec++'s K_max")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    t_start = time.time()
    pair = load_pair()
    ids = [pair.tokenizer(p, return_tensors="pt").input_ids for p in load_prompts("humaneval", args.prompts)]
    res = compare(pair.target, pair.draft, pair.head, ids, args.max_new_tokens,
                  [int(x) for x in args.ks.split(",")], args.k_max)
    out = summary(res["runs"], res["lengths"])
    print(f"{len(ids)} prompts x {args.max_new_tokens} tokens; best fixed K in total tokens/s: {out['best_fixed']}")
    for m, r in out["arms"].items():
        p = r["paired_vs_best_fixed"]
        print(f"  {m:10s} {r['total_tokens_per_s']:7.1f} tokens/s  total {r['total_vs_best_fixed']:.3f}x  "
              f"paired median {p['median_ratio']:.3f}x [{p['ci95'][0]:.3f}, {p['ci95'][1]:.3f}]")
    print(f"the head's cost in the loop: {out['head_us_per_step']:.0f} us per drafting step ({out['head_steps']} steps)")
    if args.out:
        meta = {"machine": machine_description(pair), "prompts": len(ids), "max_new_tokens": args.max_new_tokens,
                "k_max": args.k_max, "command": "python bench/head_cost_bound.py " + " ".join(sys.argv[1:]),
                "duration_s": time.time() - t_start, "date": time.strftime("%Y-%m-%d", time.gmtime())}
        runs = {m: {str(i): v for i, v in r.items()} for m, r in res["runs"].items()}
        Path(args.out).write_text(json.dumps({"meta": meta, **out, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
