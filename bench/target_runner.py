"""The target's backend: the lean model over a static KV cache (``engine/model.py``: fused weights, a slot per row)
against transformers' forward (``engine/runner.CausalLMRunner``, its linear layers oneDNN-packed on a CPU and its
cache appending in place), end to end.

For the bundled pair in one process, greedy, continuous batching of HumanEval prompts, the two arms alternating
stream by stream (``benchmark.alternate_streams``), for plain decoding and fixed K at each batch size: aggregate
tokens/s, the ratio lean / transformers, and the share of requests with the same tokens (the two compute the same
function in another order of operations: a bf16 near-tie may flip a token). Beside it, the target's one-token
forward in each runner and the time to read its weights once (parameter bytes over a measured copy's rate).

    python bench/target_runner.py --batch-sizes 1 --ks 0,3 --prompts 164 --max-new-tokens 64 \
        --out docs/results/target_runner_bf16_epyc.json
"""

from __future__ import annotations

import statistics
import time

import torch

from specdec_ext.benchmark import switched_arm_script
from specdec_ext.engine.backends import LeanBackend
from specdec_ext.engine.profile import forward_times
from specdec_ext.zoo import load_pair

ARMS = ("lean", "transformers")


def use(arm) -> None:
    """The arm's target backend for the backends made from now on; None: the default (lean) again."""
    LeanBackend.targets = arm != "transformers"


def weight_read_ms(model, reps: int = 20) -> float:
    """ms to read ``model``'s parameter bytes once: their count over the rate (bytes/ms) of a copy of that many
    bytes, the median of ``reps``."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def forwards(pair, context: int = 128, reps: int = 50) -> dict:
    """The target's one-token forward through each backend after a ``context``-token prompt, batch size 1 (medians of
    ``reps``, the profiler's timing), and its weight-read time (ms)."""
    prompt = torch.randint(0, pair.target.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    lean, hf = (forward_times(pair.target, prompt, 1, reps, torch.Generator().manual_seed(1), fast_target)[0]
                for fast_target in (True, False))
    read = weight_read_ms(pair.target)
    return {"forward": {"lean_ms": lean, "transformers_ms": hf, "weight_read_ms": read, "lean_over_read": lean / read,
                        "transformers_over_read": hf / read}}


compare, main = switched_arm_script(__doc__, "target_runner", ARMS, use, "lean_over_transformers", load_pair,
                                    "1,4,16", 64, extra=forwards)

if __name__ == "__main__":
    import sys

    result = main(sys.argv[1:])
    print("one-token forward (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in result["forward"].items()), flush=True)
