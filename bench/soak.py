"""A soak of continuous batching: thousands of requests of every length through one generator, resident memory
watched, every greedy request checked against its output alone.

One ``generate_continuous`` call serves N requests (default 2,000) with at most B live (default 16): prompts of
1-200 tokens cut at random from HumanEval's prompts, 1-128 new tokens each, EOS on, a mix of greedy and sampling
requests (temperature 0.7, 1.0 or 1.3, some with top-k or top-p). A thread samples the process's resident memory
every 0.2 s; the run reports it after the first 200 requests have finished and at the end. Then every greedy
request is decoded again alone (``generate``) and must emit the same tokens: the models run in float32, where a
row's tokens do not depend on the rows beside it (in bfloat16 a batched forward rounds differently from a
single-row one, so near-ties may differ). Exit status 1 on a mismatch or on resident memory growing more than
``--max-growth`` (5%) from the first mark to the end.

On a CPU oneDNN keeps a compiled primitive per matmul shape in two caches of 1,024 entries each
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, and ``LRU_CACHE_CAPACITY`` for PyTorch's wrapper of it); prompts of every
length would bring new shapes, so the lean model pads a prefill's token count to a few buckets
(``engine.model.bucketed_rows``); ``--no-bucketing`` turns that off, to see what it saves. The JSON records both
variables.

    python bench/soak.py --out docs/results/soak_b16.json
    python bench/soak.py --no-bucketing --out docs/results/soak_b16_unbucketed.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.benchmark import machine_description
from specdec_ext.engine import model as lean_model
from specdec_ext.prompts import load_prompts
from specdec_ext.zoo import load_pair


def resident_bytes() -> int:
    """This process's resident memory, bytes (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Sampler(threading.Thread):
    """Resident memory every ``period`` s: ``(seconds since start, bytes)``."""

    def __init__(self, period: float = 0.2):
        super().__init__(daemon=True)
        self.period, self.samples, self.t0 = period, [], time.perf_counter()
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set():
            self.samples.append((time.perf_counter() - self.t0, resident_bytes()))
            self.done.wait(self.period)

    def at(self, seconds: float) -> int:
        """The first sample taken at or after ``seconds``."""
        return next((b for t, b in self.samples if t >= seconds), self.samples[-1][1])


def requests(tokenizer, n: int, rng: random.Random) -> list[dict]:
    """N requests: a prompt of 1-200 tokens from a random place in HumanEval's prompts, 1-128 new tokens, and
    sampling settings (half greedy)."""
    text = [tokenizer(t)["input_ids"] for t in load_prompts("humaneval")]
    stream = [t for ids in text for t in ids]
    out = []
    for i in range(n):
        length = rng.randint(1, 200)
        start = rng.randrange(0, len(stream) - length)
        greedy = rng.random() < 0.5
        t = 0.0 if greedy else rng.choice([0.7, 1.0, 1.3])
        k = None if greedy or rng.random() < 0.7 else rng.choice([5, 20, 50])
        p = None if greedy or rng.random() < 0.7 else rng.choice([0.8, 0.95])
        out.append({"prompt": stream[start: start + length], "new": rng.randint(1, 128), "temperature": t,
                    "top_k": k, "top_p": p, "seed": 1000 + i})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--policy", default="specdecpp", help="fixed (with --k) or specdecpp (threshold auto)")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--mark", type=int, default=200, help="resident memory after this many requests finished")
    ap.add_argument("--max-growth", type=float, default=0.05, help="allowed growth from the mark to the end")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-bucketing", action="store_true",
                    help="prefills' projections over their exact token counts (engine.model.BUCKET_ABOVE off)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.no_bucketing:
        lean_model.BUCKET_ABOVE = 1 << 62
    pair = load_pair(target_dtype=torch.float32, draft_dtype=torch.float32)
    kw = dict(threshold="auto", head=pair.head) if args.policy == "specdecpp" else dict(k=args.k)
    gen = SpeculativeGenerator(pair.target, pair.draft, policy=args.policy, **kw)
    reqs = requests(pair.tokenizer, args.requests, random.Random(args.seed))
    eos = pair.tokenizer.eos_token_id
    gen.prepare(args.batch_size)  # cost profiles and warm-up before the memory marks
    sampler = Sampler()
    sampler.start()
    t0 = time.perf_counter()
    out = gen.generate_continuous([r["prompt"] for r in reqs], batch_size=args.batch_size,
                                  max_new_tokens=[r["new"] for r in reqs],
                                  temperature=[r["temperature"] for r in reqs], top_k=[r["top_k"] for r in reqs],
                                  top_p=[r["top_p"] for r in reqs], seed=[r["seed"] for r in reqs], eos_token_id=eos)
    serve_s = time.perf_counter() - t0
    policy = gen.policy.describe()  # as the batch configured it (the checks below decode greedily)
    sampler.done.set()
    sampler.join()
    end_rss = resident_bytes()
    mark_s = (t0 - sampler.t0) + sorted(out.finished_ms)[args.mark - 1] / 1e3
    mark_rss = sampler.at(mark_s)
    growth = end_rss / mark_rss - 1
    print(f"served {len(reqs)} requests, {out.stats.new_tokens} tokens in {serve_s:.1f} s "
          f"({out.stats.new_tokens / serve_s:.1f} tokens/s); resident memory after {args.mark} requests "
          f"{mark_rss / 2**20:.1f} MiB, at the end {end_rss / 2**20:.1f} MiB ({growth:+.2%})", flush=True)
    greedy = [i for i, r in enumerate(reqs) if r["temperature"] == 0]
    mismatches = []
    t1 = time.perf_counter()
    for i in greedy:
        r = reqs[i]
        alone = gen.generate(torch.tensor([r["prompt"]]), max_new_tokens=r["new"], temperature=0,
                             eos_token_id=eos).new_tokens[0]
        if alone != out.new_tokens[i]:
            mismatches.append(i)
    print(f"greedy requests checked alone: {len(greedy)}, mismatches {len(mismatches)} "
          f"({time.perf_counter() - t1:.0f} s)", flush=True)
    ok = not mismatches and growth <= args.max_growth
    caches = {k: os.environ.get(k) for k in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    result = {"machine": machine_description(pair), "command": "python bench/soak.py " + " ".join(argv or []),
              "onednn_caches": caches, "prefill_bucketing": not args.no_bucketing,
              "date": time.strftime("%Y-%m-%d"), "requests": len(reqs), "batch_size": args.batch_size,
              "policy": policy, "new_tokens": out.stats.new_tokens, "serve_seconds": round(serve_s, 1),
              "eos_ended": sum(1 for i, r in enumerate(reqs) if len(out.new_tokens[i]) < r["new"]),
              "sampling_requests": len(reqs) - len(greedy), "greedy_requests": len(greedy),
              "greedy_mismatches": mismatches, "resident_mib_after_mark": round(mark_rss / 2**20, 1),
              "resident_mib_at_end": round(end_rss / 2**20, 1), "mark_requests": args.mark,
              "resident_growth": round(growth, 4),
              "resident_mib_samples": [[round(t, 1), round(b / 2**20, 1)]
                                       for t, b in sampler.samples[:: max(1, len(sampler.samples) // 200)]],
              "passed": ok}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
