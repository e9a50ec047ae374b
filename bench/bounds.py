"""Bounds of stop rules, by replay: ``labels``, what any acceptance head could gain over the best fixed K; ``lookup``,
what any stop rule over prompt lookup could gain, and a copy or a draft chosen per round.

    python bench/bounds.py labels --out docs/results/label_bound.json
    python bench/bounds.py lookup "docs/results/smollm2_proposers.json.gz#fp32" --hybrid
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specdec_ext import SpeculativeGenerator  # noqa: E402
from specdec_ext.benchmark import machine_description  # noqa: E402
from specdec_ext.engine.lookup import PromptLookup  # noqa: E402
from specdec_ext.policies.costs import CostModel  # noqa: E402
from specdec_ext.policies.lookup import AcceptanceTable, best_depth  # noqa: E402
from specdec_ext.prompts import load_prompts  # noqa: E402
from specdec_ext.training.head_data import HeadDataConfig, generate_head_data  # noqa: E402
from specdec_ext.training.head_features import draft_features  # noqa: E402
from specdec_ext.training.pipeline import EVAL_MODES, replay_report  # noqa: E402
from specdec_ext.training.replay import flat_costs  # noqa: E402
from specdec_ext.zoo import load_pair  # noqa: E402

LABELS_DOC = """How much any acceptance head could gain over the best fixed K: the offline replay of the auto rule with
the bundled heads' p_hat beside the same rule fed the recorded labels.

For every HumanEval prompt the target generates a response (greedy, and sampled at temperature 1), and the
draft's candidate at each response position is labelled (``training/head_data.py``): greedy, 1 when it
equals the target's token; sampling, its acceptance probability min(1, p(y) / q(y)) with one accept/reject
draw of it. The replay (``training/replay.py``) plays speculative rounds over those outcomes under a cost
model. Fed the labels themselves, the auto rule knows the target's p(y), which no head sees (a head's best
prediction is the expectation of the label given the draft's side): its gain over the best fixed K bounds
any head's gain under that rule on these responses. Greedy labels are the outcomes, so there the bound is
the oracle; at temperature 1 it tells whether a sampling head can beat the best fixed K at all.

Cost models: flat GPU-like verification with a draft step of 0.1 and 0.2 target forwards, and the pair's
profile on this machine (the one ``threshold="auto"`` uses).

    python bench/bounds.py labels --out docs/results/label_bound.json"""

LOOKUP_DOC = """How much a stop rule over prompt lookup can gain: a replay of the greedy outputs of a `specdec bench` run.

