"""The acceptance head's drafting step (``ops.acceptance_head_step``) by head width: its kernels against the
PyTorch composition of the same head (``reference.acceptance_head_forward``: a matmul per layer).

On CUDA the op has two kernels (``csrc/cuda/verify.cu``): *fused*, one thread block per row that reads every
layer's H x H weights alone (one launch), and *split*, a launch per stage with the blocks spread over the GPU
(x_0, each residual block, the output layer). Both are timed at each shape, forced with the environment variable
``SPECDEC_HEAD_KERNEL=fused|split`` (read at each call), beside the op's own choice by width and the composition;
on a CPU the op's CPU kernel and the composition. Heads of L = 3 residual blocks (the paper's, Sec. 4.1) with the
three draft-confidence features of the bundled heads. Each call is timed from a synchronised start to a
synchronised end (host wall clock: launch overhead counts, as in a drafting step that reads the stop flags); the
variants alternate in a balanced order (``benchmark.balanced_order``), medians of ``--repeats``. Each variant's p_hat
is checked against the composition's first.

    python bench/head_step.py --device cuda --out docs/results/head_step_cuda_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

from specdec_ext import ops, reference

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import time_pair  # noqa: E402

ENV = "SPECDEC_HEAD_KERNEL"


def head_inputs(B: int, H: int, L: int = 3, F: int = 3, device: str = "cpu", seed: int = 0):
    """(hidden, features, feature_weight, feature_bias, block_weight, block_bias, out_weight, out_bias): a head of
    width H with weights scaled so that x stays of order 1 through the L blocks."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(B, H, generator=g), torch.rand(B, F, generator=g), torch.randn(H, F, generator=g) * 0.5,
         torch.randn(H, generator=g) * 0.1, torch.randn(L, H, H, generator=g) / H**0.5,
         torch.randn(L, H, generator=g) * 0.1, torch.randn(H, generator=g) / H**0.5, torch.randn(1, generator=g))
    return tuple(x.to(device) for x in t)


def _kernel(name: str, args, cum):
    """The op with its CUDA kernel forced to ``name`` (None: the op's own choice)."""
    def run():
        old = os.environ.pop(ENV, None)
        if name is not None:
            os.environ[ENV] = name
        try:
            return ops.acceptance_head_step(*args, cum.fill_(1.0), 1, 1, 20, 0.5)
        finally:
            os.environ.pop(ENV, None)
            if old is not None:
                os.environ[ENV] = old
    return run


def measure(device: str, widths, batches, layers: int = 3, repeats: int = 30) -> list[dict]:
    """One row per (H, B): median µs per call of each variant, and each variant's largest |p_hat - composition|."""
    rows = []
    for H in widths:
        for B in batches:
            args = head_inputs(B, H, layers, device=device)
            cum = torch.ones(B, device=device)
            fns = {"composition": lambda: reference.acceptance_head_step(*args, cum.fill_(1.0), 1, 1, 20, 0.5),
                   "op": _kernel(None, args, cum)}
            if device == "cuda":
                fns["fused"] = _kernel("fused", args, cum)
                fns["split"] = _kernel("split", args, cum)
            want = fns["composition"]()[0]
            err = {name: float((fn()[0] - want).abs().max()) for name, fn in fns.items() if name != "composition"}
            us = time_pair(fns, repeats, device, balanced=True)
            row = {"H": H, "B": B, "L": layers, "us": {k: round(v, 1) for k, v in us.items()},
                   "max_abs_err": err}
            if device == "cuda":
                row["split_speedup"] = round(us["fused"] / us["split"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--widths", default="64,128,256,512,1024,2048,4096", help="head widths H (the draft's hidden size)")
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None, help="JSON of the rows and the machine")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible")
    if not ops.HAS_EXTENSION:
        ap.error("the compiled extension is not built: the op would be the reference itself")
    widths = [int(x) for x in args.widths.split(",")]
    batches = [int(x) for x in args.batch_sizes.split(",")]
    rows = measure(args.device, widths, batches, repeats=args.repeats)
    if args.out is not None:
        meta = {"device": args.device, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                "command": "python bench/head_step.py " + " ".join(argv if argv is not None else sys.argv[1:])}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
