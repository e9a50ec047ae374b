"""One call from a model pair and prompts to a trained, evaluated, saved acceptance head
(what ``specdec train-head`` runs).

Recipes (``RECIPES``):

* ``"deployment"`` (default): labels for the decoding the head will serve (greedy or sampled at the
  data set's temperature), contexts as speculative rounds meet them, the draft state at the proposal
  position plus the draft-confidence features q(y), margin and entropy; the rejection weight w is chosen
  on a validation split (whole prompts held out of training) by the end-to-end objective: the goodput
  of the ``threshold="auto"`` rule in an offline replay (``training/replay.py``) under a flat, GPU-like
  cost model (draft step = 0.1 target forwards; machine-independent, so training is reproducible).
* ``"paper"``: SpecDec++ Sec. 4 as published: target responses sampled at temperature 1, soft labels
  min(1, p/q), token mixing r = 0.15, the draft state at the candidate, w = 6.

Evaluation (``eval_prompts``, e.g. HumanEval, never used for training or selection): the head beside
the draft's own confidence (q(y) and the top-1 minus top-2 margin) on every response position, for
greedy decoding and for sampling at temperature 1: ROC AUC and Brier score, and the replayed speedup of
the auto rule against the best fixed K, with the head's p_hat and with the recorded labels in its place
(sampling: min(1, p/q), which knows the target's p; the bound of any head under that rule).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch

from ..engine.models import fingerprint, model_name
from ..head.features import CONFIDENCE_FEATURES
from ..head.module import AcceptanceHead
from .head_data import HeadDataConfig, HeadDataset, generate_head_data, shard_path
from .head_features import draft_features, select_features
from .head_train import HeadTrainConfig, calibration_plot, evaluate_against_baselines, split_by_example, train_head
from .replay import best_fixed, flat_costs, head_scorer, replay, soft_label_scorer

RECIPES = {
    "deployment": {"input_position": "proposal", "features": CONFIDENCE_FEATURES, "weights": (1.0, 2.0, 4.0)},
    "paper": {"input_position": "candidate", "features": (), "weights": (6.0,), "decoding": "sample",
              "temperature": 1.0},
}

EVAL_MODES = {"greedy": {"decoding": "greedy"}, "sample-T1": {"decoding": "sample", "temperature": 1.0}}


def replay_report(head: AcceptanceHead, feats: dict, costs) -> dict:
    """The offline replay of ``feats``'s recorded rounds under ``costs`` (:mod:`~specdec_ext.training.replay`),
    as ratios of median (and aggregate) speedups to the best fixed K's: the auto rule with the head's p_hat,
    the same rule fed the recorded labels (``label_bound_*``: the bound of any head), and the oracle that
    drafts exactly to the first rejection."""
    k, fixed = best_fixed(feats, costs)
    auto = replay(feats, head_scorer(head, feats), costs, "auto", mean_accept=head.mean_accept)
    oracle = replay(feats, None, costs, "oracle")
    bound = replay(feats, soft_label_scorer(feats), costs, "auto", mean_accept=float(feats["labels"].float().mean()))
    return {"cost_model": costs.meta, "best_fixed_k": k, "best_fixed_median_speedup": fixed.median_speedup,
            "auto_median_speedup": auto.median_speedup, "auto_vs_best_fixed": auto.median_speedup / fixed.median_speedup,
            "auto_aggregate_vs_best_fixed": auto.aggregate_speedup / fixed.aggregate_speedup,
            "auto_mean_candidates": auto.mean_candidates,
            # the bound of any head: the auto rule fed the recorded labels (sampling: soft labels min(1, p/q))
            "label_bound_vs_best_fixed": bound.median_speedup / fixed.median_speedup,
            "label_bound_aggregate_vs_best_fixed": bound.aggregate_speedup / fixed.aggregate_speedup,
            "oracle_vs_best_fixed": oracle.median_speedup / fixed.median_speedup}


def run_pipeline(target, draft, tokenizer, prompts: Sequence[str], out_dir: Union[str, Path],
                 recipe: str = "deployment", data_cfg: Optional[HeadDataConfig] = None,
                 train_cfg: Optional[HeadTrainConfig] = None, weights: Optional[Sequence[float]] = None,
                 eval_prompts: Optional[Sequence[str]] = None, eval_modes: Sequence[str] = tuple(EVAL_MODES),
                 work_dir: Optional[Union[str, Path]] = None, eval_max_new_tokens: int = 64,
                 target_name: Optional[str] = None, draft_name: Optional[str] = None, progress: bool = True,
                 log: Callable[[str], None] = print, shard: Optional[tuple[int, int]] = None,
                 data_only: bool = False) -> dict:
    """Generate (or resume) the data set, compute draft features, train (choosing w on a validation split
    when several ``weights`` are given), evaluate, save.

    Writes to ``out_dir``: ``config.json`` + ``model.safetensors`` (the head), ``metrics.json``,
    ``calibration.png``; data sets (resumable) go to ``work_dir`` (default ``out_dir``):
    ``head_data.safetensors`` and ``eval_<mode>.safetensors``. Returns the metrics report.

    ``data_only``: stop after the training data set (returns ``{"data": path, "responses": n}``);
    ``shard=(i, n)``: generate only shard i of n of it (:func:`~specdec_ext.training.head_data.generate_head_data`),
    e.g. one per ``torchrun`` rank; a later run without ``shard`` merges the complete shards and trains.
    """
    if shard is not None and not data_only:
        raise ValueError("shard=(i, n) generates a share of the data set: use it with data_only=True")
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}: expected one of {sorted(RECIPES)}")
    spec = RECIPES[recipe]
    out = Path(out_dir)
    work = Path(work_dir) if work_dir is not None else out
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    data_cfg = data_cfg or HeadDataConfig()
    # the mixing mask (take_target) is drawn in every data set; only the paper recipe reads it, so one
    # temperature-1 data set serves both the paper head and a sampling head
    data_cfg = replace(data_cfg, **{k: spec[k] for k in ("decoding", "temperature") if k in spec})
    train_cfg = train_cfg or HeadTrainConfig(features=spec["features"])
    train_cfg = replace(train_cfg, input_position=spec["input_position"])
    weights = tuple(weights) if weights is not None else spec["weights"]
    t0 = time.time()
    data_path = work / f"head_data_{data_cfg.decoding}.safetensors"
    data = generate_head_data(target, draft, tokenizer, prompts, data_cfg, progress=progress, path=data_path, log=log,
                              shard=shard)
    t_data = time.time() - t0
    if data_only:
        where = shard_path(data_path, *shard) if shard is not None else data_path
        log(f"[train-head] {len(data)} responses in {where} ({t_data:.0f} s); no training (data only)")
        return {"data": str(where), "responses": len(data), "seconds": t_data}
    log(f"[train-head] {len(data)} responses, {int((data.labels == data.labels).sum())} labelled positions "
        f"({data_cfg.decoding}) in {data_path}")
    feats = draft_features(draft, data, train_cfg.input_position, progress=progress)
    tr, va = split_by_example(feats["example"], train_cfg.held_out_frac, train_cfg.seed)
    costs = flat_costs(0.1)
    head_kwargs = dict(draft_model=draft_name or model_name(draft), target_model=target_name or model_name(target),
                       draft_fingerprint=fingerprint(draft), decoding=data_cfg.decoding,
                       temperature=data_cfg.temperature if data_cfg.decoding == "sample" else None)
    selection = []
    best = None
    val_feats = {k: v[va] for k, v in feats.items()}
    for w in weights:
        cfg = replace(train_cfg, rejection_weight=float(w))
        head, report = train_head(feats, cfg, progress=progress, train_mask=tr, **head_kwargs)
        row = {"rejection_weight": w, "held_out": report["held_out"]}
        if train_cfg.input_position == "proposal" and len(weights) > 1:
            row["validation_replay"] = replay_report(head, val_feats, costs)
            score = row["validation_replay"]["auto_aggregate_vs_best_fixed"]
            log(f"[train-head] w = {w:g}: validation replay, auto rule vs best fixed K: "
                f"{row['validation_replay']['auto_vs_best_fixed']:.3f}x (median), {score:.3f}x (aggregate); "
                f"held-out ROC AUC {report['held_out']['head']['roc_auc']:.3f}")
        else:
            score = 0.0
        selection.append(row)
        if best is None or score > best[0]:
            best = (score, w, head, report)
    _, w, head, report = best
    head.training_config.update({"data": asdict(data_cfg), "recipe": recipe, "rejection_weight_candidates": list(weights),
                                 "chosen_rejection_weight": w, "prompts": len(prompts)})
    head.save_pretrained(out)
    metrics = {"recipe": recipe, "chosen_rejection_weight": w, "selection": selection, "held_out": report["held_out"],
               "history": report["history"], "train_positions": report["train_positions"],
               "validation_positions": report["held_out_positions"], "data_seconds": round(t_data, 1),
               "data_meta": {k: v for k, v in data.meta.items()}}
    ho = report["held_out"]
    val_x = select_features(feats["features"][va], head.features) if head.features else None
    calibration_plot(head.predict(feats["hidden"][va] if head.use_hidden else None, val_x), feats["labels"][va],
                     feats["accept"][va], out / "calibration.png",
                     title=f"acceptance head ({recipe}, {data_cfg.decoding}), validation ({int(va.sum())} positions)")
    if eval_prompts:
        metrics["evaluation"] = evaluate_on_prompts(head, target, draft, tokenizer, eval_prompts, eval_modes, work,
                                                    data_cfg, eval_max_new_tokens, progress, log)
    metrics["total_seconds"] = round(time.time() - t0, 1)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    log(f"[train-head] validation ({ho['positions']} positions): ROC AUC {ho['head']['roc_auc']:.3f} "
        f"(constant {ho['constant']['roc_auc']:.3f}), Brier {ho['head']['brier']:.4f} "
        f"(constant {ho['constant']['brier']:.4f}); chosen w = {w:g}; head in {out}")
    return metrics


def evaluate_on_prompts(head: AcceptanceHead, target, draft, tokenizer, prompts: Sequence[str], modes: Sequence[str],
                        work: Path, base_cfg: HeadDataConfig, max_new_tokens: int = 64, progress: bool = True,
                        log: Callable[[str], None] = print) -> dict:
    """The head beside q(y) and the margin on ``prompts`` (e.g. HumanEval), for each decoding mode of
    ``EVAL_MODES``; prints a table and returns ``{mode: evaluate_against_baselines(...) + replay}``."""
    result = {}
    for mode in modes:
        cfg = replace(base_cfg, mix_ratio=0.0, max_new_tokens=max_new_tokens, **EVAL_MODES[mode])
        data = generate_head_data(target, draft, tokenizer, prompts, cfg, progress=progress,
                                  path=work / f"eval_{mode}.safetensors", log=log)
        position = head.input_position
        feats = draft_features(draft, data, position, progress=progress, contexts="target")
        r = evaluate_against_baselines(head, feats)
        if position == "proposal":
            r["replay"] = replay_report(head, feats, flat_costs(0.1))
        result[mode] = r
        line = "  ".join(f"{name} AUC {r[name]['roc_auc']:.3f} Brier {r[name]['brier']:.3f}"
                         for name in ("head", "q_y", "q_margin"))
        log(f"[train-head] evaluation, {mode} ({r['positions']} positions): {line}"
            + (f"; replay auto vs best fixed K {r['replay']['auto_vs_best_fixed']:.3f}x (with the recorded labels "
               f"as p_hat, the bound of any head: {r['replay']['label_bound_vs_best_fixed']:.3f}x)" if "replay" in r else ""))
    return result
