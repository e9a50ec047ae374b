"""The host's work per round of the captured path, outside the graphs' replays, on any device.

On a GPU a round of small models is bound by what the host does between the graphs: each graph launch, each eager
op outside them (a kernel launch and a dispatcher call each, about 5-10 us), the Python of the scheduler, the
policy and the round. This probe runs the bundled pair through the rounds that replay graphs (recorded steps off
CUDA, ``cuda_graphs="emulate"``; captured ones on CUDA) and reports per round: the graphs replayed, the eager ops
dispatched outside them (counted by a ``TorchDispatchMode`` in a second, untimed pass), and the host's time
outside the replays (the time inside the scheduler's rounds minus the time inside ``StepGraphs.replay`` and
``replay_chain``; prefills and the draft's reads of a context (``Scheduler._catch_up``) are left out). Off CUDA a
replay runs the step eagerly (a chain's flags read by the host), so only what lies outside it is the host's share
that a GPU would also pay; on CUDA a replay is timed with the GPU's work it launched (synchronised inside the
replay), so the rest of the round is the host's alone.

    python bench/host_round.py --prompts 4 --max-new-tokens 64 --out host_round.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))

from specdec_ext import SpeculativeGenerator  # noqa: E402
from specdec_ext.benchmark import machine_description  # noqa: E402
from specdec_ext.engine import graphs as graphs_mod  # noqa: E402
from specdec_ext.engine.round import BUCKETS, StepRunner  # noqa: E402
from specdec_ext.engine.scheduler import Scheduler  # noqa: E402
from specdec_ext.prompts import load_prompts  # noqa: E402
from specdec_ext.zoo import load_pair  # noqa: E402

ARMS = {"plain": dict(policy="autoregressive"), "fixed K=3": dict(policy="fixed", k=3),
        "specdec++ auto": dict(policy="specdecpp", threshold="auto"),
        "specdec++ auto, tiers 1/3/7": dict(policy="specdecpp", threshold="auto", k_max=8, early_exit=(1, 3, 7)),
        "specdec++ auto, on device": dict(policy="specdecpp", threshold="auto", k_max=8, early_exit="device"),
        "specdec++ auto, to the cap": dict(policy="specdecpp", threshold="auto", k_max=8, early_exit=False),
        # rounds one at a time (overlap=False; the arms above overlap where they can): the host's work of each form
        "fixed K=3, one at a time": dict(policy="fixed", k=3, overlap=False),
        "specdec++ auto, on device, one at a time": dict(policy="specdecpp", threshold="auto", k_max=8,
                                                         early_exit="device", overlap=False)}


class _Inside:
    """The scheduler's rounds timed (their launch, a launch ahead, their read), and inside them StepGraphs.replay
    and Scheduler._catch_up (the draft's reads of a
    context, a prefill) left out: ``seconds`` inside those, ``round_seconds`` inside rounds, ``calls`` replays;
    ``counting`` while a round runs outside them. A context manager: the wrapped methods are restored on exit."""

    def __init__(self, sync: bool):
        self.calls, self.seconds, self.round_seconds, self.left_out, self.in_round = 0, 0.0, 0.0, False, False
        probe = self

        def round_(fn):
            def wrapped(*args, **kwargs):
                probe.in_round = True
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    probe.round_seconds += time.perf_counter() - t0
                    probe.in_round = False
            return wrapped

        def left_out(fn, replays: bool):
            def wrapped(*args, **kwargs):
                probe.calls += replays
                probe.left_out = True
                t0 = time.perf_counter()
                try:
                    out = fn(*args, **kwargs)
                    if sync:  # the GPU's work waited for here, so the round's later reads wait for nothing
                        torch.cuda.synchronize()
                    return out
                finally:
                    probe.seconds += time.perf_counter() - t0
                    probe.left_out = False
            return wrapped

        steps = graphs_mod.StepGraphs
        replays = [name for name in ("replay", "replay_chain") if hasattr(steps, name)]  # (older code: no chains)
        # a round: planned and launched from the host's state, or launched ahead (overlapped), then read and
        # appended (older code: one method, _round)
        parts = [name for name in ("_launch", "_launch_ahead", "_finish") if hasattr(Scheduler, name)] or ["_round"]
        self._saved = [(steps, name) for name in replays] + [(Scheduler, "_catch_up")] + \
            [(Scheduler, name) for name in parts]
        self._saved = [(owner, name, getattr(owner, name)) for owner, name in self._saved]
        self._wrapped = [left_out(getattr(steps, name), True) for name in replays] + \
            [left_out(Scheduler._catch_up, False)] + [round_(getattr(Scheduler, name)) for name in parts]

    def __enter__(self):
        for (owner, name, _), fn in zip(self._saved, self._wrapped):
            setattr(owner, name, fn)
        return self

    def __exit__(self, *exc):
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)

    @property
    def counting(self) -> bool:
        return self.in_round and not self.left_out

    def reset(self):
        self.calls, self.seconds, self.round_seconds = 0, 0.0, 0.0


class _Ops(TorchDispatchMode):
    """Counts the aten ops dispatched inside a round but outside its replays, by name."""

    def __init__(self, inside: _Inside):
        super().__init__()
        self.inside, self.ops = inside, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside.counting:
            name = str(func.overloadpacket.__name__)
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes over the prompts per arm (the best kept)")
    ap.add_argument("--arms", help="'|'-separated: only the arms whose names contain one of these")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    pair = load_pair(device=args.device)
    cuda = torch.device(args.device).type == "cuda"
    texts = load_prompts("humaneval")[: args.prompts]
    prompts = [torch.tensor([pair.tokenizer(t)["input_ids"]], device=args.device) for t in texts]
    with _Inside(cuda) as inside:
        arms = {n: kw for n, kw in ARMS.items() if not args.arms or any(a in n for a in args.arms.split("|"))}
        rows = {}
        for name, kw in arms.items():
            kw = dict(kw)
            policy = kw.pop("policy")
            gen = SpeculativeGenerator(pair.target, pair.draft if policy != "autoregressive" else None, policy=policy,
                                       head=pair.head if policy == "specdecpp" else None, cuda_graphs=cuda or None,
                                       **kw)
            if not cuda:
                gen.steps = StepRunner(BUCKETS, cuda_graphs="emulate")

            def run():
                rounds = 0
                for ids in prompts:
                    rounds += len(gen.generate(ids, max_new_tokens=args.max_new_tokens, temperature=0).stats.rounds)
                if cuda:
                    torch.cuda.synchronize()
                return rounds

            run()  # capture, cost profiles, caches
            best = None
            for _ in range(args.repeats):
                inside.reset()
                t0 = time.perf_counter()
                rounds = run()
                wall = time.perf_counter() - t0
                host = (inside.round_seconds - inside.seconds) / rounds
                if best is None or host < best[0]:
                    best = (host, inside.calls / rounds, wall / rounds, rounds)
            counter = _Ops(inside)
            with counter:
                rounds = run()
            ops = sum(counter.ops.values()) / rounds
            top = sorted(counter.ops.items(), key=lambda kv: -kv[1])[:10]
            rows[name] = {"rounds": best[3], "host_us_per_round": 1e6 * best[0], "replays_per_round": best[1],
                          "wall_ms_per_round": 1e3 * best[2], "eager_ops_per_round": ops,
                          "top_ops_per_round": {k: v / rounds for k, v in top}}
            r = rows[name]
            print(f"{name}: host {r['host_us_per_round']:.0f} us/round outside replays, {r['replays_per_round']:.2f} "
                  f"replays, {ops:.1f} eager ops/round ({', '.join(f'{k} {v / rounds:.1f}' for k, v in top[:6])})",
                  flush=True)
    result = {"machine": machine_description(pair), "command": "python bench/host_round.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
