"""One rank of the tensor-parallel tests (run by ``torchrun --nproc-per-node 2`` from test_tensor_parallel.py).

argv: MODELS_DIR OUT_DIR [TRAIN_HEAD_ARGS...]. Loads ``MODELS_DIR/{target,draft,head}`` with ``load_models(tp=2)``,
generates with every case of ``CASES`` and writes ``OUT_DIR/rank{r}.json``: the new tokens of each case, whether
``check_same_output`` caught ranks that differ, and the cost table the auto rule used. Then, with its process group
ended, the rank runs ``specdec train-head TRAIN_HEAD_ARGS`` (the CLI's ``main``, as the ``specdec`` command calls
it), if given: with ``--data-only`` each rank makes its shard, by RANK of WORLD_SIZE. One ``torchrun`` serves both
tests (each launch starts two interpreters that import torch and transformers)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.engine.tensor_parallel import check_same_output, end_process_group, rank, tp_size
from specdec_ext.zoo import PAIR_DIR, load_models
from support import TEST_BATCH_COSTS

PROMPTS = torch.tensor([[5, 9, 11, 3, 7, 2], [1, 1, 4, 8, 6, 10]])
MASK = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
# name -> (policy keyword arguments, sampling keyword arguments)
CASES = {
    "greedy-fixed4": ({"policy": "fixed", "k": 4}, {"temperature": 0.0}),
    "greedy-specdecpp": ({"policy": "specdecpp", "threshold": 0.6}, {"temperature": 0.0}),
    "greedy-auto": ({"policy": "specdecpp", "threshold": "auto", "k_max": 6}, {"temperature": 0.0}),
    "sample-fixed3": ({"policy": "fixed", "k": 3}, {"temperature": 1.0, "seed": 7}),
    "sample-specdecpp": ({"policy": "specdecpp", "threshold": 0.5}, {"temperature": 0.8, "top_k": 20, "seed": 3}),
    "plain": ({"policy": "autoregressive"}, {"temperature": 0.0}),
}


def run_cases(pair, costs=None, batch_costs=None) -> dict:
    gen = SpeculativeGenerator(pair.target, pair.draft, policy="fixed", head=pair.head, costs=costs,
                               batch_costs=batch_costs)
    out = {}
    for name, (pol, sampling) in CASES.items():
        res = gen.generate(PROMPTS, attention_mask=MASK, max_new_tokens=24, eos_token_id=1, **pol, **sampling)
        out[name] = res.new_tokens
    out["costs"] = json.loads(gen.costs().to_json())["verify_ms"]
    return out


def main(models: Path, out_dir: Path, train_head: list[str]) -> None:
    pair = load_models(models / "target", models / "draft", models / "head", tokenizer=PAIR_DIR / "target", tp=2)
    result = run_cases(pair, batch_costs=TEST_BATCH_COSTS)  # the single-row cost table is profiled by the ranks
    result["tp_size"] = tp_size(pair.target)
    try:  # ranks that disagree are caught, not written
        check_same_output(torch.tensor([[rank()]]))
        result["divergence_caught"] = False
    except RuntimeError as e:
        result["divergence_caught"] = "ranks produced different outputs" in str(e)
    (out_dir / f"rank{rank()}.json").write_text(json.dumps(result))
    end_process_group()  # gloo's threads left to the interpreter's exit can abort a rank (SIGABRT)
    if train_head:
        from specdec_ext import cli

        code = cli.main(train_head)
        (out_dir / f"train_head_rank{rank()}.json").write_text(json.dumps({"exit": code}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
