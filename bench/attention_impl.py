"""The target's and the draft's attention end to end: ``attn_implementation="specdec_decode"`` (``ops.decode_attention``
for decode and verification forwards, ``engine/attention.py``; the draft runner's too) against transformers'
``"sdpa"`` (torch's fused attention, in both models).

For the bundled pair (bf16 target) in one process, greedy, continuous batching of HumanEval prompts, the two
implementations alternating stream by stream (``benchmark.alternate_streams``), for plain decoding and fixed K at
each batch size: aggregate tokens/s, the ratio kernel / sdpa, and the share of requests with the same tokens (the
two differ in rounding, so bf16 greedy text may part where two tokens' logits are within it).

    python bench/attention_impl.py --out docs/results/attention_impl.json   # about 15 minutes
"""

from __future__ import annotations

import argparse

import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.benchmark import add_stream_arguments, alternate_streams, arms_by_batch_and_k
from specdec_ext.engine.fast_llama import FastLlamaRunner
from specdec_ext.policies import make_policy
from specdec_ext.zoo import load_pair

ARMS = ("specdec_decode", "sdpa")


def use(pair, arm: str) -> None:
    """Both models' attention: ``arm`` for the target (transformers), the kernel or SDPA in the draft's runner."""
    pair.target.set_attn_implementation(arm)
    FastLlamaRunner.attention_kernel = arm == "specdec_decode"


def compare(pair, prompts: list, batch_size: int, k: int, max_new_tokens: int, rows_per_stream: int) -> dict:
    """tokens/s with each attention at ``batch_size``, for fixed K = ``k`` (0: plain decoding)."""
    policy = make_policy("fixed", k=k) if k else make_policy("autoregressive")
    gen = SpeculativeGenerator(pair.target, pair.draft, policy=policy)
    eos = pair.tokenizer.eos_token_id

    def generate(arm, stream, n):
        use(pair, arm)
        return gen.generate_continuous(stream, batch_size, max_new_tokens=n, temperature=0, eos_token_id=eos)

    try:
        r = alternate_streams(generate, ARMS, prompts, batch_size, rows_per_stream, max_new_tokens)
    finally:
        use(pair, "specdec_decode")
    rate = r["tokens_per_s"]
    return {"batch_size": batch_size, "k": k, "tokens_per_s": rate, "kernel_over_sdpa": rate[ARMS[0]] / rate[ARMS[1]],
            "same_tokens": r["same_tokens"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,4,16,64", help="comma-separated batch sizes")
    ap.add_argument("--ks", default="0,3", help="comma-separated fixed K (0: plain decoding)")
    add_stream_arguments(ap, argparse.SUPPRESS)  # its --k is not used: --ks
    ap.set_defaults(prompts=128, rows_per_stream=1)
    args = ap.parse_args(argv)
    pair = load_pair(attn_implementation="specdec_decode")
    return arms_by_batch_and_k(pair, args, compare, "kernel_over_sdpa", "attention_impl", argv)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
