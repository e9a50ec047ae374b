"""The target runner's KV cache: appends in place (``engine/kv_cache.GrowingCache``) against transformers'
``DynamicCache``, which appends by ``torch.cat`` and so copies the whole cache of every layer at every forward.

For the bundled pair (bf16 target) in one process, greedy, continuous batching of HumanEval prompts, the two
caches alternating stream by stream (``benchmark.alternate_streams``), for plain decoding and fixed K at each batch
size: aggregate tokens/s, the ratio in-place / cat, and the share of requests with the same tokens (the cache
holds the same numbers either way, so the tokens must be the same).

    python bench/kv_cache.py --out docs/results/kv_cache.json   # about 12 minutes
"""

from __future__ import annotations

from transformers import DynamicCache

from specdec_ext.benchmark import setting_switch, switched_arm_script
from specdec_ext.engine.backends import LeanBackend
from specdec_ext.engine.kv_cache import GrowingCache
from specdec_ext.engine.runner import CausalLMRunner
from specdec_ext.zoo import load_pair

CACHES = {"in-place": GrowingCache, "cat": DynamicCache}
_cache = setting_switch(CausalLMRunner, "cache_class", CACHES)  # read when a call starts its target runner


def use(arm) -> None:
    """The arm's cache class for the transformers target runners made from now on; both arms run the target through
    transformers' forward (the lean model has its static cache). None: the defaults again."""
    _cache(arm)
    LeanBackend.targets = arm is None

# compare(pair, prompts, batch_size, k, max_new_tokens, rows_per_stream): tokens/s of both arms; main(argv)
compare, main = switched_arm_script(
    __doc__, "kv_cache", tuple(CACHES), use, "in_place_over_cat", load_pair, "4,16,64", 164)

if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
