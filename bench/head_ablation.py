"""Acceptance-head ablation and the in-domain experiment, from the data sets `specdec zoo train` (or
`specdec train-head --work-dir`) leaves in the work directory.

For each head variant (the paper's inputs vs this project's: hidden state at the proposal position,
draft-confidence features, acceptance history) trained on the stdlib training split with the same
data and settings, on the stdlib validation prompts (where variants are chosen) and on HumanEval
positions (never trained on or chosen by):
ROC AUC and Brier score, and the offline replay of the auto rule against the best fixed K under
two cost models (flat GPU-like c = 0.1, and this machine's profile of the bundled pair).

In-domain: a head trained on the even-numbered HumanEval prompts, scored on the odd ones, beside the
stdlib-trained head on the same odd prompts (what a user with prompts like their own traffic gains);
the head and the odd prompts are saved for an end-to-end run:
`specdec bench --dataset bench/results/in_domain_head/humaneval-odd.jsonl --head bench/results/in_domain_head`.

    python bench/head_ablation.py --work-dir .zoo_work/heads --out docs/results/head_ablation.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdec_ext.head.features import CONFIDENCE_FEATURES
from specdec_ext.training.head_data import HeadDataset
from specdec_ext.training.head_features import draft_features
from specdec_ext.training.head_train import HeadTrainConfig, evaluate_against_baselines, split_by_example, train_head
from specdec_ext.training.pipeline import replay_report
from specdec_ext.training.replay import flat_costs
from specdec_ext import AcceptanceHead
from specdec_ext.zoo import PAIR_DIR, load_pair

VARIANTS = {
    "hidden (proposal position)": dict(features=(), use_hidden=True),
    "features only (q(y), margin, entropy)": dict(features=CONFIDENCE_FEATURES, use_hidden=False),
    "hidden + features (shipped)": dict(features=CONFIDENCE_FEATURES, use_hidden=True),
    "hidden + features + acceptance history": dict(features=CONFIDENCE_FEATURES + ("recent_accept",), use_hidden=True),
}


def replay_vs_fixed(head, feats, costs) -> dict:
    """The auto rule against the best fixed K in the offline replay (the keys of ``replay_report`` this file keeps)."""
    r = replay_report(head, feats, costs)
    return {k: r[k] for k in ("best_fixed_k", "auto_vs_best_fixed", "auto_aggregate_vs_best_fixed")}


def subset(feats: dict, mask: torch.Tensor) -> dict:
    return {k: v[mask] for k, v in feats.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-dir", type=Path, default=Path(".zoo_work/heads"))
    ap.add_argument("--out", type=Path, default=Path("docs/results/head_ablation.json"))
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--rejection-weight", type=float, default=None, help="default: the shipped greedy head's w")
    ap.add_argument("--in-domain-head", type=Path, default=Path("bench/results/in_domain_head"),
                    help="where the head trained on the even HumanEval prompts is saved (for `specdec bench --head`)")
    args = ap.parse_args()
    t0 = time.time()
    pair = load_pair(target_dtype=torch.float32, with_head=False)
    greedy = AcceptanceHead.from_pretrained(str(PAIR_DIR / "heads" / "greedy"))
    from specdec_ext import SpeculativeGenerator

    machine = SpeculativeGenerator(load_pair(with_head=False).target, pair.draft).costs()  # the bundled pair as benchmarked
    costs = {"flat c=0.1": flat_costs(0.1), "this machine": machine}
    train = HeadDataset.load(args.work_dir / "head_data_greedy.safetensors")
    test = HeadDataset.load(args.work_dir / "eval_greedy.safetensors")
    w = args.rejection_weight or greedy.training_config.get("chosen_rejection_weight", 1.0)
    f_train = draft_features(pair.draft, train, "proposal")
    f_test = draft_features(pair.draft, test, "proposal")
    tr, va = split_by_example(f_train["example"], 0.1, 0)  # the pipeline's training / validation split
    f_val = subset(f_train, va)
    result = {"rejection_weight": w, "train_positions": int(tr.sum()), "test_positions": int(f_test["labels"].numel()),
              "costs": {k: c.meta for k, c in costs.items()}, "variants": {}}
    for name, kw in VARIANTS.items():
        cfg = HeadTrainConfig(epochs=args.epochs, rejection_weight=w, **kw)
        head, _ = train_head(f_train, cfg, train_mask=tr)
        ev = evaluate_against_baselines(head, f_test)
        row = {"roc_auc": ev["head"]["roc_auc"], "brier": ev["head"]["brier"],
               "replay": {c: replay_vs_fixed(head, f_test, cm) for c, cm in costs.items()},
               "validation": {"roc_auc": evaluate_against_baselines(head, f_val)["head"]["roc_auc"],
                              "replay": {c: replay_vs_fixed(head, f_val, cm) for c, cm in costs.items()}}}
        result["variants"][name] = row
        result["baselines"] = {k: ev[k] for k in ("q_y", "q_margin", "constant")}
        print(name, json.dumps(row), flush=True)
    # in-domain: even HumanEval prompts train, odd ones test
    even = f_test["example"] % 2 == 0
    cfg = HeadTrainConfig(epochs=args.epochs, rejection_weight=w, features=CONFIDENCE_FEATURES)
    in_dom, _ = train_head(f_test, cfg, train_mask=even, draft_model=greedy.draft_model,
                           target_model=greedy.target_model, draft_fingerprint=greedy.draft_fingerprint,
                           decoding="greedy")
    in_dom.training_config.update({"note": "in-domain experiment: trained on the even-numbered HumanEval prompts"})
    in_dom.save_pretrained(args.in_domain_head)
    odd_path = args.in_domain_head / "humaneval-odd.jsonl"
    from specdec_ext.prompts import load_prompt_records

    with odd_path.open("w") as f:
        for i, (rid, text) in enumerate(load_prompt_records("humaneval")):
            if i % 2 == 1:
                f.write(json.dumps({"id": rid, "prompt": text}) + "\n")
    std, _ = train_head(f_train, cfg, train_mask=tr)
    odd = subset(f_test, ~even)
    result["in_domain"] = {}
    for name, head in (("trained on HumanEval even prompts (in-domain)", in_dom), ("trained on stdlib", std)):
        ev = evaluate_against_baselines(head, odd)
        result["in_domain"][name] = {"roc_auc": ev["head"]["roc_auc"], "brier": ev["head"]["brier"],
                                     "replay": {c: replay_vs_fixed(head, odd, cm) for c, cm in costs.items()}}
        print(name, json.dumps(result["in_domain"][name]), flush=True)
    result["seconds"] = round(time.time() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
