"""The target runner's linear layers: oneDNN with weights packed once (``engine/onednn_linear.py``) against torch's
``F.linear`` (MKL's sgemm on a CPU).

For the bundled pair in one process, greedy, continuous batching of HumanEval prompts, the two arms alternating
stream by stream (``benchmark.alternate_streams``), for plain decoding and fixed K at each batch size: aggregate
tokens/s, the ratio packed / F.linear, and the share of requests with the same tokens (the two compute the same
function up to rounding, about 1e-5 relative in float32, so a near-tie of the target could flip a token). The lean
draft packs its own weights in both arms; the target runs through transformers' forward in both
(``LeanBackend.targets = False``). The packed arm packs a bf16 target even where the runner's default
would not (a CPU without oneDNN's bf16 path raises there).

    python bench/target_linear.py --out docs/results/target_linear_bf16_amx.json   # about 15 minutes
    python bench/target_linear.py --batch-sizes 1,4,16,64 --ks 0,2   # bf16 on an AMX Xeon: target_linear_bf16_amx.json
"""

from __future__ import annotations

from specdec_ext.benchmark import switched_arm_script
from specdec_ext.engine.backends import LeanBackend
from specdec_ext.engine.runner import CausalLMRunner
from specdec_ext.zoo import load_pair

RUNNERS = {"packed": True, "F.linear": False}  # True also where the default would not pack (a bf16 target)


def use(arm) -> None:
    """The arm's packing for the target runners made from now on; None: the runner's own default again."""
    CausalLMRunner.packed_default = None if arm is None else RUNNERS[arm]
    LeanBackend.targets = arm is None  # both arms run the target through transformers' forward


# compare(pair, prompts, batch_size, k, max_new_tokens, rows_per_stream): tokens/s of both arms; main(argv)
compare, main = switched_arm_script(
    __doc__, "target_linear", tuple(RUNNERS), use, "packed_over_linear", load_pair, "1,4,16,64", 64)

if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
