"""The engine's greedy argmax, end to end: the bundled pair (bf16) in continuous batching with ``ops.argmax_tokens``
at its greedy draft steps and plain steps, against the same engine with ``torch.argmax`` there (patched in for that
arm; ``chain_verify_greedy``'s own argmax is the vectorised one in both), side by side in one process.

Each (method, argmax) arm has its own generator, warmed up once; then ``--passes`` passes, each running every arm
over the same ``--prompts`` HumanEval requests (greedy, 48 new tokens) in a balanced order. Reported: each arm's
tokens/s over all passes, the ratio of the op's arm to torch's per method (the tokens are checked equal), and the
share of the wall time spent in the engine's argmax calls (timed in both arms), which the tokens/s's noise hides.

    python docs/results/argmax_end_to_end.py --batch-size 4 --methods plain,K2,auto --out docs/results/x.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from specdec_ext import SpeculativeGenerator, ops
from specdec_ext.benchmark import balanced_order, machine_description
from specdec_ext.engine import generator as engine_generator
from specdec_ext.prompts import load_prompts
from specdec_ext.zoo import load_pair

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from budget_paired import parse_arm, save_result  # noqa: E402


class _TimedArgmax:
    """``ops`` as the engine sees it, its argmax_tokens timed into ``spent`` (seconds), and with ``torch_argmax``
    replaced by torch.argmax."""

    def __init__(self, torch_argmax: bool):
        self.torch_argmax, self.spent = torch_argmax, 0.0

    def __getattr__(self, name):
        if name != "argmax_tokens":
            return getattr(ops, name)

        def argmax(logits):
            t0 = time.perf_counter()
            out = torch.argmax(logits, -1) if self.torch_argmax else ops.argmax_tokens(logits)
            self.spent += time.perf_counter() - t0
            return out
        return argmax


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--methods", default="plain,K2,auto")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    pair = load_pair(device="cpu")
    prompts = [torch.tensor(pair.tokenizer(t)["input_ids"]) for t in load_prompts("humaneval", args.prompts)]
    eos = pair.tokenizer.eos_token_id
    arms = {f"{m}@{a}": (m, a) for m in args.methods.split(",") for a in ("op", "torch")}
    gens = {name: SpeculativeGenerator(pair.target, pair.draft, policy=parse_arm(m, pair.heads["greedy"]))
            for name, (m, _) in arms.items()}

    spent = {name: 0.0 for name in arms}

    def run(name, requests, timed=True):
        engine_generator.ops = patched = _TimedArgmax(arms[name][1] == "torch")
        try:
            return gens[name].generate_continuous(requests, args.batch_size, max_new_tokens=48, temperature=0,
                                                  eos_token_id=eos)
        finally:
            engine_generator.ops = ops
            if timed:
                spent[name] += patched.spent

    for name in arms:
        run(name, prompts[: 2 * args.batch_size], timed=False)
    tokens = {name: 0 for name in arms}
    seconds = {name: 0.0 for name in arms}
    texts = {}
    for p in range(args.passes):
        for name in balanced_order(list(arms), p):
            t0 = time.perf_counter()
            out = run(name, prompts)
            seconds[name] += time.perf_counter() - t0
            tokens[name] += out.stats.new_tokens
            texts.setdefault(arms[name][0], {})[arms[name][1]] = out.new_tokens
    for m, by in texts.items():
        if by["op"] != by["torch"]:
            raise AssertionError(f"{m}: the two argmaxes gave different tokens")
    tps = {name: tokens[name] / seconds[name] for name in arms}
    command = "python docs/results/argmax_end_to_end.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"machine": machine_description(pair), "batch_size": args.batch_size, "passes": args.passes,
              "prompts": args.prompts, "command": command,
              "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
              "op_over_torch": {m: round(tps[f"{m}@op"] / tps[f"{m}@torch"], 3) for m in texts},
              "argmax_share_of_wall": {k: round(spent[k] / seconds[k], 4) for k in arms},
              "argmax_ms_per_1k_tokens": {k: round(spent[k] * 1e6 / tokens[k], 2) for k in arms}}
    print(json.dumps({k: result[k] for k in ("batch_size", "tokens_per_s", "op_over_torch", "argmax_share_of_wall")}),
          flush=True)
    save_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
