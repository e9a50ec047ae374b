"""The lean model's forward with each layer one ``ops.decoder_layer`` call (weights in panels, ``fused=True``)
against its torch-op path (oneDNN's packed matmuls and ~50 ops a layer, ``fused=False``), side by side in one
process on a CPU (float32, or bfloat16 with ``--dtype``), at each token count of a forward (B rows x n tokens: a decode step, a verification, a
batch's); the arms interleaved, each forward timed over a cache of ``--context`` filled columns that is set back
after every call. Also the time ``torch.sum`` takes to read a buffer the size of the weights, in the same run.
Sets ``engine.model.FUSED_MAX_ROWS`` (per dtype): the largest token count where the fused layer wins (the fused arm
runs at every count asked for, past the shipped limit, which the JSON records).

    python bench/fused_layers.py --shape smollm2-135m --out fused_layers.json   # docs/results/smollm2.json.gz keeps one
    python bench/fused_layers.py --shape tiny     # a self-check, seconds
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from scale_probe import model_for, sum_bandwidth, weight_bytes  # noqa: E402
from specdec_ext.engine.model import FUSED_MAX_ROWS, LeanModel  # noqa: E402


def timed_forward(lean: LeanModel, cache, tokens: torch.Tensor, context: int) -> float:
    """ms of one forward of ``tokens`` ``[B, n]`` after ``context`` columns, the cache set back afterwards."""
    cache.lengths.fill_(context)
    t0 = time.perf_counter()
    lean.forward(cache, tokens, keep=tokens.shape[1], start=context)
    return (time.perf_counter() - t0) * 1e3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rows", default="1x1,1x2,1x3,1x4,1x5,1x6,1x8,1x9,2x5,1x12,1x16",
                    help="B x n token counts of a forward")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the model's dtype")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = model_for(args.shape, "cpu", getattr(torch, args.dtype), 4096)
    counts = [int(b) * int(n) for b, n in (spec.split("x") for spec in args.rows.split(","))]
    shipped = FUSED_MAX_ROWS[model.dtype]
    FUSED_MAX_ROWS[model.dtype] = max(counts + [shipped])  # the fused arm at every count; restored below
    arms = {"fused": LeanModel(model, "target", fused=True), "torch_ops": LeanModel(model, "target", fused=False)}
    read_ms = weight_bytes(model) / sum_bandwidth("cpu", weight_bytes(model)) * 1e3
    rows = []
    try:
        with torch.inference_mode():
            for spec in args.rows.split(","):
                B, n = map(int, spec.split("x"))
                caches = {k: lean.cache(B, args.context + 64) for k, lean in arms.items()}
                tokens = torch.randint(2, min(1000, model.config.vocab_size), (B, n))
                times = {k: [] for k in arms}
                for k, lean in arms.items():  # warm-up: oneDNN's primitive for this shape
                    timed_forward(lean, caches[k], tokens, args.context)
                for _ in range(args.repeats):
                    for k, lean in arms.items():
                        times[k].append(timed_forward(lean, caches[k], tokens, args.context))
                med = {k: statistics.median(v) for k, v in times.items()}
                rows.append({"batch": B, "tokens": n, "rows": B * n, **{f"{k}_ms": v for k, v in med.items()},
                             "fused_over_torch_ops": med["fused"] / med["torch_ops"],
                             "fused_over_read": med["fused"] / read_ms})
                print(f"{B}x{n}: fused {med['fused']:.2f} ms, torch ops {med['torch_ops']:.2f} ms "
                      f"({med['fused'] / med['torch_ops']:.2f}x); the read {read_ms:.2f} ms")
    finally:
        FUSED_MAX_ROWS[model.dtype] = shipped
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"meta": {"shape": args.shape, "context": args.context, "repeats": args.repeats, "dtype": args.dtype,
                       "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
                       "processor": platform.processor(), "commit": commit, "fused_max_rows": shipped,
                       "date": time.strftime("%Y-%m-%d"), "command": "python bench/fused_layers.py " + " ".join(
                           argv if argv is not None else sys.argv[1:])},
              "weight_read_ms": read_ms, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
