"""Chunked prefill: prompts read in forwards of at most ``PREFILL_CHUNK_TOKENS`` tokens against one forward each.

``engine/generator._prefill`` reads a group of prompts in forwards of at most ``PREFILL_CHUNK_TOKENS`` (rows x
columns) tokens, consecutive column chunks through the KV cache, instead of one forward over every column: a
forward over many rows of long prompts makes activations that leave the CPU's caches. This measures it end to end
for the bundled pair in one process, greedy, continuous batching of HumanEval prompts, the two settings alternating
stream by stream (``benchmark.alternate_streams``), for plain decoding and fixed K at each batch size: aggregate
tokens/s (prefills included: that is where it acts), the ratio chunked / whole, and the share of requests with
the same tokens.

    python bench/prefill_chunks.py --batch-sizes 16,64 --ks 0,1 --out docs/results/prefill_chunks.json
"""

from __future__ import annotations

from specdec_ext.benchmark import compare_switched_arms, two_arm_script
from specdec_ext.engine import generator
from specdec_ext.zoo import load_pair

SETTINGS = {"chunked": generator.PREFILL_CHUNK_TOKENS, "whole": None}


def use(arm) -> None:
    """The prefill chunk size of ``arm`` (None: the default, chunked); the generator reads it at each prefill."""
    generator.PREFILL_CHUNK_TOKENS = SETTINGS[arm or "chunked"]


def compare(pair, prompts: list, batch_size: int, k: int, max_new_tokens: int, rows_per_stream: int) -> dict:
    """tokens/s with chunked and whole prefills at ``batch_size``, for fixed K = ``k`` (0: plain decoding)."""
    return compare_switched_arms(pair, prompts, batch_size, k, max_new_tokens, rows_per_stream, tuple(SETTINGS), use,
                                 "chunked_over_whole")


def main(argv=None) -> dict:
    return two_arm_script(argv, __doc__.split("\n")[0], "prefill_chunks", compare, "chunked_over_whole", load_pair,
                          batch_sizes="16,64", prompts=128)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
