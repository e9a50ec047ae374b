"""What deciding the depth per round from the rows' survivals can gain over the best fixed depth, in a batch.

A batch's round verifies every row to the deepest row's depth, so the verification budget chooses one depth
per round (``policies/budget.BatchBudget``). This replays that choice offline. Every round of one
``generate_continuous`` call drafts D candidates per row (greedy, the bundled pair, continuous batching at batch
size B) and records the head's survivals S_bj and each row's accepted candidates; greedy acceptance of slot j
depends only on the prefix, so the tokens any depth c <= D would have emitted in that round are known:
sum_b (1 + min(accepted_b, c)). Round times per depth are the medians of full-batch rounds of fixed K = 1 .. D
measured in the same process just before, the depths rotating stream by stream. The replay then compares

- fixed depth c, every round;
- the one-step rule between c and c + 1 (the budget's headroom): draft slot c + 1 only when the rows' summed
  survival of slot c, sum_b S_bc, reaches a cut; every cut of a grid (the quantiles of that sum) is played.

The best cut is chosen on the same rounds it is scored on (in-sample), so it bounds what a rule of this kind gains
on this text; the budget's own cut comes from its cost model (:meth:`BatchBudget.go_on`). The same bound is given for
other signals the rule could read before drafting slot c + 1 (:data:`SIGNALS`): the draft's own confidence (the
product of q(y) over slots 1..c, summed over rows: no head step), the previous full round's accepted candidates, and
the head's survival plus a tenth of those; and the oracle, each round at the depth that was best for it in hindsight
(the choice of depths with the highest tokens/s over all rounds: what a perfect predictor of each round's acceptances
would gain).

The report also gives the head's calibration per slot (:func:`slot_calibration`) over every recorded round, the
tail's included: the budget scales every slot's survival by one measured factor a (``BatchBudget.head_scale``),
and this shows how far each slot's own factor is from it.

    python bench/batch_replay.py --batch-size 4 --out docs/results/batch_replay_b4_bf16_epyc.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.benchmark import machine_description
from specdec_ext.policies import SpecDecPP, make_policy
from specdec_ext.policies.goodput import BatchBudget
from specdec_ext.prompts import load_prompts
from specdec_ext.zoo import load_pair


class _EveryRoundAtDepth(BatchBudget):
    """A budget whose every round drafts ``depth`` candidates per row, scores every slot and verifies them all
    (the budget's own verified depth could drop the last slots, and their outcomes would go unrecorded)."""

    def __init__(self, batch, depth: int):
        super().__init__(batch)
        self.fixed_depth = depth

    def _measured_cap(self, B: int) -> int:
        self.forced = True
        return self.fixed_depth

    def depth(self, survivals: torch.Tensor) -> int:
        return survivals.shape[1]


class _Recording(SpecDecPP):
    """SpecDecPP that keeps each round's survivals ``[B, D]`` and per-row drafted / accepted counts."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.recorded: list[dict] = []
        self._q: list[list[float]] = []

    def begin_round(self):
        super().begin_round()
        self._q = []

    def should_stop(self, info):
        # q(y) of each row's candidate (greedy: q = softmax of the draft's logits), 0 for rows not drafting the slot
        q = torch.softmax(info.logits.float(), -1).gather(-1, info.tokens.view(-1, 1)).squeeze(-1)
        self._q.append((q * info.drafting.float() if info.drafting is not None else q).tolist())
        return super().should_stop(info)

    def end_round(self, num_drafted, num_accepted):
        if not self._plain and self._S is not None:
            self.recorded.append(dict(S=self._S.tolist(), Q=[list(row) for row in zip(*self._q)],
                                      drafted=num_drafted.tolist(), accepted=num_accepted.tolist()))
        super().end_round(num_drafted, num_accepted)


def round_times(gen, prompts, B, depths, **kw) -> dict[int, float]:
    """Median ms of full-batch rounds of fixed K = c, for each c in ``depths`` (0: plain decoding), the prompts
    served in streams of 4 B requests with the depths rotating per stream (the machine's drift falls on all)."""
    depths = list(depths)
    rounds = {c: [] for c in depths}
    for i, s in enumerate(range(0, len(prompts), 4 * B)):
        for c in depths[i % len(depths):] + depths[: i % len(depths)]:
            policy = make_policy("autoregressive") if c == 0 else make_policy("fixed", k=c)
            out = gen.generate_continuous(prompts[s: s + 4 * B], B, policy=policy, **kw)
            rounds[c] += [r.total_ms for r in out.stats.rounds if len(r.rows) == B]
    return {c: statistics.median(v) for c, v in rounds.items()}


def _head(rounds, i, c):
    """Signal: the head's survivals of slot c summed over rows, sum_b S_bc (the budget's one-step rule reads it)."""
    return sum(row[c - 1] for row in rounds[i]["S"])


def _confidence(rounds, i, c):
    """Signal: the draft's own confidence, the rows' summed product of q(y) over slots 1..c (no head step)."""
    return sum(math.prod(row[:c]) for row in rounds[i]["Q"])


def _previous(rounds, i, c):
    """Signal: the candidates the batch accepted in the round before (its first round: one per row)."""
    return sum(rounds[i - 1]["accepted"]) if i else len(rounds[i]["accepted"])


# what a one-step rule between depths c and c + 1 could read before drafting slot c + 1: name -> signal(rounds, i, c),
# a number that the rule compares with a cut (the round drafts slot c + 1 where it reaches the cut)
SIGNALS = {
    "head_survival": _head,
    "draft_confidence": _confidence,
    "previous_round": _previous,
    "head_survival_and_previous": lambda rounds, i, c: _head(rounds, i, c) + 0.1 * _previous(rounds, i, c),
}


def replay(rounds: list[dict], times: dict[int, float], depth: int, B: int, cuts: int = 20) -> dict:
    """Tokens/s of fixed depths, of the one-step rule between c and c + 1 on each signal of :data:`SIGNALS` at its
    best of ``cuts`` + 1 cuts (the signal's quantiles over the rounds), and of the oracle (every round at its own best
    depth), over the recorded full-batch ``rounds`` (those of B rows that drafted ``depth`` slots), each depth's
    round taking ``times[c]`` ms. ``rule`` is the head survival's, ``signals`` every signal's best over the best fixed
    depth (a signal needing a record the rounds lack, such as ``Q``, is left out)."""
    rounds = [r for r in rounds if len(r["S"]) == B and len(r["S"][0]) >= depth]

    def tokens(r, c):
        return sum(1 + min(a, c, d) for a, d in zip(r["accepted"], r["drafted"]))

    def rate(choose):
        tok = ms = 0.0
        for i, r in enumerate(rounds):
            c = choose(i)
            tok, ms = tok + tokens(r, c), ms + times[c]
        return tok / ms * 1e3

    def one_step(signal, c):
        values = [signal(rounds, i, c) for i in range(len(rounds))]
        ranked = sorted(values)
        grid = [ranked[int(q * (len(ranked) - 1))] for q in [j / cuts for j in range(cuts + 1)]]
        curve = [(cut, rate(lambda i, cut=cut: c + 1 if values[i] >= cut else c)) for cut in grid]
        return max(curve, key=lambda x: x[1]), curve

    fixed = {c: rate(lambda i, c=c: c) for c in range(1, depth + 1)}
    best_fixed = max(fixed, key=fixed.get)
    rules, signals = {}, {}
    for name, signal in SIGNALS.items():
        if name == "draft_confidence" and not all("Q" in r for r in rounds):
            continue
        for c in range(1, depth):
            best, curve = one_step(signal, c)
            signals.setdefault(name, {})[f"{c}..{c + 1}"] = best[1] / fixed[best_fixed]
            if name == "head_survival":
                rules[f"{c}..{c + 1}"] = dict(best_cut=best[0], best_tokens_per_s=best[1],
                                              curve=[dict(cut=x, tokens_per_s=y) for x, y in curve])
    oracle = fixed[best_fixed]  # each round at its best depth given the others (Dinkelbach: at the rate lam, a round's
    for _ in range(20):          # best depth maximises tokens - lam * ms; the rate those depths give is the next lam)
        lam = oracle / 1e3
        oracle = rate(lambda i: max(range(1, depth + 1), key=lambda c: tokens(rounds[i], c) - lam * times[c]))
        if oracle <= lam * 1e3 * (1 + 1e-12):
            break
    return dict(rounds=len(rounds), fixed_tokens_per_s=fixed, best_fixed=best_fixed,
                rule=rules, best_rule_over_best_fixed=max(v["best_tokens_per_s"] for v in rules.values())
                / fixed[best_fixed], signals=signals, oracle_over_best_fixed=oracle / fixed[best_fixed])


def slot_calibration(rounds: list[dict]) -> list[dict]:
    """The head's calibration per drafted slot j = 1 .. D over recorded ``rounds`` (each ``S`` per row: the
    survivals S_bj; ``drafted`` and ``accepted`` per row): the rows that drafted slot j (S_bj > 0), the share of them
    that accepted it (accepted_b >= j), their mean S_bj, and a_j, that share over that mean (the factor by which the
    head's survivals understate slot j's acceptance); and among those rows the ones whose slots before j were all
    accepted: how many, the share that accepted slot j, and their mean p_hat_j = S_bj / S_b,j-1 (the head's own
    probability for that step, SpecDec++ Eq. 1). A head whose every step is a little underconfident understates the
    deeper slots' survivals more: the products compound it."""
    depth = max((len(row) for r in rounds for row in r["S"]), default=0)
    out = []
    for j in range(depth):
        drafted = [(row[j], row[j - 1] if j else 1.0, a) for r in rounds for row, a, d in
                   zip(r["S"], r["accepted"], r["drafted"]) if j < min(d, len(row)) and row[j] > 0]
        reached = [(s / prev, a) for s, prev, a in drafted if a >= j and prev > 0]
        n, m = len(drafted), len(reached)
        share = sum(a > j for _, _, a in drafted) / n if n else None
        mean = sum(s for s, _, _ in drafted) / n if n else None
        out.append({"slot": j + 1, "rows": n, "acceptance": share, "mean_survival": mean,
                    "calibration": share / mean if n and mean else None, "rows_reached": m,
                    "step_acceptance": sum(a > j for _, a in reached) / m if m else None,
                    "mean_p_hat": sum(p for p, _ in reached) / m if m else None})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--depth", type=int, default=3, help="candidates drafted per row in the recorded rounds")
    ap.add_argument("--prompts", type=int, default=128, help="the first N HumanEval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.batch_size < 2 or args.depth < 2:
        ap.error("--batch-size and --depth must be >= 2")
    pair = load_pair()
    tok = pair.tokenizer
    prompts = [torch.tensor(tok(p)["input_ids"]) for p in load_prompts("humaneval")[: args.prompts]]
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=0, eos_token_id=tok.eos_token_id)
    policy = _Recording(pair.heads["greedy"], threshold="auto")
    gen = SpeculativeGenerator(pair.target, pair.draft, policy=policy)
    gen.generate_continuous(prompts[: args.batch_size], args.batch_size, **dict(kw, max_new_tokens=8))  # warm-up
    t0 = time.perf_counter()
    times = round_times(gen, prompts, args.batch_size, range(args.depth + 1), **kw)
    # kept by configure (same table and head)
    policy.budget = _EveryRoundAtDepth(gen.batch_costs(args.batch_size), args.depth)
    policy.recorded.clear()
    gen.generate_continuous(prompts, args.batch_size, **kw)
    report = dict(command="python bench/batch_replay.py " + " ".join(sys.argv[1:]), batch_size=args.batch_size,
                  depth=args.depth, prompts=len(prompts), max_new_tokens=args.max_new_tokens, round_ms=times,
                  machine=machine_description(pair),
                  seconds=time.perf_counter() - t0, **replay(policy.recorded, times, args.depth, args.batch_size),
                  slot_calibration=slot_calibration(policy.recorded))
    line = {k: round(v, 1) for k, v in report["fixed_tokens_per_s"].items()}
    ms = {k: round(v, 1) for k, v in times.items()}
    print(f"B = {args.batch_size}: fixed depth tokens/s {line}; round ms {ms}")
    for name, r in report["rule"].items():
        print(f"  one-step rule {name}: best cut {r['best_cut']:.2f} -> {r['best_tokens_per_s']:.1f} tokens/s")
    print(f"  best rule / best fixed depth ({report['best_fixed']}): {report['best_rule_over_best_fixed']:.3f}")
    for name, by_rule in report["signals"].items():
        print(f"  {name}: " + ", ".join(f"{k} {v:.4f}" for k, v in by_rule.items()) + " x the best fixed depth")
    print(f"  oracle (each round at its best depth in hindsight): {report['oracle_over_best_fixed']:.4f}x")
    for c in report["slot_calibration"]:
        if c["rows"]:
            print(f"  slot {c['slot']}: acceptance {c['acceptance']:.3f}, mean survival {c['mean_survival']:.3f}, "
                  f"calibration a_j {c['calibration']:.3f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
