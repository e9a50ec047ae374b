"""Verifications packed only where enough slots are holes, against packing every verification that has a hole.

A fixed K's round in which some request is one token from its end gives that row no candidate: its slots are
holes. The engine used to pack every such verification (``engine/packing.py``), which costs more than it saves when
only a few slots are holes (``bench/packed_verify.py``, pattern ``one``); it now packs only where at most
``packing.PACK_MAX_REAL_SHARE`` of the slots are real (``worth_packing``) and masks the holes otherwise. This
measures the two end to end for the bundled pair in one process, greedy, continuous batching of HumanEval prompts,
the two alternating stream by stream (``benchmark.alternate_streams``), for fixed K at each batch size: aggregate
tokens/s, the ratio of the rule to packing every hole, and the share of requests with the same tokens.

    python bench/pack_rule.py --batch-sizes 16,64 --ks 1,2 --rows-per-stream 1 --prompts 160 \\
        --out docs/results/pack_rule.json   # about 5 minutes (270 s)
"""

from __future__ import annotations

from specdec_ext.benchmark import setting_switch, switched_arm_script
from specdec_ext.engine import packing
from specdec_ext.zoo import load_pair

# a share just below 1: every verification with a hole packs, as before the rule
SETTINGS = {"rule": packing.PACK_MAX_REAL_SHARE, "any_hole": 1.0 - 1e-9}
use = setting_switch(packing, "PACK_MAX_REAL_SHARE", SETTINGS)

# compare(pair, prompts, batch_size, k, max_new_tokens, rows_per_stream): tokens/s of both arms; main(argv)
compare, main = switched_arm_script(__doc__, "pack_rule", tuple(SETTINGS), use, "rule_over_any_hole", load_pair,
                                    "16,64", 128)

if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
