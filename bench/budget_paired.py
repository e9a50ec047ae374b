"""The batch verification budget against fixed K at one batch size, side by side in one process.

Arms: ``plain`` (decoding without a draft), ``K<n>`` (fixed candidate length n) and ``auto`` (SpecDec++ with
``threshold="auto"``: the budget), an ``auto`` arm optionally with budget options after colons
(``auto:cost_fit=line:headroom=0.0``, passed as ``SpecDecPP(budget_options=...)``); any arm may end in ``@eager``,
``@ahead`` or ``@grouped``, the ``admission`` of its calls (``generate_continuous``; default ahead); and any arm may end in
``#label``, a replicate: the arm before the ``#`` run again with a generator and policy of its own (``K2,K2#b``), an
A/A control. A replicate is never the best fixed K; it is reported over its original (pooled, in decoding, and per
stream), which measures what the run's ratios mean: the arms are alike, so any difference is noise. Picking the best
of several near-tied fixed K after the fact also favours the one whose noise ran high, so a method that ties them
reads below 1.00x the best fixed K. Each arm keeps its own generator and policy for the whole run and is warmed up
once at the batch size, so that a budget has measured its depths before it is timed, as a server's would after its
first requests. Then ``--passes`` passes over the prompts (greedy, continuous batching), each split into streams of
``rows_per_stream * B`` requests, the arms' order changing from stream to stream, over the passes one sequence of a
Williams design (``benchmark.balanced_order``: each arm runs equally often in each position and directly after each
other arm). Reports each arm's tokens/s per pass and pooled over the passes (tokens over seconds), and each arm's
pooled tokens/s over the best fixed K's (and its range over the streams, the noise of one stream's comparison); the
same in decoding alone (tokens over the time of the decoding rounds, the prompts' prefills left out: at B = 64 they
are most of the wall time and move by seconds from call to call, which hides the differences in decoding), the
candidates drafted per row and round, and the seconds the draft spent reading the requests' contexts. At B = 64 on a
2-core CPU a pass moves by up to 10%: read ratios within one run, and several passes. Each arm that is not a fixed K
gets a bootstrap 95% interval of its pooled ratio over the best fixed K (streams resampled whole, the best re-picked
in each resample), and each replicate one of its ratio over its original: an A/A interval that excludes 1.00x says
the streams' noise is not the whole of the run's noise (drift that lasts longer than a stream).

``--context-tokens N`` makes long-context requests: request i is the last N tokens of HumanEval prompts ..., i + 2,
i + 1, i joined (so it ends with prompt i's signature and docstring), for workloads where reading a request's context
is dear against the tokens it emits (the budget's ``count_overhead``). ``--draft-context N``: every arm's draft
reads only the last N tokens of each request's context (``SpeculativeGenerator(draft_context=N)``).

    python bench/budget_paired.py --batch-size 16 --arms K1,K2,K3,auto,auto:cost_fit=line --passes 2 \\
        --out docs/results/budget_paired_b16.json   # about 5 minutes
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.benchmark import add_stream_arguments, alternate_streams, machine_description
from specdec_ext.engine.admission import ADMISSION_MODES, DEFAULT_ADMISSION
from specdec_ext.policies import make_policy
from specdec_ext.prompts import load_prompts
from specdec_ext.zoo import load_pair


def arm_base(name: str) -> str:
    """An arm name without its replicate label (``K2#b`` -> ``K2``); ValueError for an empty label or arm."""
    base, sep, label = name.partition("#")
    if sep and not (base and label):
        raise ValueError(f"--arms: {name!r}: a replicate is an arm, then # and a label (K2#b)")
    return base


def arm_admission(name: str) -> str:
    """The admission of an arm name (``K2@grouped`` -> ``grouped``; none given: ``DEFAULT_ADMISSION``, ``ahead``);
    ValueError for another."""
    _, sep, admission = arm_base(name).partition("@")
    if sep and admission not in ADMISSION_MODES:
        raise ValueError(f"--arms: {name!r}: the admission after @ must be one of {', '.join(ADMISSION_MODES)}")
    return admission if sep else DEFAULT_ADMISSION


def parse_arm(name: str, head) -> object:
    """The policy of an arm name (``plain``, ``K3``, ``auto``, ``auto:cost_fit=line``, any of them with an
    ``@admission`` or ``#label``); ValueError naming a bad one."""
    arm_admission(name)
    name = arm_base(name).partition("@")[0]
    if name == "plain":
        return make_policy("autoregressive")
    if name[:1] == "K" and name[1:].isdigit():
        return make_policy("fixed", k=int(name[1:]))
    kind, *options = name.split(":")
    if kind != "auto":
        raise ValueError(f"--arms: {name!r} is neither K<n> nor auto[:option=value...]")
    budget = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise ValueError(f"--arms: {option!r} in {name!r} is not option=value")
        try:
            budget[key] = json.loads(value)
        except json.JSONDecodeError:
            budget[key] = value  # a bare word: a string option (cost_fit=line)
    return make_policy("specdec++", head=head, threshold="auto", budget_options=budget)


def save_result(path, result: dict) -> None:
    """Write ``result`` to ``path`` as indented JSON, its folder made first; nothing when ``path`` is None."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")


def long_contexts(encoded: list, n: int, tokens: int) -> list:
    """``n`` requests of ``tokens`` tokens (ValueError for fewer than 2): request i is the last ``tokens`` tokens of
    ``... + encoded[i + 1] + encoded[i]`` (indices cyclic), joined until that long."""
    if tokens < 2:
        raise ValueError(f"--context-tokens must be at least 2, got {tokens}")
    out = []
    for i in range(n):
        parts, total, j = [], 0, i
        while total < tokens:
            parts.insert(0, encoded[j % len(encoded)])
            total += len(parts[0])
            j += 1
        out.append(torch.cat(parts)[-tokens:])
    return out


def stream_interval(tokens: list, seconds: list, arm: str, over: list, reps: int = 2000, seed: int = 0) -> tuple:
    """A bootstrap 95% interval of ``arm``'s pooled tokens/s over the best of ``over`` (each resample picks the
    best again, so the interval carries the choice of the best after the fact), resampling streams whole (an arm's
    stream is run beside the other arms' in the same minutes, so a stream keeps its arms together).
    ``tokens``, ``seconds``: per stream, ``{arm: value}``."""
    rng = random.Random(seed)
    n = len(tokens)
    values = []
    for _ in range(reps):
        pick = [rng.randrange(n) for _ in range(n)]

        def rate(a):
            return sum(tokens[i][a] for i in pick) / sum(seconds[i][a] for i in pick)

        values.append(rate(arm) / max(rate(b) for b in over))
    values.sort()
    return values[int(0.025 * reps)], values[int(0.975 * reps) - 1]


def compare(pair, prompts: list, batch_size: int, arms: list, passes: int, max_new_tokens: int,
            rows_per_stream: int, draft_context=None) -> dict:
    """tokens/s of each arm per pass and pooled, and the pooled ratio of each arm to the best fixed K;
    ``draft_context``: every arm's draft reads at most that many tokens of a request's context (None: all)."""
    if len(set(arms)) != len(arms):
        raise ValueError(f"--arms: {arms!r} names an arm twice; run it again as a replicate (K2,K2#b)")
    lone = [a for a in arms if arm_base(a) != a and arm_base(a) not in arms]
    if lone:
        raise ValueError(f"--arms: the replicates {lone} need their original arms among the arms")
    eos = pair.tokenizer.eos_token_id
    gens = {a: SpeculativeGenerator(pair.target, pair.draft, policy=parse_arm(a, pair.heads["greedy"]),
                                    draft_context=draft_context) for a in arms}
    # what alternate_streams counts per arm, summed over the passes
    total = {key: dict.fromkeys(arms, 0) for key in ("tokens", "seconds", "decode_seconds", "drafted", "verifications",
                                                     "draft_prefill_seconds", "prefill_seconds", "admissions")}
    per_pass, by_stream, stream_tokens, stream_seconds = [], [], [], []

    def generate(arm, stream, n):
        return gens[arm].generate_continuous(stream, batch_size, max_new_tokens=n, temperature=0, eos_token_id=eos,
                                             admission=arm_admission(arm))

    for p in range(passes):  # the passes continue one balanced sequence of orders (benchmark.balanced_order)
        r = alternate_streams(generate, tuple(arms), prompts, batch_size, rows_per_stream, max_new_tokens,
                              first_stream=len(by_stream))
        per_pass.append(r["tokens_per_s"])
        by_stream += r["by_stream"]
        stream_tokens += r["by_stream_tokens"]
        stream_seconds += r["by_stream_seconds"]
        for key, sums in total.items():
            for a in arms:
                sums[a] += r[key][a]
    tokens = total["tokens"]
    pooled = {a: tokens[a] / total["seconds"][a] for a in arms}
    decoding = {a: tokens[a] / total["decode_seconds"][a] for a in arms}
    fixed = [a for a in arms if a.startswith("K") and "#" not in a]
    best = max(fixed, key=pooled.get) if fixed else None
    replicates = {a: {"of": o, "pooled": pooled[a] / pooled[o], "decoding": decoding[a] / decoding[o],
                      "by_stream": [st[a] / st[o] for st in by_stream],
                      "ci95": stream_interval(stream_tokens, stream_seconds, a, [o])}
                  for a, o in ((a, arm_base(a)) for a in arms) if o != a}
    return {"batch_size": batch_size, "passes": passes, "tokens_per_s": pooled, "tokens_per_s_by_pass": per_pass,
            "best_fixed": best, "over_best_fixed": {a: pooled[a] / pooled[best] for a in arms} if best else None,
            "over_best_fixed_by_stream": {a: [st[a] / st[best] for st in by_stream] for a in arms} if best else None,
            "over_best_fixed_ci95": {a: stream_interval(stream_tokens, stream_seconds, a, fixed)
                                     for a in arms if a not in fixed} if best else None,
            "decode_tokens_per_s": decoding,
            "candidates_per_row_round": {a: total["drafted"][a] / max(total["verifications"][a], 1) for a in arms},
            "draft_prefill_seconds": total["draft_prefill_seconds"], "prefill_seconds": total["prefill_seconds"],
            "admissions": total["admissions"], "replicates": replicates,
            "decode_over_best_fixed": {a: decoding[a] / max(decoding[f] for f in fixed) for a in arms} if fixed else None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--arms", default="K1,K2,K3,auto,auto:cost_fit=line", help="comma-separated arms (see above)")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (the pair in bf16 on a GPU)")
    ap.add_argument("--context-tokens", type=int, default=None, help="long-context requests of N tokens (see above)")
    ap.add_argument("--draft-context", type=int, default=None,
                    help="the draft reads at most the last N tokens of a request's context (default: all)")
    add_stream_arguments(ap, argparse.SUPPRESS)  # its --k is not used: --arms
    args = ap.parse_args(argv)
    pair = load_pair(device=args.device)
    texts = load_prompts("humaneval")
    long = args.context_tokens is not None  # long contexts join prompts beyond the first args.prompts
    prompts = [torch.tensor(pair.tokenizer(t)["input_ids"]) for t in (texts if long else texts[:args.prompts])]
    if long:
        prompts = long_contexts(prompts, args.prompts, args.context_tokens)
    t0 = time.perf_counter()
    row = compare(pair, prompts, args.batch_size, args.arms.split(","), args.passes, args.max_new_tokens,
                  args.rows_per_stream, args.draft_context)
    result = {"machine": machine_description(pair), "seconds": time.perf_counter() - t0,
              "command": "python bench/budget_paired.py " + " ".join(argv if argv is not None else []), **row}
    for a, rate in row["tokens_per_s"].items():
        by_pass = " / ".join(f"{r[a]:.1f}" for r in row["tokens_per_s_by_pass"])
        streams = row["over_best_fixed_by_stream"][a] if row["best_fixed"] else []
        ci = (row["over_best_fixed_ci95"] or {}).get(a)
        ratio = (f", {row['over_best_fixed'][a]:.3f}x {row['best_fixed']} (streams {min(streams):.3f}-"
                 f"{max(streams):.3f}x" + (f"; 95% interval over the best fixed K {ci[0]:.3f}-{ci[1]:.3f}x" if ci else "")
                 + ")" if streams else "")
        decoding = f"; decoding {row['decode_tokens_per_s'][a]:.1f} tokens/s" + (
            f", {row['decode_over_best_fixed'][a]:.3f}x the best fixed K" if row["best_fixed"] else "")
        print(f"B = {args.batch_size}, {a}: {rate:.1f} tokens/s (passes {by_pass}){ratio}{decoding}; "
              f"{row['candidates_per_row_round'][a]:.2f} candidates per row and round, draft reads "
              f"{row['draft_prefill_seconds'][a]:.1f} s, prefills {row['prefill_seconds'][a]:.2f} s in "
              f"{row['admissions'][a]} admissions")
    for a, rep in row["replicates"].items():
        print(f"B = {args.batch_size}, {a} over {rep['of']} (an A/A control): {rep['pooled']:.3f}x (95% interval "
              f"{rep['ci95'][0]:.3f}-{rep['ci95'][1]:.3f}x), decoding {rep['decoding']:.3f}x (streams "
              f"{min(rep['by_stream']):.3f}-{max(rep['by_stream']):.3f}x)")
    save_result(args.out, result)
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
