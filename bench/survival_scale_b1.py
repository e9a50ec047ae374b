"""One request at a time: SpecDec++'s ``threshold="auto"`` rule with the head's survivals scaled, side by side.

The per-row goodput rule (``policies.goodput.GoodputRule``) stops after candidate k when S_k < lambda * marginal_ms(k),
S_k the product of the head's p_hat. A head that is underconfident (fewer predicted than accepted tokens) makes the rule
stop early. This bench measures the head's calibration a on the requests (accepted candidates over the summed survivals
S_k of the candidates verified, in the unscaled ``auto`` arm) and runs arms ``auto*s`` in which the rule reads s * S_k,
beside fixed K = 3, the fixed threshold h = 0.8 and ``auto`` itself. Requests run one at a time (B = 1, greedy), each
prompt by every arm in a rotating order (reversed every other cycle), so that each ratio compares the same prompts run
minutes apart; reported: each arm's total tokens/s, its ratio to ``auto``, and the median per-prompt ratio.

    python bench/survival_scale_b1.py --prompts 96 --scales 1.13,1.3 --out docs/results/survival_scale_b1.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.benchmark import machine_description
from specdec_ext.policies import make_policy
from specdec_ext.prompts import load_prompts
from specdec_ext.zoo import load_pair

sys.path.insert(0, str(Path(__file__).resolve().parent))
from budget_paired import save_result  # noqa: E402  (the JSON writer)


def scaled_auto(head, scale: float):
    """SpecDec++ ``threshold="auto"`` whose per-row rule reads ``scale`` times the survivals (after each configure,
    which makes the rule anew)."""
    policy = make_policy("specdec++", head=head, threshold="auto")
    configure = policy.configure

    def configure_scaled(*args, **kwargs):
        configure(*args, **kwargs)
        stop = policy.rule.stop
        policy.rule.stop = lambda k, survival: stop(k, survival * scale)

    policy.configure = configure_scaled
    return policy


def survival_recorder(policy, sums: list):
    """Wrap ``policy.should_stop`` so that ``sums`` gets, per round, [S_1, S_2, ...] of the single row (a round whose
    row may emit only one more token still runs its first draft step, and records it)."""
    should_stop = policy.should_stop

    def recorded(info):
        stop = should_stop(info)
        if info.step == 1:
            sums.append([])
        sums[-1].append(float(policy.cum_accept[0]))
        return stop

    policy.should_stop = recorded


def compare(pair, head, prompts: list, scales, max_new_tokens: int, costs=None) -> dict:
    """Every arm (``K3``, ``h0.8``, ``auto``, ``auto*s`` for s in ``scales``) on every prompt, one request at a time
    (greedy), the arms' order rotating prompt by prompt; ``costs``: the pair's ``CostModel`` (None: profiled). Returns
    tokens/s per arm (total tokens over total seconds), each arm over ``auto`` (total, and the median per prompt), the
    head's calibration in the ``auto`` arm, and per arm and request the rounds' (candidates, emitted tokens)."""
    eos = pair.tokenizer.eos_token_id
    arms = {"K3": make_policy("fixed", k=3), "h0.8": make_policy("specdec++", head=head, threshold=0.8),
            "auto": make_policy("specdec++", head=head, threshold="auto")}
    for s in scales:
        arms[f"auto*{float(s):g}"] = scaled_auto(head, float(s))
    gens = {a: SpeculativeGenerator(pair.target, pair.draft, policy=p, costs=costs) for a, p in arms.items()}
    names = list(arms)

    def generate(arm, prompt, n):
        return gens[arm].generate_continuous([prompt], 1, max_new_tokens=n, temperature=0, eos_token_id=eos)

    for a in names:  # warm-up: the cost profile, the runners' packed weights
        generate(a, prompts[0], min(8, max_new_tokens))
    sums: list = []
    survival_recorder(arms["auto"], sums)
    accepted = drafted_rounds = 0
    predicted = 0.0
    runs = {a: [] for a in names}
    rounds = {a: [] for a in names}
    for i, p in enumerate(prompts):
        order = names[i % len(names):] + names[: i % len(names)]
        if (i // len(names)) % 2:
            order = order[::-1]
        for a in order:
            t = time.perf_counter()
            out = generate(a, p, max_new_tokens)
            runs[a].append((len(out.new_tokens[0]), time.perf_counter() - t))
            rounds[a].append([(r.candidates[0], r.emitted[0]) for r in out.stats.rounds])
            if a == "auto":  # every round scored its first step, also one with no room for a candidate (0 drafted)
                assert len(sums) == len(out.stats.rounds), (len(sums), len(out.stats.rounds))
                for r, survivals in zip(out.stats.rounds, sums):
                    if r.candidates[0] > 0:  # the survivals of the candidates verified
                        accepted += r.accepted[0]
                        predicted += sum(survivals[: r.candidates[0]])
                        drafted_rounds += 1
                sums.clear()
    rate = {a: sum(n for n, _ in v) / sum(s for _, s in v) for a, v in runs.items()}
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "head_calibration": {"accepted": accepted, "predicted": predicted, "rounds": drafted_rounds,
                                 "a": accepted / predicted if predicted else None},
            "tokens_per_s": rate, "over_auto": {a: rate[a] / rate["auto"] for a in names},
            "median_per_prompt_over_auto": {
                a: statistics.median((x[0] / x[1]) / (y[0] / y[1]) for x, y in zip(runs[a], runs["auto"]))
                for a in names},
            "rounds": rounds}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--scales", default="1.13,1.3", help="comma-separated survival scales s (arms auto*s)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    pair = load_pair()
    prompts = [torch.tensor(pair.tokenizer(t)["input_ids"]) for t in load_prompts("humaneval")[: args.prompts]]
    t0 = time.perf_counter()
    row = compare(pair, pair.heads["greedy"], prompts, [float(s) for s in args.scales.split(",")],
                  args.max_new_tokens)
    row.pop("rounds")
    result = {"machine": machine_description(pair), "seconds": time.perf_counter() - t0,
              "command": "python bench/survival_scale_b1.py " + " ".join(argv if argv is not None else []), **row}
    print(report(result))
    save_result(args.out, result)
    return result


def report(result: dict) -> str:
    """The lines printed for a result of :func:`main`: the head's calibration, then each arm against ``auto``."""
    cal = result["head_calibration"]
    lines = [f"head calibration in the auto arm: {cal['accepted']} accepted over {cal['predicted']:.1f} predicted "
             f"(a = {cal['a']:.3f}, {cal['rounds']} drafting rounds)"]
    lines += [f"{a:10s} {rate:7.1f} tokens/s, {result['over_auto'][a]:.3f}x auto "
              f"(median per prompt {result['median_per_prompt_over_auto'][a]:.3f}x)"
              for a, rate in result["tokens_per_s"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
