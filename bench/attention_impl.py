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

from specdec_ext.benchmark import compare_switched_arms, two_arm_script
from specdec_ext.engine.fast_llama import FastLlamaRunner
from specdec_ext.zoo import load_pair

ARMS = ("specdec_decode", "sdpa")


def switch(pair, arm) -> None:
    """Both models' attention: ``arm`` for the target (transformers; None: the kernel), the kernel or SDPA in the
    draft's runner."""
    arm = arm or "specdec_decode"
    pair.target.set_attn_implementation(arm)
    FastLlamaRunner.attention_kernel = arm == "specdec_decode"


def compare(pair, prompts: list, batch_size: int, k: int, max_new_tokens: int, rows_per_stream: int) -> dict:
    """tokens/s with each attention at ``batch_size``, for fixed K = ``k`` (0: plain decoding)."""
    return compare_switched_arms(pair, prompts, batch_size, k, max_new_tokens, rows_per_stream, ARMS,
                                 lambda arm: switch(pair, arm), "kernel_over_sdpa")


def main(argv=None) -> dict:
    return two_arm_script(argv, __doc__.split("\n")[0], "attention_impl", compare, "kernel_over_sdpa",
                          lambda: load_pair(attn_implementation="specdec_decode"), batch_sizes="1,4,16,64", prompts=128)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
