"""What padding costs a batched verification, and what packing the rows saves (``engine/packing.py``).

A verification budget that keeps each row's own top slots (``BatchBudget.depths``) leaves rows of different depths.
The target's forward over ``[B, D + 1]`` then computes every row to the deepest row's D. This times one target
forward of the bundled pair (bf16 target, ``attn_implementation="specdec_decode"``, a cache of ``--context`` columns)
three ways on the same inputs, taking turns within each repetition:

- ``padded``: every slot fed as a real token (what the engine fed before rows could be packed);
- ``holes``: the slots past a row's depth fed as holes (masked; the attention kernel skips them, the linear layers
  do not);
- ``packed``: only the real tokens, packed into one sequence.

Depth patterns per row, for D + 1 = 2 .. 5 tokens in the deepest row: ``uniform`` (every row D), ``one`` (one row 0,
the others D: a fixed K's round in which one row has room for no candidate, its request one token from its end),
``half`` (half the rows 0) and ``spread`` (depths drawn uniformly from 0 .. D, at least one row at D). Medians of
``--reps``, ms. The engine packs a verification only where this measured a gain (``engine.packing.worth_packing``).

    python bench/packed_verify.py --out docs/results/packed_verify.json   # about 2 minutes
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec_ext.benchmark import machine_description
from specdec_ext.engine.runner import CausalLMRunner
from specdec_ext.zoo import load_pair

MODES = ("padded", "holes", "packed")


def depths(pattern: str, B: int, D: int, g: torch.Generator) -> torch.Tensor:
    """Per-row depths ``[B]`` of a pattern (module docstring)."""
    if pattern == "uniform":
        return torch.full((B,), D)
    if pattern == "one":
        return torch.tensor([0] + [D] * (B - 1))
    if pattern == "half":
        return torch.tensor([0 if b % 2 else D for b in range(B)])
    d = torch.randint(0, D + 1, (B,), generator=g)
    d[0] = D
    return d


def measure(model, B: int, context: int, widths, patterns, reps: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    high = min(1000, model.config.vocab_size)  # token ids drawn from [5, high)
    runner = CausalLMRunner(model, "target")
    runner.start(B)
    runner.forward(torch.randint(5, high, (B, context), generator=g), keep=1)
    rows = []
    for n in widths:
        for pattern in patterns:
            d = depths(pattern, B, n - 1, g)
            valid = torch.arange(n).unsqueeze(0) <= d.unsqueeze(1)
            ms = {m: [] for m in MODES}
            for rep in range(reps + 1):
                for m in MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]:
                    tokens = torch.randint(5, high, (B, n), generator=g)
                    fed = torch.ones_like(valid) if m == "padded" else valid
                    t0 = time.perf_counter()
                    runner.forward(tokens, fed, keep=n, packed=m == "packed")
                    if rep:  # the first repetition warms up
                        ms[m].append((time.perf_counter() - t0) * 1e3)
                    runner.rollback(fed.long().sum(1))
            med = {m: statistics.median(v) for m, v in ms.items()}
            rows.append({"batch_size": B, "tokens_per_row_max": n, "pattern": pattern,
                         "real_tokens": int(valid.sum()), "padded_tokens": B * n, "ms": med,
                         "packed_over_padded": med["packed"] / med["padded"],
                         "holes_over_padded": med["holes"] / med["padded"]})
            print(f"B={B} n={n} {pattern:8s} real {rows[-1]['real_tokens']:4d}/{B * n:4d}: "
                  + "  ".join(f"{m} {med[m]:6.1f}" for m in MODES)
                  + f"  packed/padded {rows[-1]['packed_over_padded']:.2f}", flush=True)
    runner.close()
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="16,64")
    ap.add_argument("--widths", default="2,3,5", help="tokens in the deepest row (D + 1)")
    ap.add_argument("--patterns", default="uniform,half,spread")
    ap.add_argument("--context", type=int, default=256, help="cache columns before the forward")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    pair = load_pair(attn_implementation="specdec_decode")
    t0 = time.perf_counter()
    rows = []
    for B in (int(x) for x in args.batch_sizes.split(",")):
        rows += measure(pair.target, B, args.context, [int(x) for x in args.widths.split(",")],
                        args.patterns.split(","), args.reps)
    result = {"machine": machine_description(pair), "seconds": time.perf_counter() - t0,
              "command": "python bench/packed_verify.py " + " ".join(argv if argv is not None else []),
              "context": args.context, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
