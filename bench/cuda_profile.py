"""Where a round's time goes on a GPU: torch's profiler over one request per method (the bundled pair, greedy,
graphs on), per round: wall ms, the GPU's busy ms (the sum of its kernels' times), the rest (the host's share:
preparing inputs, launching graphs, the one read-back, the scheduler's bookkeeping), kernels run (also per decoder
layer the round's forwards ran), and each method's heaviest kernels. Warm calls first, so capture, compilation and allocation stay out of the profile. ``--compile``:
the models' forwards compiled before capture.

    python bench/cuda_profile.py --device cuda --out gpu_check/cuda_profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))

from specdec_ext import SpeculativeGenerator  # noqa: E402
from specdec_ext.benchmark import machine_description  # noqa: E402
from specdec_ext.prompts import load_prompts  # noqa: E402
from specdec_ext.zoo import load_pair  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt", type=int, default=0, help="which HumanEval prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--compile", action="store_true", help="the models' forwards compiled before capture")
    ap.add_argument("--arms", help="'|'-separated: profile only the arms whose names contain one of these")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    pair = load_pair(device=args.device)
    cuda = torch.device(args.device).type == "cuda"
    ids = torch.tensor([pair.tokenizer(load_prompts("humaneval")[args.prompt])["input_ids"]], device=args.device)
    n = args.max_new_tokens
    arms = {"plain": dict(policy="autoregressive"), "fixed K=3": dict(policy="fixed", k=3),
            "specdec++ auto": dict(policy="specdecpp", threshold="auto", head=pair.head),
            "specdec++ auto, to the cap": dict(policy="specdecpp", threshold="auto", head=pair.head, k_max=8,
                                               early_exit=False),
            "specdec++ auto, on device": dict(policy="specdecpp", threshold="auto", head=pair.head, k_max=8,
                                              early_exit="device")}
    if args.arms:
        arms = {name: kw for name, kw in arms.items() if any(a in name for a in args.arms.split("|"))}
    rows, tables = {}, []
    t_layers, d_layers = pair.target.config.num_hidden_layers, pair.draft.config.num_hidden_layers
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for name, kw in arms.items():
        gen = SpeculativeGenerator(pair.target, pair.draft if kw["policy"] != "autoregressive" else None,
                                   compile=args.compile, **kw)
        name += ", compiled" if args.compile else ""
        for _ in range(2):
            gen.generate(ids, max_new_tokens=n, temperature=0)
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            out = gen.generate(ids, max_new_tokens=n, temperature=0)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        rounds = len(out.stats.rounds)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_us = sum(e.time_range.elapsed_us() for e in kernels)
        per = {}
        for e in kernels:
            c, t = per.get(e.name, (0, 0.0))
            per[e.name] = (c + 1, t + e.time_range.elapsed_us())
        top = sorted(per.items(), key=lambda kv: -kv[1][1])[:12]
        rows[name] = {"rounds": rounds, "tokens": len(out.new_tokens[0]), "wall_ms_per_round": 1e3 * wall / rounds,
                      "gpu_busy_ms_per_round": busy_us / 1e3 / rounds,
                      "rest_ms_per_round": (1e3 * wall - busy_us / 1e3) / rounds,
                      "kernels_per_round": len(kernels) / rounds,
                      # the round's kernels over the decoder layers its forwards ran (a target forward, and a draft
                      # forward per draft step): the kernels a layer costs, sampling and verification included
                      "kernels_per_layer_run": len(kernels) / (rounds * t_layers + out.stats.draft_calls * d_layers),
                      "draft_forwards_per_round": out.stats.draft_calls / rounds,
                      "top_kernels": [{"name": k[:120], "count": c, "us_per_round": t / rounds} for k, (c, t) in top]}
        r = rows[name]
        print(f"{name}: {r['wall_ms_per_round']:.3f} ms/round, GPU busy {r['gpu_busy_ms_per_round']:.3f}, rest "
              f"{r['rest_ms_per_round']:.3f}, {r['kernels_per_round']:.0f} kernels/round "
              f"({r['kernels_per_layer_run']:.1f} per layer run), "
              f"{r['draft_forwards_per_round']:.2f} draft forwards/round", flush=True)
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        tables.append(f"## {name}\n" + prof.key_averages().table(sort_by=sort, row_limit=25))
    result = {"machine": machine_description(pair), "command": "python bench/cuda_profile.py " + " ".join(argv or []),
              "date": time.strftime("%Y-%m-%d"), "max_new_tokens": n, "rows": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".txt").write_text("\n\n".join(tables) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
