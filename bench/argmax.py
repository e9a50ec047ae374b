"""Greedy tokens on a CPU: ``ops.argmax_tokens`` (two vectorised passes per row) against ``torch.argmax`` and
``torch.max(..., -1).indices``, by batch size, vocabulary and dtype, side by side in one process.

The engine takes the argmax of a ``[B, V]`` row block at every greedy draft step and plain step; the bundled pair
has V = 8,192, Llama-2 32,000, Llama-3 128,256. Each call is timed alone, the three alternating in a balanced order
(``benchmark.balanced_order``), medians of ``--repeats``. Each variant's tokens are checked against torch.argmax
first (on Gaussian logits the three agree; ties and NaN are the tests' business, ``tests/test_ops.py``).

    python bench/argmax.py --out docs/results/argmax_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from specdec_ext import ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import time_pair  # noqa: E402
from budget_paired import save_result  # noqa: E402  (the JSON writer)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def measure(batches, vocabs, dtypes, repeats: int = 200) -> list[dict]:
    """One row per (dtype, V, B): median µs per call of each variant, and the op's speed-up over torch.argmax."""
    rows = []
    for name in dtypes:
        for V in vocabs:
            for B in batches:
                x = torch.randn(B, V, generator=torch.Generator().manual_seed(B + V)).to(DTYPES[name])
                fns = {"argmax_tokens": lambda: ops.argmax_tokens(x), "torch.argmax": lambda: torch.argmax(x, -1),
                       "torch.max": lambda: torch.max(x, -1).indices}
                want = torch.argmax(x, -1)
                if not all(torch.equal(fn(), want) for fn in fns.values()):
                    raise AssertionError(f"the variants disagree at dtype {name}, V = {V}, B = {B}")
                us = time_pair(fns, repeats, balanced=True)
                row = {"dtype": name, "V": V, "B": B, "us": {k: round(v, 1) for k, v in us.items()},
                       "speedup_over_argmax": round(us["torch.argmax"] / us["argmax_tokens"], 2)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--vocabs", default="8192,32000,128256")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None, help="JSON of the rows and the machine")
    args = ap.parse_args(argv)
    if not ops.HAS_EXTENSION:
        ap.error("the compiled extension is not built: the op would be torch.argmax itself")
    dtypes = [d for d in args.dtypes.split(",") if d]
    if any(d not in DTYPES for d in dtypes):
        ap.error(f"--dtypes: each of {', '.join(DTYPES)}")
    rows = measure([int(b) for b in args.batch_sizes.split(",")], [int(v) for v in args.vocabs.split(",")], dtypes,
                   args.repeats)
    meta = {"torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "command": "python bench/argmax.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    save_result(args.out, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
