"""The draft's dtype on a CPU: the bundled draft in float32 (the default) against a bfloat16 copy, end to end.

A draft step's cost at its few rows is mostly its matmuls (``bench/draft_linear.py``: the LM head alone, 256 x
8192, took about 1 ms in float32 through ``F.linear`` on the AMD EPYC, before the runner packed its weights for
oneDNN), and bfloat16 halves the bytes each one reads. This measures the difference where it happens: the same
generator settings with either draft, greedy, continuous batching at each batch size, the two dtypes alternating
stream by stream (``--prompts`` prompts in streams of ``--rows-per-stream`` per batch slot) in one process. The share of requests with the same tokens under both drafts is reported: greedy speculative decoding
emits the target's argmax, but a bf16 target's logits move with the shape of its forward (how many candidates a
row verifies, the rows beside it), so where two tokens nearly tie a different draft can flip the text.

    python bench/draft_dtype.py --out docs/results/draft_dtype.json   # about 4 minutes

``--auto`` runs SpecDec++ with ``threshold="auto"`` (the bundled greedy head; the verification budget at B > 1)
instead of fixed K, each dtype with its own policy and profiled cost table.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.benchmark import add_stream_arguments, alternate_streams, arms_line, machine_description
from specdec_ext.policies import make_policy
from specdec_ext.prompts import load_prompts
from specdec_ext.zoo import load_pair

DTYPES = ("float32", "bfloat16")


def compare(pair, prompts: list, batch_size: int, k: int, max_new_tokens: int, rows_per_stream: int,
            head=None) -> dict:
    """tokens/s of fixed K = ``k`` (with ``head``: SpecDec++ with ``threshold="auto"`` and that acceptance head)
    with each draft dtype at ``batch_size`` (the dtypes alternate per stream), the ratio bfloat16 / float32,
    accepted candidates, and the share of requests whose tokens are the same with either."""
    drafts = {"float32": pair.draft, "bfloat16": copy.deepcopy(pair.draft).to(torch.bfloat16)}

    def policy():
        return make_policy("fixed", k=k) if head is None else make_policy("specdec++", head=head, threshold="auto")

    gens = {d: SpeculativeGenerator(pair.target, m, policy=policy()) for d, m in drafts.items()}
    eos = pair.tokenizer.eos_token_id
    r = alternate_streams(lambda d, stream, n: gens[d].generate_continuous(stream, batch_size, max_new_tokens=n,
                                                                           temperature=0, eos_token_id=eos),
                          DTYPES, prompts, batch_size, rows_per_stream, max_new_tokens)
    rate = r["tokens_per_s"]
    return {"batch_size": batch_size, "k": k if head is None else "auto", "tokens_per_s": rate,
            "accepted": r["accepted"],
            "bfloat16_over_float32": rate["bfloat16"] / rate["float32"], "same_tokens": r["same_tokens"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,4", help="comma-separated batch sizes")
    add_stream_arguments(ap)
    ap.add_argument("--auto", action="store_true", help="SpecDec++ with threshold='auto' instead of fixed K")
    args = ap.parse_args(argv)
    pair = load_pair(draft_dtype=torch.float32)
    prompts = [torch.tensor(pair.tokenizer(p)["input_ids"]) for p in load_prompts("humaneval")[:args.prompts]]
    t0 = time.perf_counter()
    head = pair.heads["greedy"] if args.auto else None
    rows = [compare(pair, prompts, int(b), args.k, args.max_new_tokens, args.rows_per_stream, head)
            for b in args.batch_sizes.split(",")]
    result = {"machine": machine_description(pair), "seconds": time.perf_counter() - t0,
              "command": "python bench/draft_dtype.py " + " ".join(argv if argv is not None else []), "rows": rows}
    for r in rows:
        print(arms_line(r, "bfloat16_over_float32"))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
