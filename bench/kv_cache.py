"""The target runner's KV cache: appends in place (``engine/kv_cache.GrowingCache``) against transformers'
``DynamicCache``, which appends by ``torch.cat`` and so copies the whole cache of every layer at every forward.

For the bundled pair (bf16 target) in one process, greedy, continuous batching of HumanEval prompts, the two
caches alternating stream by stream (``benchmark.alternate_streams``), for plain decoding and fixed K at each batch
size: aggregate tokens/s, the ratio in-place / cat, and the share of requests with the same tokens (the cache
holds the same numbers either way, so the tokens must be the same).

    python bench/kv_cache.py --out docs/results/kv_cache.json   # about 12 minutes
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from specdec_ext import SpeculativeGenerator
from specdec_ext.benchmark import add_stream_arguments, alternate_streams, arms_by_batch_and_k
from specdec_ext.engine.kv_cache import GrowingCache
from specdec_ext.engine.runner import CausalLMRunner
from specdec_ext.policies import make_policy
from specdec_ext.zoo import load_pair

CACHES = {"in-place": GrowingCache, "cat": DynamicCache}


def compare(pair, prompts: list, batch_size: int, k: int, max_new_tokens: int, rows_per_stream: int) -> dict:
    """tokens/s with each cache at ``batch_size``, for fixed K = ``k`` (0: plain decoding)."""
    policy = make_policy("fixed", k=k) if k else make_policy("autoregressive")
    gen = SpeculativeGenerator(pair.target, pair.draft, policy=policy)
    eos = pair.tokenizer.eos_token_id

    def generate(arm, stream, n):
        CausalLMRunner.cache_class = CACHES[arm]  # the generator makes its target runner per call
        return gen.generate_continuous(stream, batch_size, max_new_tokens=n, temperature=0, eos_token_id=eos)

    try:
        r = alternate_streams(generate, tuple(CACHES), prompts, batch_size, rows_per_stream, max_new_tokens)
    finally:
        CausalLMRunner.cache_class = GrowingCache
    rate = r["tokens_per_s"]
    return {"batch_size": batch_size, "k": k, "tokens_per_s": rate, "in_place_over_cat": rate["in-place"] / rate["cat"],
            "same_tokens": r["same_tokens"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="4,16,64", help="comma-separated batch sizes")
    ap.add_argument("--ks", default="0,3", help="comma-separated fixed K (0: plain decoding)")
    add_stream_arguments(ap, argparse.SUPPRESS)  # its --k is not used: --ks
    ap.set_defaults(prompts=164, rows_per_stream=1)
    args = ap.parse_args(argv)
    return arms_by_batch_and_k(load_pair(), args, compare, "in_place_over_cat", "kv_cache", argv)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
