"""Time per token of a tensor-parallel target, against one process, with the bundled pair.

Run the same command once per setting, on an otherwise idle machine, and compare the rows of the JSON:

    OMP_NUM_THREADS=1 python bench/tp_bench.py --out docs/results/tp.json                      # 1 process, 1 thread
    python bench/tp_bench.py --threads 2 --out docs/results/tp.json                            # 1 process, 2 threads
    torchrun --standalone --nproc-per-node 2 bench/tp_bench.py --tp 2 --out docs/results/tp.json  # 2 ranks x 1 thread

Each run appends one row ``{"setting", "method", "ms_per_token", "tokens", ...}`` per method (plain decoding and
SpecDec++ at h = 0.8, greedy, HumanEval prompts). Under ``--tp`` it also measures what the alternative
design would cost: a broadcast of rank 0's accept/reject decisions (``[1, K + 1]`` int64) each round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.engine.tensor_parallel import distributed, is_main_process
from specdec_ext.prompts import load_prompts
from specdec_ext.zoo import load_pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pair = load_pair(tp=args.tp)
    tok = pair.tokenizer
    prompts = [tok(p)["input_ids"] for p in load_prompts("humaneval")[: args.prompts]]
    gen = SpeculativeGenerator(pair.target, pair.draft, head=pair.head, policy="autoregressive")
    methods = {"plain": {"policy": "autoregressive"}, "specdec++ h=0.8": {"policy": "specdecpp", "threshold": 0.8}}
    gen.generate(torch.tensor([prompts[0]]), max_new_tokens=8, temperature=0, **methods["plain"])  # warm-up
    totals = {m: [0.0, 0, 0] for m in methods}  # ms, tokens, rounds
    for ids in prompts:
        for m, kw in methods.items():  # interleaved, prompt by prompt
            out = gen.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, temperature=0, **kw)
            totals[m][0] += out.stats.wall_ms
            totals[m][1] += out.stats.new_tokens
            totals[m][2] += len(out.stats.rounds)
    setting = f"tp={args.tp} x {torch.get_num_threads()} thread(s)" if args.tp > 1 else \
        f"1 process x {torch.get_num_threads()} thread(s)"
    rows = [{"setting": setting, "method": m, "ms_per_token": round(ms / n, 3), "tokens": n, "rounds": r,
             "target_dtype": str(next(pair.target.parameters()).dtype), "prompts": args.prompts,
             "max_new_tokens": args.max_new_tokens} for m, (ms, n, r) in totals.items()]
    if distributed():
        x = torch.zeros(1, 9, dtype=torch.int64)
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            torch.distributed.broadcast(x, src=0)
            times.append((time.perf_counter() - t0) * 1e3)
        sd = totals["specdec++ h=0.8"]
        for row in rows:
            row["broadcast_ms_per_round"] = round(statistics.median(times), 4)
        rows[-1]["round_ms"] = round(sd[0] / sd[2], 3)
    if is_main_process():
        old = json.loads(args.out.read_text()) if args.out.exists() else []
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(old + rows, indent=1))
        for row in rows:
            print(json.dumps(row))


if __name__ == "__main__":
    main()
