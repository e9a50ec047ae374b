"""How much a stop rule over prompt lookup can gain: a replay of the greedy outputs of a `specdec bench` run.

Greedy decoding's output is fixed, a prompt-lookup proposal at context length L is a function of the context, and
its accepted length is its common prefix with the output: so any rule that decides how many copied candidates to
verify can be replayed exactly, round by round, on the plain arm's token sequences, its time modelled by the
target's measured verification costs (``--costs``: a profile JSON, ``engine/profile.py``; default the bench file's
``meta.cost_model``, its draft terms dropped: a proposer has no draft forward). Reported, as ratios to plain decoding
modelled the same way: fixed K, the oracle (verifies exactly the candidates that will be accepted: the bound of any
rule), and SpecDec++'s goodput rule (``policies/lookup.py``) over acceptance tables keyed by several feature sets.

    python bench/lookup_replay.py docs/results/smollm2_lookup.json.gz --pair smollm2-135m
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec_ext.engine.lookup import PromptLookup  # noqa: E402
from specdec_ext.policies.costs import CostModel  # noqa: E402
from specdec_ext.policies.lookup import AcceptanceTable  # noqa: E402


def suffix_match(ctx: list, at: int, L: int, cap: int = 32) -> int:
    """Tokens the context before ``at`` and the context before ``L`` share at their ends (at most ``cap``)."""
    n = 0
    while n < cap and at - 1 - n >= 0 and ctx[at - 1 - n] == ctx[L - 1 - n]:
        n += 1
    return n


def replay(seqs, costs: CostModel, choose, learn=None, k_max: int = 8) -> float:
    """Modelled tokens per ms of a rule ``choose(features) -> candidates to verify`` over ``seqs`` [(prompt, output)];
    ``learn(features, verified, accepted)`` after each round."""
    look = PromptLookup(1, 4, k_max)
    ms = tokens = 0.0
    for prompt, out in seqs:
        full, L, prev = prompt + out, len(prompt), (0, 0)
        state = look.new_state()
        while L < len(full):
            room = min(k_max, len(full) - L - 1)
            cands, n = look.propose(state, full[:L], room) if room > 0 else ([], 0)
            truth = 0
            while truth < len(cands) and cands[truth] == full[L + truth]:
                truth += 1
            at = state.seen[n][tuple(full[L - n: L])] if cands else 0
            f = {"n": n, "match": suffix_match(full, at, L) if cands else 0, "streak": prev[0] > 0 and prev[1] == prev[0],
                 "truth": truth, "length": len(cands)}
            j = min(choose(f), len(cands)) if cands else 0
            a = min(truth, j)
            ms += costs.round_time(j) if j else costs.plain_ms()
            tokens += a + 1
            if learn is not None and j:
                learn(f, j, a)
            prev, L = (j, a), L + a + 1
    return tokens / ms


def goodput_rule(costs: CostModel, key, k_max: int = 8):
    """SpecDec++'s goodput rule (policies/lookup.py) over an online acceptance table keyed by ``key(features)``."""
    table = AcceptanceTable(k_max)

    def choose(f):
        best, best_rate, tokens, survive = 0, 1.0 / costs.plain_ms(), 1.0, 1.0
        for j, a in enumerate(table.rates(key(f), f["length"]), 1):
            survive *= a
            tokens += survive
            rate = tokens / costs.round_time(j)
            if rate > best_rate:
                best, best_rate = j, rate
        return best

    return choose, lambda f, j, a: table.add(key(f), j, a)


def bucket(x: int, edges=(2, 3, 4, 6, 8, 12, 16)) -> int:
    return sum(x >= e for e in edges)


FEATURES = {
    "n, streak (shipped)": lambda f: (f["n"], f["streak"]),
    "n": lambda f: (f["n"],),
    "match length to 32": lambda f: (bucket(f["match"]),),
    "match length to 32, streak": lambda f: (bucket(f["match"]), f["streak"]),
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="a `specdec bench` JSON (.json or .json.gz) with a greedy plain arm")
    ap.add_argument("--pair", default="smollm2-135m", help="the named pair whose tokenizer encoded the prompts")
    ap.add_argument("--costs", type=Path, default=None, help="a profile JSON (default: the results' meta.cost_model)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    opener = gzip.open if args.results.suffix == ".gz" else open
    with opener(args.results, "rt") as fh:
        data = json.load(fh)
    cm = json.loads(args.costs.read_text()) if args.costs else data["meta"]["cost_model"]
    costs = CostModel(cm["verify_ms"], 0.0, 0.0, cm.get("round_ms", 0.0))  # a proposer: no draft forward

    from specdec_ext.prompts import load_prompts
    from specdec_ext.zoo import load_pair

    meta = data["meta"]
    outs = {r["prompt"]: r["tokens"] for r in data["runs"] if r["method"] == "plain"}
    tok = load_pair(args.pair).tokenizer
    prompts = load_prompts(meta.get("dataset", "humaneval"), limit=len(outs))
    seqs = [(tok(p)["input_ids"], outs[i]) for i, p in enumerate(prompts)]
    plain = replay(seqs, costs, lambda f: 0)
    res = {f"fixed K={k}": replay(seqs, costs, lambda f, k=k: k) / plain for k in (2, 4, 6, 8)}
    res["oracle"] = replay(seqs, costs, lambda f: f["truth"]) / plain
    for name, key in FEATURES.items():
        res[f"auto, table over {name}"] = replay(seqs, costs, *goodput_rule(costs, key)) / plain
    for k, v in res.items():
        print(f"{k:45s} {v:.3f}x plain (modelled)")
    out = {"meta": {"results": str(args.results), "command": "python bench/lookup_replay.py " + " ".join(
        sys.argv[1:] if argv is None else argv), "plain_tokens_per_s": plain * 1e3}, "ratios": res}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
