"""The engine's steps replayed from CUDA graphs against the same engine's eager steps and transformers'
static-cache compiled ``generate()``, on one GPU, in one run.

Greedy, the bundled pair (bf16 on CUDA), the first N HumanEval prompts. At ``--batch-size 1`` each request runs
alone and the methods alternate prompt by prompt in a balanced order: our plain decoding, fixed K and SpecDec++
(``threshold="auto"`` with early exit after every draft step, after steps 1, 3 and 7 only, decided on the device
by conditional nodes (also with compiled forwards), and drafting to the cap, a fixed h), each with ``cuda_graphs`` on and off
(with graphs, rounds overlap the host where the policy plans ahead; "one at a time" arms turn that off),
plain, fixed K and ``auto`` with graphs of compiled forwards (``compile=True``), and transformers'
``generate(cache_implementation="static")`` (compiled on its first calls) and assisted generation with the same draft (fixed K, each transformers arm on a copy
of the target of its own: the static cache's compilation changes the model's forward). At a larger batch size
the prompts are served by ``generate_continuous`` (plain, fixed K, ``auto``'s batch verification budget; graphs
on, with and without compiled forwards). Per method: tokens/s over all prompts, ms per round, draft forwards per round, the warm-up's seconds (caches,
cost profiles, graph capture, compilation), graphs captured, and the share of prompts whose tokens equal plain
decoding's (greedy: all of ours, bar bf16 near-ties between batch shapes). A method that fails is reported with its
error and the others run on.

    python bench/cuda_graphs.py --device cuda --prompts 16 --max-new-tokens 64 --out gpu_check/cuda_graphs_b1.json
    python bench/cuda_graphs.py --device cuda --dataset bench/data/thirdparty_headers.jsonl --prompts 12 --ks 2,3,4 \
        --arms "compiled|transformers"     # the GPU table: fixed K, every early_exit form, transformers' arms
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from specdec_ext import SpeculativeGenerator  # noqa: E402
from specdec_ext.benchmark import balanced_order, machine_description  # noqa: E402
from specdec_ext.prompts import load_prompts  # noqa: E402
from specdec_ext.zoo import load_pair  # noqa: E402


def engines(pair, batch_size: int, ks: tuple, h: float) -> dict:
    """The engine's arms by name: generator factories (fixed K for each of ``ks``)."""
    def gen(policy, graphs=None, **kw):
        return lambda: SpeculativeGenerator(pair.target, pair.draft if policy != "autoregressive" else None,
                                            policy=policy, head=pair.head if policy == "specdecpp" else None,
                                            cuda_graphs=graphs, **kw)

    k = ks[0]
    arms = {"plain, graphs": gen("autoregressive"), **{f"fixed K={k}, graphs": gen("fixed", k=k) for k in ks},
            "specdec++ auto, graphs": gen("specdecpp", threshold="auto"),
            "plain, graphs, compiled": gen("autoregressive", compile=True),
            **{f"fixed K={k}, graphs, compiled": gen("fixed", compile=True, k=k) for k in ks},
            "specdec++ auto, graphs, compiled": gen("specdecpp", compile=True, threshold="auto")}
    if batch_size == 1:
        arms.update({
            "specdec++ auto, graphs, to the cap": gen("specdecpp", threshold="auto", k_max=8, early_exit=False),
            "specdec++ auto, graphs, tiers 1/3/7": gen("specdecpp", threshold="auto", k_max=8, early_exit=(1, 3, 7)),
            "specdec++ auto, graphs, on device": gen("specdecpp", threshold="auto", k_max=8, early_exit="device"),
            "specdec++ auto, graphs, on device, compiled": gen("specdecpp", compile=True, threshold="auto", k_max=8,
                                                               early_exit="device"),
            "specdec++ auto, graphs, tiers 1/3/7, compiled": gen("specdecpp", compile=True, threshold="auto", k_max=8,
                                                                 early_exit=(1, 3, 7)),
            f"specdec++ h={h:g}, graphs, compiled": gen("specdecpp", compile=True, threshold=h),
            f"specdec++ h={h:g}, graphs, on device, compiled": gen("specdecpp", compile=True, threshold=h, k_max=8,
                                                                  early_exit="device"),
            # rounds one at a time (overlap=False): what overlapping the host with the GPU gains
            "plain, graphs, compiled, one at a time": gen("autoregressive", compile=True, overlap=False),
            f"fixed K={k}, graphs, compiled, one at a time": gen("fixed", compile=True, k=k, overlap=False),
            "specdec++ auto, graphs, on device, compiled, one at a time": gen(
                "specdecpp", compile=True, threshold="auto", k_max=8, early_exit="device", overlap=False),
            f"specdec++ h={h:g}, graphs": gen("specdecpp", threshold=h),
            "plain, eager": gen("autoregressive", False), f"fixed K={k}, eager": gen("fixed", False, k=k),
            "specdec++ auto, eager": gen("specdecpp", False, threshold="auto"),
        })
    return arms


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dataset", default="humaneval", help="humaneval, stdlib or a .jsonl file of prompts")
    ap.add_argument("--prompts", type=int, default=16, help="the first N prompts of --dataset")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1, help="1: one request at a time; more: continuous batching")
    ap.add_argument("--ks", default="3", help="comma-separated fixed candidate lengths K (the first: the draft's K in "
                                             "transformers' assisted generation)")
    ap.add_argument("--threshold", type=float, default=0.8, help="SpecDec++'s fixed stop threshold h")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' arms (static-cache and assisted generate)")
    ap.add_argument("--arms", help="'|'-separated: run only the arms whose names contain one of these; an entry "
                                   "with a leading '-' drops the arms that contain the rest")
    ap.add_argument("--label", default="", help="a prefix for the arms' names (another build of the package)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    pair = load_pair(device=args.device)
    cuda = torch.device(args.device).type == "cuda"
    n, B = args.max_new_tokens, args.batch_size
    ks = tuple(int(k) for k in args.ks.split(","))
    prompts = [torch.tensor([pair.tokenizer(t)["input_ids"]]) for t in load_prompts(args.dataset)[: args.prompts]]
    longest = max(prompts, key=lambda p: p.shape[1])  # sizes every cache for good: no graph captured twice

    def sync():
        if cuda:
            torch.cuda.synchronize()

    rows, texts, gens = {}, {}, {}
    arms = engines(pair, B, ks, args.threshold)
    if args.arms:
        take = [a for a in args.arms.split("|") if not a.startswith("-")]
        drop = [a[1:] for a in args.arms.split("|") if a.startswith("-")]
        arms = {name: make for name, make in arms.items()
                if (not take or any(a in name for a in take)) and not any(a in name for a in drop)}
    for name, make in arms.items():
        name = args.label + name
        t0 = time.perf_counter()
        try:
            g = make()
            if B == 1:
                g.generate(longest.to(args.device), max_new_tokens=n, temperature=0)
                g.generate(prompts[0].to(args.device), max_new_tokens=n, temperature=0)
            else:  # the longest prompts first: the caches take their final size now
                ordered = sorted(prompts, key=lambda p: -p.shape[1])
                g.generate_continuous([p[0] for p in ordered[:B]], batch_size=B, max_new_tokens=n, temperature=0)
            gens[name] = g
            sync()
            rows[name] = {"warm_up_seconds": time.perf_counter() - t0, "tokens": 0, "seconds": 0.0, "rounds": 0,
                          "draft_forwards": 0}
        except Exception as e:  # noqa: BLE001 - reported, the other methods run on
            rows[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=4)}
            print(f"{name}: {rows[name]['error']}", flush=True)
    if B == 1 and not args.no_hf:
        static_target, assisted_target = copy.deepcopy(pair.target), copy.deepcopy(pair.target)
        for attr, value in (("num_assistant_tokens", ks[0]), ("num_assistant_tokens_schedule", "constant"),
                            ("assistant_confidence_threshold", 0.0)):
            setattr(pair.draft.generation_config, attr, value)

        def hf(model, **kw):
            def run(ids):
                out = model.generate(ids.to(args.device), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                                     pad_token_id=pair.tokenizer.eos_token_id, **kw)
                return out[0, ids.shape[1]:].tolist()
            return run

        for name, run in (("transformers generate, static cache, compiled", hf(static_target,
                                                                               cache_implementation="static")),
                          (f"transformers assisted generation, K={ks[0]}", hf(assisted_target,
                                                                                assistant_model=pair.draft))):
            if args.arms and name not in arms and not any(a in name for a in args.arms.split("|")
                                                          if not a.startswith("-")):
                continue
            t0 = time.perf_counter()
            try:
                run(longest)  # a static cache sized for the longest request: later calls reuse it
                run(prompts[0])
                sync()
                gens[name] = run
                rows[name] = {"warm_up_seconds": time.perf_counter() - t0, "tokens": 0, "seconds": 0.0}
            except Exception as e:  # noqa: BLE001
                rows[name] = {"error": f"{type(e).__name__}: {e}"}
    names = list(gens)
    if B == 1:
        for i, ids in enumerate(prompts):
            for name in balanced_order(names, i):
                g = gens[name]
                sync()
                t0 = time.perf_counter()
                if callable(g) and not isinstance(g, SpeculativeGenerator):
                    toks, stats = g(ids), None
                else:
                    out = g.generate(ids.to(args.device), max_new_tokens=n, temperature=0)
                    toks, stats = out.new_tokens[0], out.stats
                sync()
                r = rows[name]
                r["seconds"] += time.perf_counter() - t0
                r["tokens"] += len(toks)
                if stats is not None:
                    r["rounds"] += len(stats.rounds)
                    r["draft_forwards"] += stats.draft_calls
                texts.setdefault(name, []).append(list(toks))
    else:
        for name in names:
            sync()
            t0 = time.perf_counter()
            out = gens[name].generate_continuous([p[0] for p in prompts], batch_size=B, max_new_tokens=n,
                                                 temperature=0)
            sync()
            r = rows[name]
            r["seconds"] = time.perf_counter() - t0
            r["tokens"] = sum(len(t) for t in out.new_tokens)
            r["rounds"] = len(out.stats.rounds)
            r["draft_forwards"] = out.stats.draft_calls
            texts[name] = out.new_tokens
    plain = texts.get(args.label + "plain, graphs")
    for name in names:
        r = rows[name]
        r["tokens_per_s"] = r["tokens"] / r["seconds"] if r["seconds"] else None
        if r.get("rounds"):
            r["ms_per_round"] = 1e3 * r["seconds"] / r["rounds"]
            r["draft_forwards_per_round"] = r["draft_forwards"] / r["rounds"]
        g = gens[name]
        if isinstance(g, SpeculativeGenerator) and g.steps.graphs is not None:
            r["graphs_captured"] = g.steps.graphs.captures
        if plain is not None:
            r["same_tokens_as_plain"] = sum(a == b for a, b in zip(texts[name], plain)) / len(plain)
        print(f"{name}: {r['tokens_per_s']:.1f} tokens/s, {r.get('ms_per_round', 0):.2f} ms/round, "
              f"{r.get('draft_forwards_per_round', 0):.2f} draft forwards/round, plain's tokens on "
              f"{r.get('same_tokens_as_plain', float('nan')):.0%} of prompts, warm-up {r['warm_up_seconds']:.1f} s",
              flush=True)
    result = {"machine": machine_description(pair), "command": "python bench/cuda_graphs.py " + " ".join(argv or []),
              "date": time.strftime("%Y-%m-%d"), "prompts": args.prompts, "max_new_tokens": n, "batch_size": B,
              "rows": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