Greedy decoding's output is fixed, a prompt-lookup proposal at context length L is a function of the context, and
its accepted length is its common prefix with the output: so any rule that decides how many copied candidates to
verify can be replayed exactly, round by round, on the plain arm's token sequences, its time modelled by the
target's measured verification costs (``--costs``: a profile JSON, ``engine/profile.py``; default the bench file's
``meta.cost_model``, its draft terms dropped: a proposer has no draft forward). Reported, as ratios to plain decoding
modelled the same way: fixed K, the oracle (verifies exactly the candidates that will be accepted: the bound of any
rule), and SpecDec++'s goodput rule (``policies/lookup.py``) over acceptance tables keyed by several feature sets.
With ``--hybrid`` also the pair's draft model (its greedy candidates at every position, computed once): the draft
alone (depth by its confidence, step by step) and a per-round choice between the copy and the draft by expected
goodput from tables known before the round (the bound: the better of the two in hindsight); the draft's costs from
the bench file's profile.

    python bench/bounds.py lookup "docs/results/smollm2_proposers.json.gz#fp32" --hybrid"""


def labels(argv=None) -> None:
    """``labels``: the auto rule replayed with the heads' p_hat beside the same rule fed the recorded labels."""
    ap = argparse.ArgumentParser(prog="bench/bounds.py labels", description=LABELS_DOC)
    ap.add_argument("--prompts", type=int, default=None, help="first N HumanEval prompts (default: all 164)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("docs/results/label_bound.json"))
    args = ap.parse_args(argv)
    t0 = time.time()
    pair = load_pair()
    prompts = load_prompts("humaneval", args.prompts)
    here = SpeculativeGenerator(pair.target, pair.draft, policy="specdecpp", head=pair.head, threshold="auto").costs()
    cost_models = {"flat, draft step 0.1": flat_costs(0.1), "flat, draft step 0.2": flat_costs(0.2),
                   "this machine's profile": here}
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for mode, head_name in (("greedy", "greedy"), ("sample-T1", "sample")):
            head = pair.heads[head_name]
            cfg = HeadDataConfig(mix_ratio=0.0, max_new_tokens=args.max_new_tokens, **EVAL_MODES[mode])
            data = generate_head_data(pair.target, pair.draft, pair.tokenizer, prompts, cfg,
                                      path=Path(work) / f"{mode}.safetensors")
            feats = draft_features(pair.draft, data, head.input_position, contexts="target")
            for name, costs in cost_models.items():
                r = replay_report(head, feats, costs)
                rows.append({"decoding": mode, "head": head_name, "positions": int(feats["labels"].numel()),
                             "cost_model": name, **{k: v for k, v in r.items() if k != "cost_model"}})
                print(f"{mode:9s} {name:24s} best fixed K = {r['best_fixed_k']}: head {r['auto_vs_best_fixed']:.3f}x, "
                      f"labels (bound) {r['label_bound_vs_best_fixed']:.3f}x, oracle {r['oracle_vs_best_fixed']:.3f}x "
                      "(median speedup over the best fixed K's)")
    meta = {"machine": machine_description(pair), "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "profile": here.meta, "duration_s": time.time() - t0,
            "command": "python bench/bounds.py labels" + (f" --prompts {args.prompts}" if args.prompts else "")
            + (f" --max-new-tokens {args.max_new_tokens}" if args.max_new_tokens != 64 else "")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")



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
        return best_depth(table.rates(key(f), f["length"]), costs)[0]

    return choose, lambda f, j, a: table.add(key(f), j, a)


def bucket(x: int, edges=(2, 3, 4, 6, 8, 12, 16)) -> int:
    return sum(x >= e for e in edges)


FEATURES = {
    "n, streak (shipped)": lambda f: (f["n"], f["streak"]),
    "n": lambda f: (f["n"],),
    "match length to 32": lambda f: (bucket(f["match"]),),
    "match length to 32, streak": lambda f: (bucket(f["match"]), f["streak"]),
}


def draft_chains(pair, seqs, k_max: int = 8) -> list:
    """For each (prompt, output) and each output position L: the draft's greedy chain of ``k_max`` tokens after the
    first L tokens and its probability of each (teacher-forced on the output, as the engine's draft reads it)."""
    out = []
    with torch.inference_mode():
        for prompt, gen in seqs:
            full, chains = prompt + gen, {}
            for L in range(len(prompt), len(full)):
                o = pair.draft(torch.tensor([full[:L]]), use_cache=True)
                cache, logits, chain = o.past_key_values, o.logits[0, -1], []
                for _ in range(k_max):
                    p = torch.softmax(logits.float(), -1)
                    t = int(p.argmax())
                    chain.append((t, float(p[t])))
                    o = pair.draft(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
                    cache, logits = o.past_key_values, o.logits[0, -1]
                chains[L] = chain
            out.append(chains)
    return out


def hybrid(seqs, chains, look: CostModel, pair_costs: CostModel, k_max: int = 8) -> dict:
    """Modelled tokens per ms of the draft alone, the per-round choice, and its bound (:func:`draft_chains`)."""
    lookup = PromptLookup(1, 4, k_max)
    tables = {"copy": AcceptanceTable(k_max), "draft": AcceptanceTable(k_max)}
    conf: dict = {}  # the draft's q(y) bin -> (tried, accepted): its confidence calibrated

    def calibrated(q):
        tried, acc = conf.get(min(9, int(q * 10)), (0, 0))
        return (acc + 2 * q) / (tried + 2)

    def draft_depth(chain, mean):  # step by step: stop once one more step's expected goodput is lower
        tokens, survive = 1.0, 1.0
        for t, (_, q) in enumerate(chain):
            now = survive * calibrated(q)
            if t + 1 < len(chain) and (tokens + now + now * mean[t + 1]) / pair_costs.round_time(t + 2) <= \
                    (tokens + now) / pair_costs.round_time(t + 1):
                return t + 1
            tokens, survive = tokens + now, now
        return len(chain)

    def run(mode):
        ms = tokens = 0.0
        for (prompt, gen), ch in zip(seqs, chains):
            full, L, prev = prompt + gen, len(prompt), (0, 0)
            state = lookup.new_state()
            while L < len(full):
                room = min(k_max, len(full) - L - 1)
                cands, n = lookup.propose(state, full[:L], room) if room > 0 else ([], 0)
                chain = ch[L][:room]
                truth_c = next((i for i, c in enumerate(cands) if c != full[L + i]), len(cands))
                truth_d = next((i for i, (t, _) in enumerate(chain) if t != full[L + i]), len(chain))
                key = (n, prev[0] > 0 and prev[1] == prev[0])
                if mode == "bound":
                    g = lambda a, c: (a + 1) / (c.round_time(a) if a else c.plain_ms())  # noqa: E731
                    kind = "copy" if g(truth_c, look) >= g(truth_d, pair_costs) else "draft"
                    j = truth_c if kind == "copy" else truth_d
                else:
                    jc, gc = best_depth(tables["copy"].rates(key, len(cands)), look) if cands else (0, 0.0)
                    mean = tables["draft"].rates("d", room)
                    gd = best_depth(mean, pair_costs)[1] if room else 0.0
                    kind = "copy" if mode == "choice" and gc >= gd else "draft"
                    j = jc if kind == "copy" else draft_depth(chain, mean)
                a = min(truth_c if kind == "copy" else truth_d, j)
                costs = look if kind == "copy" else pair_costs
                ms += costs.round_time(j) if j else costs.plain_ms()
                tokens += a + 1
                if j and kind == "copy":
                    tables["copy"].add(key, j, a)
                elif j:
                    tables["draft"].add("d", j, a)
                    for t in range(min(j, a + 1)):
                        b = min(9, int(chain[t][1] * 10))
                        tried, acc = conf.get(b, (0, 0))
                        conf[b] = (tried + 1, acc + (t < a))
                prev, L = ((j, a) if kind == "copy" else (0, 0)), L + a + 1
        return tokens / ms

    out = {}
    for mode, name in (("draft", "draft alone, depth by its confidence"),
                       ("choice", "per round: copy or draft (choice before the round)"),
                       ("bound", "per round: the better of copy and draft in hindsight (bound)")):
        tables = {"copy": AcceptanceTable(k_max), "draft": AcceptanceTable(k_max)}
        conf.clear()
        out[name] = run(mode)
    return out


def lookup(argv=None) -> dict:
    """``lookup``: stop rules over prompt lookup (and ``--hybrid``: beside the draft) replayed on a run's outputs."""
    ap = argparse.ArgumentParser(prog="bench/bounds.py lookup", description=LOOKUP_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a `specdec bench` JSON (.json or .json.gz) with a greedy plain arm, or FILE#SET "
                                    "for one set of a file that joins several runs ({'sets': {SET: results}})")
    ap.add_argument("--pair", default="smollm2-135m", help="the named pair whose tokenizer encoded the prompts")
    ap.add_argument("--costs", type=Path, default=None, help="a profile JSON (default: the results' meta.cost_model)")
    ap.add_argument("--hybrid", action="store_true", help="also the pair's draft model, alone and chosen per round")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    path, _, name = args.results.partition("#")
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as fh:
        data = json.load(fh)
    if name:
        data = data["sets"][name]
    cm = json.loads(args.costs.read_text()) if args.costs else data["meta"]["cost_model"]
    costs = CostModel(cm["verify_ms"], 0.0, 0.0, cm.get("round_ms", 0.0))  # a proposer: no draft forward

    meta = data["meta"]
    outs = {r["prompt"]: r["tokens"] for r in data["runs"] if r["method"] == "plain"}
    pair = load_pair(args.pair, target_dtype=torch.float32, draft_dtype=torch.float32)
    tok = pair.tokenizer
    prompts = load_prompts(meta.get("dataset", "humaneval"), limit=len(outs))
    seqs = [(tok(p)["input_ids"], outs[i]) for i, p in enumerate(prompts)]
    plain = replay(seqs, costs, lambda f: 0)
    res = {f"fixed K={k}": replay(seqs, costs, lambda f, k=k: k) / plain for k in (2, 4, 6, 8)}
    res["oracle"] = replay(seqs, costs, lambda f: f["truth"]) / plain
    for name, key in FEATURES.items():
        res[f"auto, table over {name}"] = replay(seqs, costs, *goodput_rule(costs, key)) / plain
    if args.hybrid:
        pair_costs = CostModel(cm["verify_ms"], cm["draft_ms"], cm.get("step_ms", 0.0), cm.get("round_ms", 0.0))
        for name, rate in hybrid(seqs, draft_chains(pair, seqs), costs, pair_costs).items():
            res[name] = rate / plain
    for k, v in res.items():
        print(f"{k:45s} {v:.3f}x plain (modelled)")
    out = {"meta": {"results": str(args.results), "command": "python bench/bounds.py lookup " + " ".join(
        sys.argv[1:] if argv is None else argv), "plain_tokens_per_s": plain * 1e3}, "ratios": res}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return out



if __name__ == "__main__":
    torch.set_num_threads(2)
    commands = {"labels": labels, "lookup": lookup}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: python bench/bounds.py {{labels,lookup}} ... (got {sys.argv[1:2] or 'nothing'})")
    commands[sys.argv[1]](sys.argv[2:])
