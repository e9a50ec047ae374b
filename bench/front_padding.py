"""Admitted requests' caches written into the target's KV buffers in place against copies of the whole cache.

When a request takes a finished one's row (continuous batching) and its prompt is wider than the target's cache,
the cache is padded at the front; and a runner that has read nothing takes its first requests' caches (every
prefill of several length groups). By default (``kv_cache.GrowingLayer.pad_front`` and ``place_rows``) both go
into buffers with spare columns, in place where the spare columns are there, so the next append goes in place
too; the ``copy`` arm restores the former way: a ``torch.cat`` padding, and plain zero tensors for the first
requests, each copied once more into a new buffer by the next append. This measures the two end to end for the
bundled pair in one process, greedy, continuous batching of HumanEval prompts, the two alternating stream by
stream (``benchmark.alternate_streams``), for plain decoding and fixed K at each batch size: aggregate tokens/s,
the ratio in place / copy, and the share of requests with the same tokens.

    python bench/front_padding.py --batch-sizes 16,64 --ks 0,1 --rows-per-stream 2 --prompts 160 \\
        --out docs/results/front_padding.json   # about 5 minutes
"""

from __future__ import annotations

from specdec_ext.benchmark import setting_switch, switched_arm_script
from specdec_ext.engine import runner
from specdec_ext.engine.kv_cache import GrowingLayer
from specdec_ext.zoo import load_pair


class _Never:
    """No layer is an instance: the runner takes the paths it takes for transformers' own layers."""


SETTINGS = {"in_place": GrowingLayer, "copy": _Never}
use = setting_switch(runner, "GrowingLayer", SETTINGS)  # the class whose layers the runner pads and places in place

# compare(pair, prompts, batch_size, k, max_new_tokens, rows_per_stream): tokens/s of both arms; main(argv)
compare, main = switched_arm_script(__doc__, "front_padding", tuple(SETTINGS), use, "in_place_over_copy", load_pair,
                                    "16,64", 128)

if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
