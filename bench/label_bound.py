"""How much any acceptance head could gain over the best fixed K: the offline replay of the auto rule with
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

    python bench/label_bound.py --out docs/results/label_bound.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from specdec_ext import SpeculativeGenerator
from specdec_ext.benchmark import machine_description
from specdec_ext.prompts import load_prompts
from specdec_ext.training.head_data import HeadDataConfig, generate_head_data
from specdec_ext.training.head_features import draft_features
from specdec_ext.training.pipeline import EVAL_MODES, replay_report
from specdec_ext.training.replay import flat_costs
from specdec_ext.zoo import load_pair


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=None, help="first N HumanEval prompts (default: all 164)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("docs/results/label_bound.json"))
    args = ap.parse_args()
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
            "command": "python bench/label_bound.py" + (f" --prompts {args.prompts}" if args.prompts else "")
            + (f" --max-new-tokens {args.max_new_tokens}" if args.max_new_tokens != 64 else "")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
