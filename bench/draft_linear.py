"""The lean draft runner's matmuls on a CPU: oneDNN with packed weights against torch's ``F.linear``.

At the few rows of a draft step, ``F.linear`` in float32 runs MKL's sgemm, which on some processors is far
from the hardware's speed (on the AMD EPYC of these benchmarks a ``[4, 256] x [256, 8192]`` LM-head matmul
took about 1 ms); ``engine/fast_llama.py`` therefore packs the draft's weights once for oneDNN. This measures,
for the bundled pair in one process, side by side:

- the draft step alone: one ``FastLlamaRunner`` forward of one token per row after a 128-token prompt, then
  the rollback a rejected candidate costs (ms, median of alternating blocks), at each batch size;
- end to end: fixed K (default 2), greedy, continuous batching, the two runners alternating stream by stream
  (tokens/s, accepted candidates, and the share of requests with the same tokens: the two draft forwards agree
  to about 1e-5 in the logits, and a bf16 target's logits move with the shape of its forward, so a different
  candidate can flip a near-tie of the target).

    python bench/draft_linear.py --out docs/results/draft_linear.json   # about 4 minutes
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec_ext.benchmark import add_stream_arguments, arms_line, compare_switched_arms, machine_description
from specdec_ext.engine.fast_llama import FastLlamaRunner, packed_linear_available
from specdec_ext.prompts import load_prompts
from specdec_ext.zoo import load_pair

RUNNERS = ("packed", "F.linear")


def step_ms(draft, batch_size: int, context: int = 128, steps: int = 20, blocks: int = 10, seed: int = 0) -> dict:
    """Median ms of one draft step ([batch_size, 1] tokens, then a one-token rollback) with each runner, the
    two alternating in blocks of ``steps``; and the packed runner's speed-up."""
    g = torch.Generator().manual_seed(seed)
    V = draft.config.vocab_size
    runners = {}
    for name in RUNNERS:
        r = FastLlamaRunner(draft, packed=name == "packed")
        r.start(batch_size, capacity=context + 8)
        r.forward(torch.randint(0, V, (batch_size, context), generator=g))
        runners[name] = r
    one = torch.ones(batch_size, dtype=torch.long)
    tokens = torch.randint(0, V, (batch_size, 1), generator=g)
    times: dict = {name: [] for name in RUNNERS}
    for b in range(blocks + 1):
        for name in (RUNNERS if b % 2 == 0 else RUNNERS[::-1]):
            r = runners[name]
            t0 = time.perf_counter()
            for _ in range(steps):
                r.forward(tokens)
                r.rollback(one)
            if b > 0:  # the first block warms up
                times[name].append((time.perf_counter() - t0) / steps * 1e3)
    ms = {name: statistics.median(v) for name, v in times.items()}
    return {"batch_size": batch_size, "step_ms": ms, "speedup": ms["F.linear"] / ms["packed"]}


def end_to_end(pair, prompts: list, batch_size: int, k: int, max_new_tokens: int, rows_per_stream: int) -> dict:
    """tokens/s of fixed K = ``k`` with each runner at ``batch_size`` (alternating per stream), the ratio packed /
    F.linear, accepted candidates, and the share of requests whose tokens are the same with either."""

    def switch(arm):  # the generator makes its draft runner per call; None: the runner's own default again
        FastLlamaRunner.packed_default = None if arm is None else arm == "packed"

    return compare_switched_arms(pair, prompts, batch_size, k, max_new_tokens, rows_per_stream, RUNNERS, switch,
                                 "packed_over_linear")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,4,16", help="comma-separated batch sizes of the draft step alone")
    ap.add_argument("--e2e-batch-sizes", default="1,4", help="comma-separated batch sizes end to end")
    add_stream_arguments(ap, "fixed candidate length K end to end")
    args = ap.parse_args(argv)
    pair = load_pair()
    p = next(pair.draft.parameters())
    if not packed_linear_available(p.device, p.dtype):
        raise SystemExit("draft_linear.py: this torch or draft has no oneDNN packed linear; nothing to compare")
    prompts = [torch.tensor(pair.tokenizer(t)["input_ids"]) for t in load_prompts("humaneval")[:args.prompts]]
    t0 = time.perf_counter()
    steps = [step_ms(pair.draft, int(b)) for b in args.batch_sizes.split(",")]
    rows = [end_to_end(pair, prompts, int(b), args.k, args.max_new_tokens, args.rows_per_stream)
            for b in args.e2e_batch_sizes.split(",")]
    result = {"machine": machine_description(pair), "seconds": time.perf_counter() - t0,
              "command": "python bench/draft_linear.py " + " ".join(argv if argv is not None else []),
              "draft_step": steps, "end_to_end": rows}
    for s in steps:
        print(f"draft step, B = {s['batch_size']}: packed {s['step_ms']['packed']:.2f} ms, F.linear "
              f"{s['step_ms']['F.linear']:.2f} ms ({s['speedup']:.2f}x)")
    for r in rows:
        print(arms_line(r, "packed_over_linear"))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
