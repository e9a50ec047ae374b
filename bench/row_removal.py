"""Finished requests leaving the batch in place (the last rows take their places) against a copy of every row.

When requests finish and no queued request takes their places (a stream's tail, as the batch drains), the engine
removes their rows from the runners' KV caches. In the order ``kv_cache.compaction`` gives (the default) the last
rows move into the finished rows' places and only their caches are copied (``kv_cache.take_rows``); in sorted
order every row after the first finished one moves, so the whole cache is copied. Plain decoding's rows finish
together; a speculative method's finish at staggered rounds, so it removes rows many more times. This measures the
two orders end to end for the bundled pair in one process, greedy, continuous batching of HumanEval prompts, the two
alternating stream by stream (``benchmark.alternate_streams``), for fixed K at each batch size: aggregate tokens/s,
the ratio in place / copy, and the share of requests with the same tokens.

    python bench/row_removal.py --batch-sizes 16,64 --ks 1,2 --rows-per-stream 2 --prompts 160 \
        --out docs/results/row_removal.json   # about 5 minutes
"""

from __future__ import annotations

from specdec_ext.benchmark import setting_switch, switched_arm_script
from specdec_ext.engine import generator
from specdec_ext.engine.kv_cache import compaction
from specdec_ext.zoo import load_pair


def sorted_order(n_rows: int, leaving) -> list[int]:
    """The rows that stay, in their order: every row after the first leaving one moves (a copy of the caches)."""
    gone = set(leaving)
    return [i for i in range(n_rows) if i not in gone]


SETTINGS = {"in_place": compaction, "copy": sorted_order}
use = setting_switch(generator, "compaction", SETTINGS)  # the generator reads it whenever rows leave

# compare(pair, prompts, batch_size, k, max_new_tokens, rows_per_stream): tokens/s of both arms; main(argv)
compare, main = switched_arm_script(__doc__, "row_removal", tuple(SETTINGS), use, "in_place_over_copy", load_pair,
                                    "16,64", 128)

if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
