"""What a decoding round costs when the batch is full, against the same arms' rounds overall, side by side.

Averaged over a call, a speculative arm's rounds include those in which the call's last requests drain and the
batch runs with fewer rows (speculative rows finish at staggered rounds; plain decoding's requests of equal length
finish together and never run such rounds), so the mean round time understates what a round of the full batch
costs. This bench runs arms (``plain``, ``K<n>``, ``auto``: SpecDec++ with the verification budget, as
``bench/budget_paired.py`` names them) on the same
requests in sets (continuous batching at ``--batch-size``, greedy; the arms' order reversed every other set) and
reports per arm and drafted depth the rounds, their mean ms and tokens, over the rounds with every row
(``full``) and the others (``partial``), and the full rounds' mean ms over plain decoding's in the same set.

    python bench/full_rounds.py --batch-size 16 --arms plain,K1,auto --prompts 64 --sets 2 \\
        --out docs/results/full_rounds_b16.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.benchmark import machine_description
from specdec_ext.prompts import load_prompts
from specdec_ext.zoo import load_pair

sys.path.insert(0, str(Path(__file__).resolve().parent))
from budget_paired import parse_arm, save_result  # noqa: E402  (the arms' names; the JSON writer)


def summarize(rounds, batch_size: int) -> dict:
    """Per drafted depth (the deepest row's candidates), over the rounds with ``batch_size`` rows (``full``) and
    the others (``partial``): rounds, mean ms and mean tokens emitted; ``rounds`` are ``RoundStats``."""
    out: dict = {}
    for r in rounds:
        depth = max(r.candidates) if r.candidates else 0
        kind = "full" if len(r.candidates) == batch_size else "partial"
        e = out.setdefault(str(depth), {}).setdefault(kind, {"rounds": 0, "ms": 0.0, "tokens": 0})
        e["rounds"] += 1
        e["ms"] += r.total_ms
        e["tokens"] += sum(r.emitted)
    for kinds in out.values():
        for e in kinds.values():
            e["mean_ms"], e["mean_tokens"] = e["ms"] / e["rounds"], e["tokens"] / e["rounds"]
    return out


def compare(pair, head, prompts: list, batch_size: int, arms: list, sets: int, max_new_tokens: int,
            costs=None) -> dict:
    """Every arm on every set of ``prompts`` (split into ``sets`` consecutive sets); per set and arm
    :func:`summarize` of its rounds, and each depth's full rounds' mean ms over plain decoding's full rounds in that
    set (with a ``plain`` arm). ``costs``: the pair's ``CostModel`` for ``auto`` (None: profiled)."""
    eos = pair.tokenizer.eos_token_id
    gens = {a: SpeculativeGenerator(pair.target, pair.draft, policy=parse_arm(a, head), costs=costs) for a in arms}

    def generate(arm, requests, n):
        return gens[arm].generate_continuous(requests, batch_size, max_new_tokens=n, temperature=0,
                                             eos_token_id=eos)

    for a in arms:  # warm-up: cost profiles, packed weights, the budget's first measurements at this batch size
        generate(a, prompts[: 2 * batch_size], max_new_tokens)
    size = -(-len(prompts) // sets)
    out = []
    for i in range(sets):
        requests = prompts[i * size : (i + 1) * size]
        row = {}
        for a in (arms if i % 2 == 0 else arms[::-1]):
            t0 = time.perf_counter()
            res = generate(a, requests, max_new_tokens)
            row[a] = {"seconds": time.perf_counter() - t0, "tokens": res.stats.new_tokens,
                      "by_depth": summarize(res.stats.rounds, batch_size)}
        plain = row.get("plain", {}).get("by_depth", {}).get("0", {}).get("full")
        if plain:
            for a in arms:
                for kinds in row[a]["by_depth"].values():
                    if "full" in kinds:
                        kinds["full"]["over_plain_step"] = kinds["full"]["mean_ms"] / plain["mean_ms"]
        out.append(row)
    return {"batch_size": batch_size, "arms": arms, "sets": out}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--arms", default="plain,K1,auto")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--sets", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    pair = load_pair()
    prompts = [torch.tensor(pair.tokenizer(t)["input_ids"]) for t in load_prompts("humaneval")[: args.prompts]]
    t0 = time.perf_counter()
    row = compare(pair, pair.heads["greedy"], prompts, args.batch_size, args.arms.split(","), args.sets,
                  args.max_new_tokens)
    result = {"machine": machine_description(pair), "seconds": time.perf_counter() - t0,
              "command": "python bench/full_rounds.py " + " ".join(argv if argv is not None else []), **row}
    for i, s in enumerate(row["sets"]):
        for a, r in s.items():
            parts = []
            for depth, kinds in sorted(r["by_depth"].items(), key=lambda kv: int(kv[0])):
                for kind, e in sorted(kinds.items()):
                    ratio = f", {e['over_plain_step']:.2f}x a plain step" if "over_plain_step" in e else ""
                    parts.append(f"depth {depth} {kind}: {e['rounds']} rounds, {e['mean_ms']:.2f} ms, "
                                 f"{e['mean_tokens']:.2f} tokens{ratio}")
            print(f"set {i}, {a}: {r['tokens'] / r['seconds']:.1f} tokens/s; " + "; ".join(parts))
    save_result(args.out, result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
