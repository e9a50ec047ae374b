"""The draft's dtype on a CPU: the bundled draft in float32 (the default) against a bfloat16 copy, end to end.

A draft step's cost at its few rows is mostly its matmuls (``bench/draft_linear.py``: the LM head alone, 256 x
8192, took about 1 ms in float32 through ``F.linear`` on the AMD EPYC, before the runner packed its weights for
oneDNN), and bfloat16 halves the bytes each one reads. This measures the difference where it happens: the same
generator settings with either draft, greedy, continuous batching at each batch size, the two dtypes alternating
stream by stream (``--prompts`` prompts in streams of ``--rows-per-stream`` per batch slot) in one process. The share of requests with the same tokens under both drafts is reported: greedy speculative decoding
emits the target's argmax, but a bf16 target's logits move with the shape of its forward (how many candidates a
row verifies, the rows beside it), so where two tokens nearly tie a different draft can flip the text.

    python bench/draft_dtype.py --out docs/results/draft_dtype.json   # about 4 minutes
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.benchmark import machine_description
from specdec_ext.policies import make_policy
from specdec_ext.prompts import load_prompts
from specdec_ext.zoo import load_pair

DTYPES = ("float32", "bfloat16")


def compare(pair, prompts: list, batch_size: int, k: int, max_new_tokens: int, rows_per_stream: int) -> dict:
    """tokens/s of fixed K = ``k`` with each draft dtype at ``batch_size`` (the dtypes alternate per stream), the
    ratio bfloat16 / float32, accepted candidates, and the share of requests whose tokens are the same with either."""
    drafts = {"float32": pair.draft, "bfloat16": copy.deepcopy(pair.draft).to(torch.bfloat16)}
    gens = {d: SpeculativeGenerator(pair.target, m, policy=make_policy("fixed", k=k)) for d, m in drafts.items()}
    eos = pair.tokenizer.eos_token_id
    for g in gens.values():  # warm-up at this batch size
        g.generate_continuous(prompts[:batch_size], batch_size, max_new_tokens=8, temperature=0, eos_token_id=eos)
    seconds = dict.fromkeys(DTYPES, 0.0)
    tokens = dict.fromkeys(DTYPES, 0)
    accepted = dict.fromkeys(DTYPES, 0)
    texts: dict = {d: [] for d in DTYPES}
    step = rows_per_stream * batch_size
    for i, start in enumerate(range(0, len(prompts), step)):
        stream = prompts[start:start + step]
        for d in (DTYPES if i % 2 == 0 else DTYPES[::-1]):
            t0 = time.perf_counter()
            out = gens[d].generate_continuous(stream, batch_size, max_new_tokens=max_new_tokens, temperature=0,
                                              eos_token_id=eos)
            seconds[d] += time.perf_counter() - t0
            tokens[d] += out.stats.new_tokens
            accepted[d] += sum(sum(r.accepted) for r in out.stats.rounds)
            texts[d].extend(out.new_tokens)
    rate = {d: tokens[d] / seconds[d] for d in DTYPES}
    return {"batch_size": batch_size, "k": k, "tokens_per_s": rate, "accepted": accepted,
            "bfloat16_over_float32": rate["bfloat16"] / rate["float32"],
            "same_tokens": sum(x == y for x, y in zip(texts["float32"], texts["bfloat16"])) / len(prompts)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,4", help="comma-separated batch sizes")
    ap.add_argument("--k", type=int, default=2, help="fixed candidate length K")
    ap.add_argument("--prompts", type=int, default=128, help="HumanEval prompts per batch size")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rows-per-stream", type=int, default=4, help="prompts per stream and batch slot")
    ap.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = ap.parse_args(argv)
    pair = load_pair(draft_dtype=torch.float32)
    prompts = [torch.tensor(pair.tokenizer(p)["input_ids"]) for p in load_prompts("humaneval")[:args.prompts]]
    t0 = time.perf_counter()
    rows = [compare(pair, prompts, int(b), args.k, args.max_new_tokens, args.rows_per_stream)
            for b in args.batch_sizes.split(",")]
    result = {"machine": machine_description(pair), "seconds": time.perf_counter() - t0,
              "command": "python bench/draft_dtype.py " + " ".join(argv if argv is not None else []), "rows": rows}
    for r in rows:
        print(f"B = {r['batch_size']}, K = {r['k']}: float32 {r['tokens_per_s']['float32']:.1f} tokens/s, "
              f"bfloat16 {r['tokens_per_s']['bfloat16']:.1f} ({r['bfloat16_over_float32']:.3f}x), "
              f"same tokens: {r['same_tokens']:.0%} of requests")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
