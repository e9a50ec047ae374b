"""Paired comparison of methods in one results file of `specdec bench`: for each method against a baseline, the
median over prompts of the per-prompt ratio of tokens/s, with a bootstrap 95% interval over prompts, the share
of prompts where the method was faster, and the ratio of total tokens/s (all prompts' tokens over all their
time). Per-prompt ratios compare runs of the same prompt made minutes apart in one process, so they cancel
the prompts' own differences in length and difficulty that a ratio of medians keeps.

    python bench/paired.py docs/results/bench-humaneval.json.gz --baseline "fixed K=6"
    python bench/paired.py docs/results/bench-humaneval.json.gz --best-fixed   # against the best fixed K
"""

from __future__ import annotations

import argparse
import random
import statistics

from specdec_ext.benchmark import load_results


def per_prompt(runs: list[dict]) -> dict:
    """``{method: {prompt: (new_tokens, wall_s)}}`` of the single-request runs (batch runs are skipped)."""
    out: dict = {}
    for r in runs:
        if r.get("batch_size", 1) == 1 and r["wall_s"] > 0:
            out.setdefault(r["method"], {})[r["prompt"]] = (r["new_tokens"], r["wall_s"])
    return out


def paired(a: dict, b: dict, reps: int = 2000, seed: int = 0) -> dict:
    """Method ``a`` against ``b`` (``{prompt: (tokens, seconds)}`` each) over the prompts both ran."""
    prompts = sorted(set(a) & set(b))
    if not prompts:
        raise ValueError("the two methods share no prompt")
    ratios = [(a[p][0] / a[p][1]) / (b[p][0] / b[p][1]) for p in prompts]
    rng = random.Random(seed)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(reps))
    total = (sum(a[p][0] for p in prompts) / sum(a[p][1] for p in prompts)) / \
        (sum(b[p][0] for p in prompts) / sum(b[p][1] for p in prompts))
    return {"prompts": len(prompts), "median_ratio": statistics.median(ratios),
            "ci95": (boot[int(0.025 * reps)], boot[int(0.975 * reps) - 1]),
            "faster_on": sum(r > 1 for r in ratios), "total_ratio": total}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a .json or .json.gz written by specdec bench")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--baseline", default="plain", help="the method every other is compared with")
    group.add_argument("--best-fixed", action="store_true",
                       help="compare with the fixed K of the highest median speedup over plain decoding in the file's summary")
    args = ap.parse_args()
    data = load_results(args.results)
    runs = per_prompt(data["runs"])
    baseline = args.baseline
    if args.best_fixed:
        fixed = [r for r in data["summary"] if r["method"].startswith("fixed K=") and r.get("batch_size", 1) == 1]
        baseline = max(fixed, key=lambda r: r["speedup"])["method"]
    if baseline not in runs:
        raise SystemExit(f"no method {baseline!r} in {args.results}: it has {', '.join(runs)}")
    print(f"against {baseline} (median of per-prompt tokens/s ratios, bootstrap 95% interval; total tokens/s ratio)")
    for method, r in runs.items():
        if method == baseline:
            continue
        p = paired(r, runs[baseline])
        print(f"{method:32s} {p['median_ratio']:.3f}x [{p['ci95'][0]:.3f}, {p['ci95'][1]:.3f}]  faster on "
              f"{p['faster_on']}/{p['prompts']}  total {p['total_ratio']:.3f}x")


if __name__ == "__main__":
    main()
