"""The draft reading a recent window of each request's context (``SpeculativeGenerator(draft_context=W)``) against
reading all of it.

Under continuous batching the draft reads each request's prompt when it first drafts for it: prefill work that
plain decoding never does and the rounds must repay (``SpeculativeGenerator._draft_overhead``). A draft that reads
only the last W tokens does a fraction of that work and proposes from less context; the output stays the target's.
This runs fixed K for the bundled pair in one process, greedy, continuous batching of HumanEval prompts, every
window alternating stream by stream (``benchmark.alternate_streams``): aggregate and decoding tokens/s, the
acceptance rate (accepted over drafted candidates), the draft's read seconds, and each window's per-stream ratio to
the full context.

    python bench/draft_context.py --batch-sizes 4,16 --ks 1,2 --windows all,64,32 \\
        --out docs/results/draft_context.json   # about 7 minutes (401 s)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.benchmark import add_stream_arguments, alternate_streams, machine_description
from specdec_ext.prompts import load_prompts
from specdec_ext.zoo import load_pair


def parse_windows(text: str) -> list:
    """``all,64,32`` -> [None, 64, 32]; ValueError naming a bad entry."""
    out = []
    for w in text.split(","):
        if w == "all":
            out.append(None)
        elif w.isdigit() and int(w) >= 1:
            out.append(int(w))
        else:
            raise ValueError(f"--windows: {w!r} is neither 'all' nor a token count >= 1")
    return out


def compare(pair, prompts: list, batch_size: int, k: int, windows: list, max_new_tokens: int,
            rows_per_stream: int) -> dict:
    """One row: per window (``"all"`` or the count), tokens/s, decode tokens/s, acceptance, read seconds and the
    per-stream ratios to the first window."""
    eos = pair.tokenizer.eos_token_id
    arms = tuple("all" if w is None else str(w) for w in windows)
    gens = {a: SpeculativeGenerator(pair.target, pair.draft, policy="fixed", k=k, draft_context=w)
            for a, w in zip(arms, windows)}

    def generate(arm, stream, n):
        return gens[arm].generate_continuous(stream, batch_size, max_new_tokens=n, temperature=0, eos_token_id=eos)

    r = alternate_streams(generate, arms, prompts, batch_size, rows_per_stream, max_new_tokens)
    return {"batch_size": batch_size, "k": k, "tokens_per_s": r["tokens_per_s"],
            "decode_tokens_per_s": {a: r["tokens"][a] / r["decode_seconds"][a] for a in arms},
            "acceptance": {a: r["accepted"][a] / max(r["drafted"][a], 1) for a in arms},
            "draft_read_seconds": r["draft_prefill_seconds"],
            "over_all_by_stream": {a: [s[a] / s[arms[0]] for s in r["by_stream"]] for a in arms},
            "same_tokens": r["same_tokens"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="4,16")
    ap.add_argument("--ks", default="1,2", help="comma-separated fixed K")
    ap.add_argument("--windows", default="all,64,32", help="comma-separated windows ('all': the whole context)")
    add_stream_arguments(ap, argparse.SUPPRESS)  # its --k is not used: --ks
    ap.set_defaults(rows_per_stream=2)
    args = ap.parse_args(argv)
    windows = parse_windows(args.windows)
    pair = load_pair()
    prompts = [torch.tensor(pair.tokenizer(t)["input_ids"]) for t in load_prompts("humaneval")[:args.prompts]]
    t0 = time.perf_counter()
    rows = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        for k in (int(x) for x in args.ks.split(",")):
            row = compare(pair, prompts, b, k, windows, args.max_new_tokens, args.rows_per_stream)
            rows.append(row)
            for a, rate in row["tokens_per_s"].items():
                s = row["over_all_by_stream"][a]
                print(f"B = {b}, K = {k}, window {a}: {rate:.1f} tokens/s (streams {min(s):.3f}-{max(s):.3f}x the "
                      f"whole context), decoding {row['decode_tokens_per_s'][a]:.1f}, acceptance "
                      f"{row['acceptance'][a]:.3f}, draft reads {row['draft_read_seconds'][a]:.2f} s", flush=True)
    result = {"machine": machine_description(pair), "seconds": time.perf_counter() - t0,
              "command": "python bench/draft_context.py " + " ".join(argv if argv is not None else []), "rows": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
