"""Two installs of specdec_ext side by side: this tree's and another (an earlier commit installed in its own
environment, e.g. from a git worktree), each in a worker process of its own interpreter, the two alternating request
by request (one request at a time, ``--batch-sizes 1``) or stream by stream (continuous batching), so that drift on the
machine falls on both alike. Only the public API is called (``load_pair``, ``SpeculativeGenerator.generate`` and
``generate_continuous``), greedy, the pair of ``--pair`` (default: the bundled one) in the dtype of ``--dtype`` (default:
each model's default); each worker warms its generators up before the clock.

Methods: ``plain`` (plain decoding), ``K<n>`` (fixed K), ``auto`` (SpecDec++ ``threshold="auto"``: the per-row rule at
one request, the verification budget in batches). One request at a time: per method, each install's total tokens/s,
and this install over the other per prompt (median of the per-prompt ratios, bootstrap 95% interval) and in total;
batches: each install's aggregate tokens/s per method and batch size, pooled over ``--passes`` passes, and the ratio.
Every request's tokens are compared between the installs (bf16 near-ties may round either way).

    git worktree add ../base 96f021d && python -m venv ../base/.venv && ../base/.venv/bin/pip install torch==2.13.0 \\
        && ../base/.venv/bin/pip install --no-build-isolation -e ../base
    python bench/installs.py --other ../base/.venv/bin/python --batch-sizes 1 --methods plain,K3,auto \\
        --prompts 164 --max-new-tokens 64 --out docs/results/installs_b1_xeon.json
    python bench/installs.py --other ../base/.venv/bin/python --batch-sizes 4,16 --methods plain,K2,auto \\
        --prompts 128 --max-new-tokens 48 --passes 2 --out docs/results/installs_batch_xeon.json
    python bench/installs.py --other ../base/.venv/bin/python --pair smollm2-135m --dtype float32 --methods plain,K3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


# ------------------------------------------------------------------------------------- the worker (either install)
def _generator(pair, method: str):
    from specdec_ext import SpeculativeGenerator

    if method == "plain":
        return SpeculativeGenerator(pair.target, policy="autoregressive")
    if method == "auto":
        return SpeculativeGenerator(pair.target, pair.draft, policy="specdecpp", head=pair.head, threshold="auto",
                                    k_max=20)
    return SpeculativeGenerator(pair.target, pair.draft, policy="fixed", k=int(method[1:]))


DTYPES = ("auto", "float32", "bfloat16")


def _load(name: str, dtype: str):
    import torch
    from specdec_ext.zoo import load_pair

    dt = None if dtype == "auto" else getattr(torch, dtype)
    return load_pair(name, target_dtype=dt, draft_dtype=dt)


def worker(name: str, dtype: str) -> None:
    """Serve requests from stdin, one JSON line each: ``{"method", "prompts", "batch_size", "max_new_tokens"}``;
    answer ``{"tokens": [...per prompt], "seconds"}`` on stdout (the call's wall time)."""
    import specdec_ext
    import torch

    pair = _load(name, dtype)
    eos = pair.tokenizer.eos_token_id
    gens: dict = {}
    print(json.dumps({"ready": specdec_ext.__file__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        key = req["method"]
        if key not in gens:
            gens[key] = _generator(pair, key)
        gen = gens[key]
        if req.get("prepare"):
            gen.prepare(req["batch_size"])
            print(json.dumps({"prepared": True}), flush=True)
            continue
        prompts = [torch.tensor(p) for p in req["prompts"]]
        t0 = time.perf_counter()
        if req["batch_size"] == 1:
            out = gen.generate(prompts[0].view(1, -1), max_new_tokens=req["max_new_tokens"], temperature=0,
                               eos_token_id=eos)
            tokens = out.new_tokens
        else:
            out = gen.generate_continuous(prompts, req["batch_size"], max_new_tokens=req["max_new_tokens"],
                                          temperature=0, eos_token_id=eos)
            tokens = out.new_tokens
        print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - t0}), flush=True)


# ------------------------------------------------------------------------------------- the driver
class Install:
    """A worker process of one install's interpreter."""

    def __init__(self, name: str, python: str, pair: str, dtype: str):
        self.name = name
        self.proc = subprocess.Popen([python, __file__, "--worker", pair, dtype], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.where = None

    def ready(self) -> "Install":
        """Waits for the worker's first line (it has loaded the pair); the workers start together."""
        self.where = self._read()["ready"]
        return self

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the {self.name} worker ended")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()  # the worker reads end-of-file and returns, also before it is ready
        self.proc.wait(timeout=60)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", required=True, help="the other install's Python interpreter")
    ap.add_argument("--batch-sizes", default="1", help="comma-separated; 1: one request at a time")
    ap.add_argument("--methods", default="plain,K3,auto")
    ap.add_argument("--prompts", type=int, default=164, help="the first N HumanEval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--passes", type=int, default=1, help="batches: passes over the prompts")
    ap.add_argument("--pair", default="bundled", help="a name load_pair takes")
    ap.add_argument("--dtype", default="auto", choices=DTYPES, help="both models' dtype (auto: their defaults)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from paired import paired
    from specdec_ext.prompts import load_prompts

    installs = {n: Install(n, python, args.pair, args.dtype) for n, python in (("this", sys.executable),
                                                                                ("other", args.other))}
    order = [["this", "other"], ["other", "this"]]
    rows = []
    try:
        pair = _load(args.pair, args.dtype)  # its tokenizer, and the machine's description
        prompts = [pair.tokenizer(t)["input_ids"] for t in load_prompts("humaneval")[: args.prompts]]
        methods = args.methods.split(",")
        installs = {n: inst.ready() for n, inst in installs.items()}
        t0 = time.perf_counter()
        for B in (int(b) for b in args.batch_sizes.split(",")):
            for m in methods:
                for inst in installs.values():
                    inst.ask(method=m, prepare=True, batch_size=B)
                    inst.ask(method=m, prompts=prompts[:max(B, 2)], batch_size=B, max_new_tokens=8)  # warm-up
            streams = [[p] for p in prompts] if B == 1 else [prompts] * args.passes
            got = {(m, n): [] for m in methods for n in installs}
            for i, stream in enumerate(streams):
                for j, m in enumerate(methods[i % len(methods):] + methods[: i % len(methods)]):
                    for n in order[(i + j) % 2]:
                        r = installs[n].ask(method=m, prompts=stream, batch_size=B, max_new_tokens=args.max_new_tokens)
                        got[m, n].append((sum(len(t) for t in r["tokens"]), r["seconds"], r["tokens"]))
                if B == 1 and (i + 1) % 20 == 0:
                    print(f"[installs] B = 1: {i + 1}/{len(streams)} prompts", file=sys.stderr, flush=True)
            for m in methods:
                a, b = got[m, "this"], got[m, "other"]
                rate = {n: sum(x[0] for x in got[m, n]) / sum(x[1] for x in got[m, n]) for n in installs}
                same = [s == t for x, y in zip(a, b) for s, t in zip(x[2], y[2])]  # per request
                row = {"batch_size": B, "method": m, "tokens_per_s": rate, "total_ratio": rate["this"] / rate["other"],
                       "same_tokens": sum(same) / len(same)}
                if B == 1:
                    p = paired({i: x[:2] for i, x in enumerate(a)}, {i: y[:2] for i, y in enumerate(b)})
                    row.update(median_ratio=p["median_ratio"], ci95=list(p["ci95"]))
                else:
                    row["by_pass"] = [(x[0] / x[1]) / (y[0] / y[1]) for x, y in zip(a, b)]
                rows.append(row)
                extra = (f", paired median {row['median_ratio']:.3f}x [{row['ci95'][0]:.3f}, {row['ci95'][1]:.3f}]"
                         if B == 1 else "")
                print(f"B = {B}, {m}: this {rate['this']:.1f} against {rate['other']:.1f} tokens/s, "
                      f"{row['total_ratio']:.3f}x{extra}, same tokens {row['same_tokens']:.0%}", flush=True)
    finally:
        for inst in installs.values():
            inst.close()
    from specdec_ext.benchmark import machine_description

    result = {"machine": machine_description(pair), "seconds": time.perf_counter() - t0,
              "installs": {n: i.where for n, i in installs.items()},
              "command": "python bench/installs.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "rows": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:4])
    else:
        main(sys.argv[1:])
