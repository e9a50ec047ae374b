"""The engine's steps eager and compiled against transformers' static-cache generate(), one request at a time.

Greedy, the bundled pair, the first N HumanEval prompts: the engine's plain decoding and fixed K with eager steps,
fixed K with its steps compiled over padded batch buckets (``engine/round.StepRunner``; on CUDA
``mode="reduce-overhead"``: CUDA graphs, as gpt-fast captures decoding), and transformers'
``generate(cache_implementation="static")``; tokens/s over all prompts, and each method's share of prompts with
plain decoding's text. Part of ``scripts/gpu_check.sh``; runs on a CPU too (the compiled arm then uses inductor's
CPU code).

    python scripts/gpu_static.py --device cuda --prompts 16 --max-new-tokens 64 --out gpu_check/static.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main(argv=None) -> dict:
    from specdec_ext import SpeculativeGenerator
    from specdec_ext.benchmark import machine_description
    from specdec_ext.engine.model import LeanModel
    from specdec_ext.engine.round import StepRunner
    from specdec_ext.prompts import load_prompts
    from specdec_ext.zoo import load_pair

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    pair = load_pair(device=args.device)
    prompts = [pair.tokenizer(p, return_tensors="pt").input_ids for p in load_prompts("humaneval")[: args.prompts]]
    cuda = torch.device(args.device).type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    engine_plain = SpeculativeGenerator(pair.target, None, policy="autoregressive")
    engine_k = SpeculativeGenerator(pair.target, pair.draft, policy="fixed", k=args.k)
    mode = "reduce-overhead" if cuda else "default"
    compiled = SpeculativeGenerator(pair.target, pair.draft, policy="fixed", k=args.k, early_exit=False)
    compiled.steps = StepRunner((1,), compile=True, mode=mode)
    packed, LeanModel.packed_default = LeanModel.packed_default, False  # inductor traces F.linear, not oneDNN's packs
    longest = max(prompts, key=lambda p: p.shape[1])  # its caches sized once, for the longest request: no recompiling
    compiled.generate(longest, max_new_tokens=args.max_new_tokens, temperature=0)  # backends made now: F.linear
    LeanModel.packed_default = packed
    n = args.max_new_tokens

    def hf_static(ids):
        out = pair.target.generate(ids.to(args.device), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                                   cache_implementation="static", pad_token_id=pair.tokenizer.eos_token_id)
        return out[0, ids.shape[1]:].tolist()

    methods = {
        "engine plain": lambda ids: engine_plain.generate(ids, max_new_tokens=n, temperature=0).new_tokens[0],
        f"engine fixed K={args.k}": lambda ids: engine_k.generate(ids, max_new_tokens=n, temperature=0).new_tokens[0],
        f"engine fixed K={args.k}, steps compiled ({mode})":
            lambda ids: compiled.generate(ids, max_new_tokens=n, temperature=0).new_tokens[0],
        "transformers generate, static cache": hf_static,
    }
    warm = {}
    for name, fn in methods.items():  # first calls: allocation, compilation, graph capture
        sync()
        t0 = time.perf_counter()
        fn(prompts[0])
        fn(prompts[0])
        sync()
        warm[name] = time.perf_counter() - t0
    rows, texts = {}, {}
    for name in methods:
        rows[name] = {"tokens": 0, "seconds": 0.0}
    for ids in prompts:  # methods alternate prompt by prompt
        for name, fn in methods.items():
            sync()
            t0 = time.perf_counter()
            toks = list(fn(ids))
            sync()
            rows[name]["seconds"] += time.perf_counter() - t0
            rows[name]["tokens"] += len(toks)
            texts.setdefault(name, []).append(toks)
    plain = texts["engine plain"]
    for name, r in rows.items():
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        r["same_text_as_plain"] = sum(a == b for a, b in zip(texts[name], plain)) / len(plain)
        r["warm_up_seconds"] = warm[name]
        print(f"{name}: {r['tokens_per_s']:.1f} tokens/s, plain's text on {r['same_text_as_plain']:.0%} of prompts, "
              f"warm-up {warm[name]:.1f} s", flush=True)
    result = {"machine": machine_description(pair), "command": "python scripts/gpu_static.py " + " ".join(argv or []),
              "prompts": args.prompts, "max_new_tokens": n, "rows": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
