"""One call from a model pair and prompts to a trained, evaluated, saved acceptance head
(what ``specdec train-head`` runs)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

from .data import HeadDataConfig, HeadDataset, draft_features, generate_head_data
from .train import HeadTrainConfig, calibration_plot, split_by_example, train_head


def run_pipeline(target, draft, tokenizer, prompts: Sequence[str], out_dir: str | Path,
                 data_cfg: Optional[HeadDataConfig] = None, train_cfg: Optional[HeadTrainConfig] = None,
                 data_file: Optional[str | Path] = None, target_name: Optional[str] = None,
                 draft_name: Optional[str] = None, progress: bool = True, log=print) -> dict:
    """Generate (or load) the data set, compute draft features, train, evaluate, save.

    Writes to ``out_dir``: ``config.json`` + ``model.safetensors`` (the head), ``metrics.json``,
    ``calibration.png``, and the data set ``head_data.safetensors`` unless ``data_file`` was given.
    Returns the metrics report.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data_cfg, train_cfg = data_cfg or HeadDataConfig(), train_cfg or HeadTrainConfig()
    t0 = time.time()
    if data_file is not None and Path(data_file).exists():
        data = HeadDataset.load(data_file)
        log(f"[train-head] loaded {len(data)} examples from {data_file}")
    else:
        data = generate_head_data(target, draft, tokenizer, prompts, data_cfg, progress=progress)
        path = Path(data_file) if data_file is not None else out / "head_data.safetensors"
        data.save(path)
        log(f"[train-head] generated {len(data)} examples -> {path}")
    t_data = time.time() - t0
    feats = draft_features(draft, data, progress=progress)
    head, report = train_head(feats, train_cfg, progress=progress,
                              draft_model=draft_name or data.meta.get("draft_model"),
                              target_model=target_name or data.meta.get("target_model"))
    head.training_config.update({"data": data.meta.get("config", asdict(data_cfg))})
    head.save_pretrained(out)
    ho = report["held_out"]
    _, held = split_by_example(feats["example"], train_cfg.held_out_frac, train_cfg.seed)
    calibration_plot(head.predict(feats["hidden"][held]), feats["labels"][held], feats["accept"][held],
                     out / "calibration.png", title=f"acceptance head, held-out ({int(held.sum())} positions)")
    report["data_seconds"] = round(t_data, 1)
    report["total_seconds"] = round(time.time() - t0, 1)
    report["data_meta"] = data.meta
    (out / "metrics.json").write_text(json.dumps(report, indent=2))
    log(f"[train-head] held-out positions {ho['positions']}: ROC AUC {ho['head']['roc_auc']:.3f} "
        f"(constant {ho['constant']['roc_auc']:.3f}), binary KL {ho['head']['binary_kl']:.4f} "
        f"(constant {ho['constant']['binary_kl']:.4f}), Brier {ho['head']['brier']:.4f} "
        f"(constant {ho['constant']['brier']:.4f})")
    return report
