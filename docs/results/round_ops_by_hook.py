"""Per round, how many aten ops each part of the engine's round runs (profiled on the CPU): a proxy for the host's
kernel launches on a GPU, where the bundled pair's forwards are bound by them.

Arms as in ``bench/budget_paired.py``. Each arm warms up on ``2 B`` requests, then runs ``4 B`` HumanEval requests
(greedy, 48 new tokens) under ``torch.profiler``; every leaf aten op (one that calls no other aten op) is counted
under the innermost two of the engine's round segments and the policy's hooks that enclose it
(``record_function`` labels), or ``other``; the counts are divided by the rounds (plain steps included).

    python docs/results/round_ops_by_hook.py --batch-size 4 --arms K2,auto --out docs/results/round_ops_b4.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from specdec_ext import SpeculativeGenerator
from specdec_ext.benchmark import machine_description
from specdec_ext.prompts import load_prompts
from specdec_ext.zoo import load_pair

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from budget_paired import parse_arm, save_result  # noqa: E402

POLICY_HOOKS = ("draft_round", "begin_round", "should_stop", "verify_depth", "end_round", "rows_together",
                "draft_reads", "draft_overhead")
SEGMENTS = ("_draft", "_verify", "_roll_back", "_plain_step", "_commit")


def labelled(obj, name: str, label: str) -> None:
    """Run ``obj.name`` inside ``record_function(label)`` from now on."""
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)

    setattr(obj, name, run)


def count(pair, prompts: list, batch_size: int, arm: str) -> dict:
    gen = SpeculativeGenerator(pair.target, pair.draft, policy=parse_arm(arm, pair.heads["greedy"]))
    eos = pair.tokenizer.eos_token_id

    def call(requests):
        return gen.generate_continuous(requests, batch_size, max_new_tokens=48, temperature=0, eos_token_id=eos)

    call(prompts[: 2 * batch_size])
    for name in POLICY_HOOKS:
        if hasattr(gen.policy, name):
            labelled(gen.policy, name, "policy." + name)
    for name in SEGMENTS:
        labelled(gen, name, "engine." + name)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = call(prompts[2 * batch_size: 6 * batch_size])
    events = prof.events()
    parents = {e.cpu_parent.id for e in events if e.cpu_parent is not None and e.name.startswith("aten::")}
    by = collections.Counter()
    for e in events:
        if not e.name.startswith("aten::") or e.id in parents:
            continue
        labels, p = [], e.cpu_parent
        while p is not None:
            if p.name.startswith(("policy.", "engine.")):
                labels.append(p.name)
            p = p.cpu_parent
        by["/".join(reversed(labels[:2])) if labels else "other"] += 1
    rounds = len(result.stats.rounds)
    drafting = sum(1 for r in result.stats.rounds if max(r.candidates, default=0) > 0)
    return {"rounds": rounds, "drafting_rounds": drafting, "draft_calls": result.stats.draft_calls,
            "ops_per_round": round(sum(by.values()) / rounds, 1),
            "by_part": {k: round(v / rounds, 1) for k, v in by.most_common()}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--arms", default="K2,auto")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    pair = load_pair(device="cpu")
    prompts = [torch.tensor(pair.tokenizer(t)["input_ids"]) for t in load_prompts("humaneval", 6 * args.batch_size)]
    command = "python docs/results/round_ops_by_hook.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"machine": machine_description(pair), "batch_size": args.batch_size, "command": command, "arms": {}}
    for arm in args.arms.split(","):
        result["arms"][arm] = count(pair, prompts, args.batch_size, arm)
        print(arm, json.dumps(result["arms"][arm]), flush=True)
    save_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
