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

from specdec_ext.benchmark import setting_switch, switched_arm_script
from specdec_ext.engine import generator
from specdec_ext.zoo import load_pair

SETTINGS = {"chunked": generator.PREFILL_CHUNK_TOKENS, "whole": None}
use = setting_switch(generator, "PREFILL_CHUNK_TOKENS", SETTINGS)  # the generator reads it at each prefill

# compare(pair, prompts, batch_size, k, max_new_tokens, rows_per_stream): tokens/s of both arms; main(argv)
compare, main = switched_arm_script(
    __doc__, "prefill_chunks", tuple(SETTINGS), use, "chunked_over_whole", load_pair, "16,64", 128)

if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
