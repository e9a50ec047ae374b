"""Attention over a KV cache on the CPU: torch's fused kernel, an explicit one and this project's
``ops.decode_attention``, by queries per row.

Why this exists: in the batch benchmark (README, "Batches of requests") plain decoding of the bf16 target
gives fewer tokens/s at B = 64 than at B = 16, and a verification pass over 2 tokens per row costs less
than a plain step over 1. Profiling one target forward put 80% of it in
``aten::_scaled_dot_product_flash_attention_for_cpu``. This script isolates that: one attention layer of
the bundled target's shape (8 heads of 64, a boolean mask as the runners pass it) over ``[B, heads, C, 64]``
keys and values, for n = 1, 2, 5 queries per row, timed as ``F.scaled_dot_product_attention`` (what
transformers' "sdpa" attention calls), as matmul -> masked softmax (fp32) -> matmul, and as
``ops.decode_attention`` (``attn_implementation="specdec_decode"``, ``engine/attention.py``), on the same inputs
(10% of the columns holes). All run in one process, medians of ``--reps``; ms per call.

    python bench/attention_cpu.py [--quick] [--out docs/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec_ext import ops
from specdec_ext.engine.profile import processor_name


def explicit_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(d), masked) v with the softmax in fp32; q ``[B, h, n, d]``, k/v ``[B, h, C, d]``,
    mask ``[B, 1, n, C]`` bool (True: may attend)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    scores = scores.float().masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1).to(q.dtype), v)


def inputs(B, heads, C, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, n, 64, generator=g).to(dtype)
    k = torch.randn(B, heads, C, 64, generator=g).to(dtype)
    v = torch.randn(B, heads, C, 64, generator=g).to(dtype)
    mask = torch.rand(B, 1, n, C, generator=g) > 0.1  # holes, as rows with rejected positions have
    mask[..., -1] = True
    return q, k, v, mask


def timed(fn, reps):
    for _ in range(2):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    reps = 5 if args.quick else args.reps
    sizes = [(16, 384), (64, 384)] if args.quick else [(4, 128), (16, 128), (16, 384), (64, 128), (64, 384)]
    rows = []
    print("| dtype | B | cache columns | queries per row | sdpa ms | explicit ms | kernel ms | sdpa / explicit "
          "| sdpa / kernel | max abs diff (explicit, kernel) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for B, C in sizes:
            for n in (1, 2, 5):
                q, k, v, mask = inputs(B, 8, C, n, dtype)
                sdpa = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), reps)
                explicit = timed(lambda: explicit_attention(q, k, v, mask), reps)
                kernel = timed(lambda: ops.decode_attention(q, k, v, mask, 64 ** -0.5), reps)
                want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).float()
                diff = (want - explicit_attention(q, k, v, mask).float()).abs().max().item()
                kdiff = (want - ops.decode_attention(q, k, v, mask, 64 ** -0.5).transpose(1, 2).float()).abs().max().item()
                row = {"dtype": str(dtype).replace("torch.", ""), "B": B, "columns": C, "queries": n,
                       "sdpa_ms": sdpa, "explicit_ms": explicit, "kernel_ms": kernel, "max_abs_diff": diff,
                       "kernel_max_abs_diff": kdiff}
                rows.append(row)
                print(f"| {row['dtype']} | {B} | {C} | {n} | {sdpa:.2f} | {explicit:.2f} | {kernel:.2f} "
                      f"| {sdpa / explicit:.2f}× | {sdpa / kernel:.2f}× | {diff:.1e}, {kdiff:.1e} |", flush=True)
    meta = {"processor": processor_name(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "heads": 8, "head_dim": 64, "reps": reps,
            "command": "python bench/attention_cpu.py" + (" --quick" if args.quick else "")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out / 'attention_cpu.json'}")


if __name__ == "__main__":
    main()
