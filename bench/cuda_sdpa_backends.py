"""On a CUDA device: decoding speed with torch's default choice of SDPA backend (cuDNN's attention first on
Hopper) against flash / memory-efficient / math only (what the engine's runners use, ``engine/runner.py``).

cuDNN's attention builds an execution plan for each new shape, and decoding makes a new shape every step (the
KV cache grows), so the first pass over new lengths pays for plans. Each arm runs the same prompts twice in
alternation (pass 0 sees new shapes, pass 1 mostly cached ones): transformers' plain greedy decoding of the
bundled target, and the engine with fixed K = 4. Tokens/s over all prompts (greedy, no EOS stop).

    python bench/cuda_sdpa_backends.py [--prompts 4] [--new-tokens 64] [--out docs/results/cuda_sdpa_backends.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
from torch.nn.attention import sdpa_kernel

from specdec_ext import SpeculativeGenerator
from specdec_ext.engine import runner
from specdec_ext.prompts import load_prompts
from specdec_ext.zoo import load_pair


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/cuda_sdpa_backends.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    pair = load_pair(device="cuda")
    tok, n_new = pair.tokenizer, args.new_tokens
    ids = [torch.tensor([tok(p)["input_ids"]], device="cuda") for p in load_prompts("humaneval", args.prompts)]
    gen = SpeculativeGenerator(pair.target, pair.draft, policy="fixed", k=4)

    def hf(x):
        with torch.inference_mode():
            out = pair.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n_new,
                                       min_new_tokens=n_new, do_sample=False, pad_token_id=tok.eos_token_id)
        return out.shape[1] - x.shape[1]

    def ours(x):
        return len(gen.generate(x, max_new_tokens=n_new, temperature=0.0).new_tokens[0])

    chosen = list(runner.CUDA_SDPA_BACKENDS)
    arms = {"torch default": (None, contextlib.nullcontext), "no cuDNN": (chosen, lambda: sdpa_kernel(chosen))}
    results = {}
    try:
        for p in range(args.passes):
            for arm, (backends, ctx) in arms.items():
                runner.CUDA_SDPA_BACKENDS = backends  # the engine's runners
                for name, fn in (("transformers plain", hf), ("engine fixed K=4", ours)):
                    with ctx():  # transformers' forward
                        fn(ids[0][:, :8])
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        n = sum(fn(x) for x in ids)
                        torch.cuda.synchronize()
                    rate = n / (time.perf_counter() - t0)
                    results.setdefault(f"{name}, {arm}", []).append(round(rate, 1))
                    print(f"pass {p} {arm:>13} {name:>18}: {rate:7.1f} tokens/s", flush=True)
    finally:
        runner.CUDA_SDPA_BACKENDS = chosen
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "prompts": args.prompts,
            "new_tokens": n_new, "dtype": str(next(pair.target.parameters()).dtype)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "tokens_per_s_by_pass": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
