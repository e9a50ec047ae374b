"""Where a decoding round's time goes: per arm and drafted depth, the median ms of the round and of its segments
(drafting, the target's verification, the roll-back), on the bundled pair in continuous batching.

Arms are named as in ``bench/budget_paired.py`` (``plain``, ``K<n>``, ``auto[:option=value...]``). Each arm has a
generator of its own, warmed up once at the batch size, then runs every prompt once (greedy, ``--max-new-tokens``
each), the arms one after another. A round's depth is its deepest row's candidates; a plain step (the target
alone: ``plain``, or a budget's step without drafting) is reported apart. ``--synced`` synchronises the device
before and after each segment, so that each segment holds its own device time. Without it, a GPU segment holds the
host's time to launch its work plus whatever it waits for, and the wait lands in the segment that reads a result
back (the verification's). ``--profile`` runs the prompts once more per arm under ``torch.profiler`` and reports
the device's busy time (the kernels' summed time) against the host's, and the top ops (on a CPU only the host).
An ``auto`` arm also reports what its batch budget holds after the run (:func:`budget_state`): what it believes a
round of each depth costs, beside what the rounds measured.

    python bench/round_segments.py --device cuda --batch-size 4 --arms K1,K2,auto --profile --out seg.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.benchmark import machine_description
from specdec_ext.engine.profile import _sync  # the cost profiler's device synchronisation
from specdec_ext.prompts import load_prompts
from specdec_ext.zoo import load_pair

sys.path.insert(0, str(Path(__file__).resolve().parent))
from budget_paired import parse_arm, save_result  # noqa: E402

SEGMENTS = {"_draft": "draft_ms", "_verify": "verify_ms", "_roll_back": "roll_back_ms"}


def timed_call(gen: SpeculativeGenerator, call, synced: bool, device) -> tuple:
    """Run ``call()`` with ``gen``'s round segments timed; returns (its result, the rounds' records, the plain
    steps' ms). A record: {"depth", "round_ms" (the engine's own), and each segment's ms}."""
    current: dict = {}
    plain: list = []
    rounds: list = []
    saved = {}

    def wrap(name, fn):
        def run(*args, **kwargs):
            if synced:
                _sync(device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if synced:
                _sync(device)
            ms = (time.perf_counter() - t0) * 1e3
            if name == "_plain_step":
                plain.append(ms)
            elif name == "_speculative_round":
                stats = args[-1]
                last = stats.rounds[-1]
                rounds.append({"depth": max(last.candidates, default=0), "round_ms": last.total_ms, **current})
                current.clear()
            else:
                current[SEGMENTS[name]] = current.get(SEGMENTS[name], 0.0) + ms
            return out
        return run

    for name in (*SEGMENTS, "_plain_step", "_speculative_round"):
        saved[name] = getattr(gen, name)
        setattr(gen, name, wrap(name, saved[name]))
    try:
        return call(), rounds, plain
    finally:
        for name in saved:
            delattr(gen, name)  # back to the class's method


def summarise(rounds: list, plain: list) -> dict:
    """Per depth: rounds and the median of each timed quantity; the plain steps' count and median ms."""
    by_depth = defaultdict(list)
    for r in rounds:
        by_depth[r["depth"]].append(r)
    depths = {}
    for d, rs in sorted(by_depth.items()):
        keys = ["round_ms", *(k for k in SEGMENTS.values() if any(k in r for r in rs))]
        depths[d] = {"rounds": len(rs), **{k: round(statistics.median(r.get(k, 0.0) for r in rs), 3) for k in keys}}
    return {"depths": depths, "plain_steps": len(plain),
            "plain_step_ms": round(statistics.median(plain), 3) if plain else None}


def budget_state(policy, batch_size: int) -> Optional[dict]:
    """What a batch budget (``auto`` arms) holds after its run, at ``batch_size``: per depth k = 0 .. depth_max the
    profiled table's round ms, the measured calibration(k) (how much dearer than the table, relative to a plain step,
    such a round measured) and the log(measured / table) ratios behind it (None: never measured), and the head's
    calibration a. None for arms without one."""
    budget = getattr(policy, "budget", None)
    if budget is None:
        return None
    depths = range(budget.depth_max + 1)
    return {"table_ms": [round(budget.batch.round(batch_size, k), 3) for k in depths],
            "calibration": [round(budget.calibration(k), 4) for k in depths],
            "log_ratio": [None if r is None else round(r, 4) for r in budget.log_ratio],
            "head_scale": round(budget.head_scale, 4)}


def device_busy(call, device) -> dict:
    """``call()`` under torch.profiler: the host's self time summed over its ops and (on CUDA) the device's summed
    over its kernels and copies, in ms (the totals of the profiler's table), and the ten kernels with the most
    device time (the ten ops with the most host time on a CPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        out = call()
        _sync(device)
    events = prof.key_averages()
    host = sum(e.self_cpu_time_total for e in events) / 1e3
    # the device's time is its own events' (kernels, copies), as the profiler's table totals it: an op's host
    # event also carries its kernels' device time, which would count it twice
    kernels = [e for e in events if e.device_type != DeviceType.CPU and not e.is_user_annotation]
    dev = sum(e.self_device_time_total for e in kernels) / 1e3 if cuda else None
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    top = sorted(kernels if cuda else events, key=lambda e: getattr(e, key, 0.0), reverse=True)[:10]
    return {"rounds": len(out.stats.rounds), "host_ms": round(host, 1), "device_ms": None if dev is None else round(dev, 1),
            "device_share_of_host": None if dev is None else round(dev / host, 4),
            "top_ops": [{"name": e.key, "ms": round(getattr(e, key, 0.0) / 1e3, 2), "calls": e.count} for e in top]}


def measure(pair, prompts: list, batch_size: int, arms: list, max_new_tokens: int, synced: bool = False,
            profile: bool = False, device="cpu") -> dict:
    """One entry per arm: tokens/s of the timed run, its depths' segment medians, and with ``profile`` the
    profiled run's busy times."""
    eos = pair.tokenizer.eos_token_id
    out = {}
    for arm in arms:
        gen = SpeculativeGenerator(pair.target, pair.draft, policy=parse_arm(arm, pair.heads["greedy"]))

        def call(requests=prompts):
            return gen.generate_continuous(requests, batch_size, max_new_tokens=max_new_tokens, temperature=0,
                                           eos_token_id=eos)

        call(prompts[: 2 * batch_size])  # warm-up: a budget measures its depths before it is timed
        t0 = time.perf_counter()
        result, rounds, plain = timed_call(gen, call, synced, device)
        wall = time.perf_counter() - t0
        entry = {"tokens_per_s": round(result.stats.new_tokens / wall, 1), **summarise(rounds, plain)}
        state = budget_state(gen.policy, batch_size)
        if state is not None:
            entry["budget"] = state
        if profile:
            entry["profile"] = device_busy(call, device)
        out[arm] = entry
        print(arm, json.dumps(entry if not profile else {k: v for k, v in entry.items() if k != "profile"}), flush=True)
        if profile:
            p = entry["profile"]
            print(f"  profiled: {p['rounds']} rounds, host {p['host_ms']} ms, device {p['device_ms']} ms", flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (the pair in bf16 on a GPU)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--arms", default="K1,K2,auto")
    ap.add_argument("--prompts", type=int, default=64, help="HumanEval prompts (requests)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--synced", action="store_true", help="synchronise the device around each segment")
    ap.add_argument("--profile", action="store_true", help="a profiled run per arm: device and host busy times")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.batch_size < 1 or args.prompts < 1:
        ap.error("--batch-size and --prompts must be >= 1")
    arms = [a for a in args.arms.split(",") if a]
    pair = load_pair(device=args.device)
    for arm in arms:
        try:
            parse_arm(arm, pair.heads["greedy"])
        except ValueError as e:
            ap.error(str(e))
    prompts = [torch.tensor(pair.tokenizer(t)["input_ids"]) for t in load_prompts("humaneval", args.prompts)]
    result = {"machine": machine_description(pair), "device": args.device, "batch_size": args.batch_size,
              "synced": args.synced, "max_new_tokens": args.max_new_tokens, "prompts": args.prompts,
              "command": "python bench/round_segments.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "arms": measure(pair, prompts, args.batch_size, arms, args.max_new_tokens, args.synced, args.profile,
                              args.device)}
    save_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
