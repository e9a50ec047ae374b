"""The target's runner: the lean Llama runner (``engine/fast_llama.py``: fused weights, preallocated KV cache) against
transformers' forward (``engine/runner.CausalLMRunner``, its linear layers oneDNN-packed on a CPU and its cache
appending in place), end to end.

For the bundled pair in one process, greedy, continuous batching of HumanEval prompts, the two arms alternating
stream by stream (``benchmark.alternate_streams``), for plain decoding and fixed K at each batch size: aggregate
tokens/s, the ratio lean / transformers, and the share of requests with the same tokens (the two compute the same
function in another order of operations: a bf16 near-tie may flip a token). Beside it, the target's one-token
forward in each runner and the time to read its weights once (parameter bytes over a measured copy's rate).

    python bench/target_runner.py --batch-sizes 1 --ks 0 --prompts 164 --out docs/results/target_runner_bf16_epyc.json
"""

from __future__ import annotations

import statistics
import time

import torch

from specdec_ext.benchmark import switched_arm_script
from specdec_ext.engine.fast_llama import FastLlamaRunner
from specdec_ext.engine.runner import CausalLMRunner
from specdec_ext.zoo import load_pair

ARMS = ("lean", "transformers")


def use(arm) -> None:
    """The arm's target runner for the generator's calls from now on; None: the default (lean) again."""
    FastLlamaRunner.targets = arm != "transformers"


def forward_ms(model, runner_cls, context: int = 128, reps: int = 50) -> float:
    """Median ms of ``model``'s one-token forward (then rolled back) through ``runner_cls`` after a ``context``-token
    prompt, batch size 1."""
    r = runner_cls(model, "target")
    r.start(1)
    r.forward(torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0)))
    one, times = torch.tensor([[5]]), []
    for _ in range(reps):
        t0 = time.perf_counter()
        r.forward(one)
        r.rollback(torch.tensor([1]))
        times.append((time.perf_counter() - t0) * 1e3)
    r.close()
    return statistics.median(times)


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


def forwards(pair) -> dict:
    """The target's one-token forward through each runner and its weight-read time (ms)."""
    lean, hf = forward_ms(pair.target, FastLlamaRunner), forward_ms(pair.target, CausalLMRunner)
    read = weight_read_ms(pair.target)
    return {"lean_ms": lean, "transformers_ms": hf, "weight_read_ms": read, "lean_over_read": lean / read,
            "transformers_over_read": hf / read}


compare, _main = switched_arm_script(__doc__, "target_runner", ARMS, use, "lean_over_transformers", load_pair,
                                     "1,4,16", 64)


def main(argv=None) -> dict:
    result = _main(argv)
    result["forward"] = forwards(load_pair())
    print("one-token forward (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in result["forward"].items()), flush=True)
    out = next((argv[i + 1] for i, a in enumerate(argv or []) if a == "--out"), None)
    if out is not None:
        import json
        from pathlib import Path

        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
