"""Kernel benchmark: the fused verify op against Hugging Face's `_speculative_sampling` composition.

Both start from the same logits (temperature 1): Hugging Face's function softmaxes [1, K, V] and
[1, K+1, V], gathers, compares, builds the residual and calls multinomial; it handles batch size
1, so a batch of B rows is B calls. The fused op (`chain_verify_logits`) does the whole batch in
one call without writing probabilities. Run side by side in one process, alternating, medians.

    python bench/bench_ops.py [--quick] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers.generation.utils import _speculative_sampling

from specdec_ext import ops


def make_inputs(B, K, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(B, K + 1, V, generator=g) * 3
    draft = target[:, :K] + torch.randn(B, K, V, generator=g)  # a draft that mostly agrees
    ids = torch.multinomial(torch.softmax(draft.reshape(-1, V), -1), 1, generator=g).view(B, K)
    return ids, draft, target


def hf_composition(ids, draft, target):
    K = ids.shape[1]
    for b in range(ids.shape[0]):
        _speculative_sampling(ids[b : b + 1], draft[b : b + 1], K, target[b : b + 1])


def fused(ids, draft, target, temp, so):
    ops.chain_verify_logits(ids, draft, target, temp, philox_seed_offset=so)


def time_pair(fns, repeats):
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():  # alternate, so drift hits both alike
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e6)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    Bs, Ks, Vs = ([1, 8], [1, 8], [32000]) if args.quick else ([1, 8, 64], [1, 4, 8], [32000, 128256])
    rows = []
    print(f"{'B':>3} {'K':>2} {'V':>7} | {'HF composition (us)':>20} {'fused op (us)':>14} {'speedup':>8}")
    for V in Vs:
        for B in Bs:
            for K in Ks:
                ids, draft, target = make_inputs(B, K, V)
                temp = torch.ones(B)
                so = torch.tensor([1, 2])
                work = B * (K + 1) * V
                repeats = max(3, min(50, int(2e8 / work)))
                fns = {"hf": lambda: hf_composition(ids, draft, target), "fused": lambda: fused(ids, draft, target, temp, so)}
                for fn in fns.values():
                    fn()  # warm-up
                med = time_pair(fns, repeats)
                ratio = med["hf"] / med["fused"]
                rows.append({"B": B, "K": K, "V": V, "hf_us": med["hf"], "fused_us": med["fused"], "speedup": ratio,
                             "repeats": repeats})
                print(f"{B:>3} {K:>2} {V:>7} | {med['hf']:>20.1f} {med['fused']:>14.1f} {ratio:>7.1f}x", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}
    (args.out / "ops.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    md = ["| B | K | V | HF `_speculative_sampling` (µs) | fused `chain_verify_logits` (µs) | speedup |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['B']} | {r['K']} | {r['V']} | {r['hf_us']:.0f} | {r['fused_us']:.0f} | {r['speedup']:.1f}× |" for r in rows]
    (args.out / "ops.md").write_text("\n".join(md) + "\n")
    print(f"wrote {args.out / 'ops.json'} and {args.out / 'ops.md'}")


if __name__ == "__main__":
    main()
