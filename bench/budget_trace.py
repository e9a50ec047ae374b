"""What the verification budget planned each round, against what the round then measured, on the bundled pair.

An ``auto`` arm (SpecDec++ with ``threshold="auto"``: the batch budget, ``BatchBudget``; ``auto[:option=value...]``
as ``bench/budget_paired.py`` names it) first runs a warm-up call (``--warmup`` requests of 8 tokens at the batch
size, as ``budget_paired.py`` warms each arm), whose measurements the budget carries over, then one call of
continuous batching over ``--prompts`` HumanEval prompts (greedy, ``--max-new-tokens`` each). Each round of that
call is recorded: the live rows, the target cache's width, whether the rows were in lockstep (every row with as
many tokens left: ``BatchBudget.together``), the depth the plan chose (its cap; 0 = a plain step),
whether the round explored or probed a depth (``forced``), the best depth, the expected goodput of depths 0 .. 3
over a plain step's, the drafting overhead per token ``o`` and the head's calibration ``a``, the budget's predicted
ms of a round of depth 0 .. 3 at that moment (its table's ms times exp of its measured log ratio; None for a depth
not measured), and the round's measured ms. The summary gives the rounds per cap, and per played depth (rounds of
the full batch) the measured ms's median, the median of measured over predicted, and the predicted depth-1 round
over a plain step at the first and last rounds against the measured medians' ratio.

    python bench/budget_trace.py --batch-size 16 --prompts 128 --out docs/results/budget_trace_b16.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.benchmark import machine_description
from specdec_ext.policies.goodput import BatchBudget
from specdec_ext.prompts import load_prompts
from specdec_ext.zoo import load_pair

sys.path.insert(0, str(Path(__file__).resolve().parent))
from budget_paired import parse_arm, save_result  # noqa: E402  (the arms' names, the JSON writer)

DEPTHS = 4  # depths 0 .. 3 recorded per round


@contextmanager
def recording(budget_of):
    """While inside, each ``BatchBudget.plan`` of the budget ``budget_of()`` returns appends a record to the yielded
    list, and its next ``observe`` adds the round's measured ``ms``; the class's methods are restored on exit."""
    log: list = []
    plan, observe = BatchBudget.plan, BatchBudget.observe

    def traced_plan(self, batch_size, width=None):
        out = plan(self, batch_size, width)
        if self is budget_of():
            values = self._values(batch_size)
            log.append({"rows": batch_size, "width": width, "together": self.together, "cap": self.cap,
                        "forced": bool(self.forced),
                        "best": self._best, "over_plain": [round(v / values[0], 4) for v in values[:DEPTHS]],
                        "o": round(self.overhead_per_token(), 5), "a": round(self.head_scale, 4),
                        "predicted_ms": [None if self.log_ratio[k] is None else
                                         round(self._table_round(batch_size, k) * math.exp(self.log_ratio[k]), 3)
                                         for k in range(min(DEPTHS, self.depth_max + 1))]})
        return out

    def traced_observe(self, ms):
        if self is budget_of() and log and "ms" not in log[-1]:
            log[-1]["ms"] = round(ms, 3)
        return observe(self, ms)

    BatchBudget.plan, BatchBudget.observe = traced_plan, traced_observe
    try:
        yield log
    finally:
        BatchBudget.plan, BatchBudget.observe = plan, observe


def summarize(log: list, batch_size: int) -> dict:
    """Rounds per cap; per cap played in rounds of the full batch: rounds, the measured ms's median, and the median
    of measured over predicted ms; the predicted depth-1 round over a plain step at the first and the last full
    rounds that predicted both, and the measured medians' ratio."""
    full = [r for r in log if r["rows"] == batch_size and "ms" in r]
    by_cap: dict = {}
    for cap in sorted({r["cap"] for r in full}):
        rs = [r for r in full if r["cap"] == cap]
        pred = [r["ms"] / r["predicted_ms"][cap] for r in rs
                if cap < len(r["predicted_ms"]) and r["predicted_ms"][cap]]
        by_cap[str(cap)] = {"rounds": len(rs), "median_ms": round(statistics.median(r["ms"] for r in rs), 3),
                            "measured_over_predicted": round(statistics.median(pred), 4) if pred else None}
    both = [r for r in full if r["predicted_ms"][0] and len(r["predicted_ms"]) > 1 and r["predicted_ms"][1]]
    believed = [round(r["predicted_ms"][1] / r["predicted_ms"][0], 4) for r in (both[:1] + both[-1:])]
    measured = (round(by_cap["1"]["median_ms"] / by_cap["0"]["median_ms"], 4)
                if "0" in by_cap and "1" in by_cap else None)
    return {"rounds": len(log), "full_rounds": len(full),
            "caps": {str(k): v for k, v in sorted(Counter(r["cap"] for r in log).items())},
            "forced": sum(r["forced"] for r in log), "by_cap": by_cap,
            "depth1_over_plain": {"believed_first_last": believed, "measured": measured}}


def trace(pair, head, prompts: list, batch_size: int, arm: str = "auto", max_new_tokens: int = 48,
          warmup: int = 0, costs=None, batch_costs=None) -> dict:
    """The warm-up call (``warmup`` requests of ``prompts``, 8 tokens; none with 0), then the traced call over every
    prompt; ``{"log", "summary", "tokens", "admissions"}``. ``costs`` / ``batch_costs``: the pair's cost tables
    (None: profiled)."""
    policy = parse_arm(arm, head)
    if not getattr(policy, "needs_batch_costs", False):
        raise ValueError(f"--arm: {arm!r} has no batch budget to trace (an auto arm has)")
    gen = SpeculativeGenerator(pair.target, pair.draft, policy=policy, costs=costs, batch_costs=batch_costs)
    eos = pair.tokenizer.eos_token_id

    def call(requests, n):
        return gen.generate_continuous(requests, batch_size, max_new_tokens=n, temperature=0, eos_token_id=eos)

    if warmup:
        call(prompts[:warmup], 8)
    with recording(lambda: policy.budget) as log:
        t0 = time.perf_counter()
        out = call(prompts, max_new_tokens)
        seconds = time.perf_counter() - t0
    summary = {**summarize(log, batch_size), "tokens_per_s": round(out.stats.new_tokens / seconds, 1),
               "admissions": out.stats.admissions}
    return {"log": log, "summary": summary, "tokens": out.stats.new_tokens,
            "admissions": out.stats.admissions, "round_ms": [round(r.total_ms, 3) for r in out.stats.rounds]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--arm", default="auto", help="an auto arm, as bench/budget_paired.py names it")
    ap.add_argument("--prompts", type=int, default=128, help="HumanEval prompts (requests) of the traced call")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=None, help="warm-up requests of 8 tokens (default: the batch size)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (the pair in bf16 on a GPU)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.batch_size < 2 or args.prompts < 1:
        ap.error("--batch-size must be >= 2 (the budget decides for batches) and --prompts >= 1")
    pair = load_pair(device=args.device)
    try:
        parse_arm(args.arm, pair.heads["greedy"])
    except ValueError as e:
        ap.error(str(e))
    prompts = [torch.tensor(pair.tokenizer(t)["input_ids"]) for t in load_prompts("humaneval", args.prompts)]
    warmup = args.batch_size if args.warmup is None else args.warmup
    result = {"machine": machine_description(pair), "batch_size": args.batch_size, "arm": args.arm,
              "command": "python bench/budget_trace.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              **trace(pair, pair.heads["greedy"], prompts, args.batch_size, args.arm, args.max_new_tokens, warmup)}
    print(json.dumps(result["summary"], indent=1))
    save_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
