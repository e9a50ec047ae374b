"""SpecDec++ with early exit (a stop flag read after each draft step, the default) against drafting to the round's cap
with one read-back per round (``early_exit=False``, the form a CUDA graph replays), one request at a time.

Both arms run the same policy on the same prompts in one process, alternating prompt by prompt in a balanced order,
greedy (so both emit the same tokens: the stop rule decides which candidates are verified, never the output): each
arm's total tokens/s, draft forwards per round, host reads per round, and the paired per-prompt ratio with a
bootstrap 95% interval. Run for ``threshold="auto"`` and a fixed h (``--thresholds``).

    python bench/early_exit.py --prompts 164 --max-new-tokens 64 --out docs/results/early_exit_bf16_epyc.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from paired import paired  # noqa: E402
from specdec_ext import SpeculativeGenerator  # noqa: E402
from specdec_ext.benchmark import balanced_order, machine_description  # noqa: E402
from specdec_ext.prompts import load_prompts  # noqa: E402
from specdec_ext.zoo import load_pair  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=164, help="the first N HumanEval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--thresholds", default="auto,0.8", help="comma-separated stop thresholds (h or auto)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    pair = load_pair()
    ids = [torch.tensor([pair.tokenizer(t)["input_ids"]]) for t in load_prompts("humaneval")[: args.prompts]]
    arms = {}
    for h in args.thresholds.split(","):
        threshold = h if h == "auto" else float(h)
        for exit_ in (True, False):
            gen = SpeculativeGenerator(pair.target, pair.draft, policy="specdecpp", head=pair.head,
                                       threshold=threshold, k_max=20, early_exit=exit_)
            gen.prepare(1)
            arms[f"h={h} {'early exit' if exit_ else 'to the cap'}"] = gen
    runs = {a: {} for a in arms}
    steps = {a: [0, 0] for a in arms}  # draft forwards, rounds
    t0 = time.perf_counter()
    for i, x in enumerate(ids):
        for a in balanced_order(list(arms), i):
            t = time.perf_counter()
            out = arms[a].generate(x, max_new_tokens=args.max_new_tokens, temperature=0)
            runs[a][i] = (len(out.new_tokens[0]), time.perf_counter() - t)
            steps[a][0] += out.stats.draft_calls
            steps[a][1] += len(out.stats.rounds)
    rows = []
    names = list(arms)
    for cap in names[1::2]:
        exit_ = names[names.index(cap) - 1]
        p = paired(runs[exit_], runs[cap])
        row = {"early_exit": exit_, "to_the_cap": cap, "prompts": p["prompts"], "total_ratio": p["total_ratio"],
               "median_ratio": p["median_ratio"], "ci95": list(p["ci95"])}
        for a, key in ((exit_, "early_exit"), (cap, "to_the_cap")):
            tok, sec = sum(n for n, _ in runs[a].values()), sum(s for _, s in runs[a].values())
            row[key + "_tokens_per_s"] = tok / sec
            row[key + "_draft_calls_per_round"] = steps[a][0] / max(1, steps[a][1])
        rows.append(row)
        print(f"{exit_} over {cap}: {p['total_ratio']:.3f}x total, paired {p['median_ratio']:.3f}x "
              f"[{p['ci95'][0]:.3f}, {p['ci95'][1]:.3f}]; draft forwards per round "
              f"{row['early_exit_draft_calls_per_round']:.2f} against {row['to_the_cap_draft_calls_per_round']:.2f}",
              flush=True)
    result = {"machine": machine_description(pair), "seconds": time.perf_counter() - t0,
              "command": "python bench/early_exit.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "rows": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
