"""Paired comparison of methods in one results file of `specdec bench`: for each method against a baseline, the
median over prompts of the per-prompt ratio of tokens/s, with a bootstrap 95% interval over prompts, the share
of prompts where the method was faster, and the ratio of total tokens/s (all prompts' tokens over all their
time). Per-prompt ratios compare runs of the same prompt made minutes apart in one process, so they cancel
the prompts' own differences in length and difficulty that a ratio of medians keeps.

    python bench/paired.py docs/results/bench-humaneval.json.gz --baseline "fixed K=6"
    python bench/paired.py docs/results/bench-humaneval.json.gz --best-fixed   # against the best fixed K
    python bench/paired.py docs/results/bench-*.json.gz --auto   # each auto arm against the best fixed h and K
    python bench/paired.py "docs/results/smollm2.json.gz#humaneval"   # one set of a file that joins several runs

``--auto``: per results file, each ``specdec++ auto`` arm (and its copies) against the fixed stop threshold h and the
fixed K of the highest total tokens/s in that run (chosen in hindsight, on the same prompts).
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


def total(runs: dict) -> float:
    """Total tokens/s of one method's runs ``{prompt: (tokens, seconds)}``."""
    return sum(t for t, _ in runs.values()) / sum(s for _, s in runs.values())


def results(path: str) -> list[tuple[str, dict]]:
    """``(label, results)`` of a file of ``specdec bench``; of each set of a file that joins several runs
    (``{"sets": {name: results}}``, as ``docs/results/smollm2.json.gz``), or of one of them with ``FILE#NAME``."""
    file, _, name = path.partition("#")
    data = load_results(file)
    if "sets" not in data:
        return [(path, data)]
    if name and name not in data["sets"]:
        raise SystemExit(f"{file} has no set {name!r}: it has {', '.join(data['sets'])}")
    return [(f"{file}#{n}", data["sets"][n]) for n in ([name] if name else data["sets"])]


def against_best(path: str, data: dict) -> list[str]:
    """The ``--auto`` lines of one results file."""
    runs = per_prompt(data["runs"])
    best = {}
    for family, prefix in (("h", "specdec++ h="), ("K", "fixed K=")):
        arms = [m for m in runs if m.startswith(prefix)]
        if arms:
            best[family] = max(arms, key=lambda m: total(runs[m]))
    lines = [f"{path}: best h {best.get('h')}, best K {best.get('K')} (by total tokens/s)"]
    for method in [m for m in runs if m.startswith("specdec++ auto")]:
        parts = [f"{method:30s} {total(runs[method]):7.1f} tok/s"]
        for family, other in best.items():
            p = paired(runs[method], runs[other])
            parts.append(f"/ best {family}: total {p['total_ratio']:.3f}x, paired {p['median_ratio']:.3f}x "
                         f"[{p['ci95'][0]:.3f}, {p['ci95'][1]:.3f}]")
        lines.append("  " + " ".join(parts))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="a .json or .json.gz written by specdec bench (several with --auto)")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--baseline", default="plain", help="the method every other is compared with")
    group.add_argument("--best-fixed", action="store_true",
                       help="compare with the fixed K of the highest median speedup over plain decoding in the file's "
                            "summary")
    group.add_argument("--auto", action="store_true",
                       help="each auto arm against the best fixed h and the best fixed K of its run (total tokens/s)")
    args = ap.parse_args()
    if args.auto:
        for path in args.results:
            for label, data in results(path):
                print("\n".join(against_best(label, data)))
        return
    sets = [r for path in args.results for r in results(path)]
    if len(sets) != 1:
        raise SystemExit("give one results file, or FILE#SET of a joined file (several only with --auto)")
    args.results, data = sets[0]
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
