"""Training and evaluation of the acceptance head on precomputed draft features
(``training/head_features.py``).

Loss (SpecDec++ Sec. 4): binary cross-entropy with labels y (soft, min(1, p/q), when sampling; 0/1 when
greedy) and weight w on the rejection side,

    L = - sum_i [ y_i log s_i + w (1 - y_i) log(1 - s_i) ] / sum_i [ y_i + w (1 - y_i) ],   s_i = sigmoid(z_i),

i.e. a weighted mean, normalised by the total class weight so its scale does not depend on the
acceptance rate (this normalisation is this project's reading of the paper's weighted loss).
Optimiser: AdamW, linear warm-up then cosine decay. The split is by example (prompt), seeded.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from ..head.features import check_feature_names
from ..head.module import AcceptanceHead
from .head_features import select_features


@dataclass
class HeadTrainConfig:
    num_layers: int = 3
    features: tuple = ()           # confidence / history features the head reads (head.features.FEATURES)
    use_hidden: bool = True
    input_position: str = "proposal"
    rejection_weight: float = 1.0  # w (paper: 6)
    lr: float = 1e-3
    weight_decay: float = 0.01
    epochs: int = 30
    batch_size: int = 1024
    warmup_frac: float = 0.05
    held_out_frac: float = 0.1
    seed: int = 0

    def __post_init__(self):
        if self.rejection_weight <= 0:
            raise ValueError(f"rejection_weight w must be > 0, got {self.rejection_weight}")
        if not 0.0 < self.held_out_frac < 1.0:
            raise ValueError(f"held_out_frac must lie in (0, 1), got {self.held_out_frac}")
        self.features = check_feature_names(self.features)


def weighted_bce(logits: torch.Tensor, labels: torch.Tensor, w: float) -> torch.Tensor:
    """The head's loss (module docstring) for logits and soft labels ``[M]``."""
    logp = torch.nn.functional.logsigmoid(logits)
    log1mp = torch.nn.functional.logsigmoid(-logits)
    num = -(labels * logp + w * (1 - labels) * log1mp).sum()
    return num / (labels + w * (1 - labels)).sum().clamp_min(1e-12)


def split_by_example(example: torch.Tensor, frac: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean masks (train, held_out) over positions; whole examples go to one side."""
    ids = torch.unique(example)
    g = torch.Generator().manual_seed(seed)
    perm = ids[torch.randperm(ids.numel(), generator=g)]
    n_held = max(1, int(round(frac * ids.numel()))) if ids.numel() > 1 else 0
    held = torch.isin(example, perm[:n_held])
    return ~held, held


# ------------------------------------------------------------------------------------ metrics
def roc_auc(scores: torch.Tensor, outcomes: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties). NaN if one class is absent."""
    scores = scores.double()
    pos = outcomes.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    _, inverse, counts = torch.unique_consecutive(scores[order], return_inverse=True, return_counts=True)
    avg_rank = (torch.cumsum(counts, 0) - (counts - 1) / 2.0).double()  # average rank of each run of ties
    ranks = torch.empty_like(scores)
    ranks[order] = avg_rank[inverse]
    u = ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def binary_kl(labels: torch.Tensor, probs: torch.Tensor) -> float:
    """Mean KL(Bernoulli(y) || Bernoulli(p_hat)) in nats."""
    y = labels.double().clamp(0, 1)
    p = probs.double().clamp(1e-7, 1 - 1e-7)
    kl = torch.where(y > 0, y * torch.log(y.clamp_min(1e-300) / p), torch.zeros_like(y)) + torch.where(
        y < 1, (1 - y) * torch.log((1 - y).clamp_min(1e-300) / (1 - p)), torch.zeros_like(y))
    return float(kl.mean())


def evaluate(probs: torch.Tensor, labels: torch.Tensor, outcomes: torch.Tensor) -> dict:
    """Binary KL to the labels, ROC AUC against sampled outcomes, Brier score against outcomes,
    and the same three for a constant predictor (the labels' mean) as a baseline."""
    const = torch.full_like(probs, float(labels.mean()))
    out = {}
    for name, p in (("head", probs), ("constant", const)):
        out[name] = scores(p, labels, outcomes)
    out["positions"] = int(labels.numel())
    out["mean_label"] = float(labels.mean())
    return out


def scores(p: torch.Tensor, labels: torch.Tensor, outcomes: torch.Tensor) -> dict:
    """ROC AUC (ranking, against outcomes), Brier score (against outcomes) and binary KL (to the labels) of p."""
    return {"roc_auc": roc_auc(p, outcomes), "brier": float(((p.double() - outcomes.double()) ** 2).mean()),
            "binary_kl": binary_kl(labels, p.clamp(0, 1))}


def evaluate_against_baselines(head: AcceptanceHead, feats: dict) -> dict:
    """The head beside the draft's own confidence on the same positions: q(y) and the top-1 minus top-2
    margin of q, used directly as acceptance probabilities (their ROC AUC is what they rank; their Brier
    score what they would say as probabilities), and a constant (the labels' mean)."""
    labels, outcomes = feats["labels"].float(), feats["accept"]
    with torch.no_grad():
        p = head.predict(feats["hidden"] if head.use_hidden else None,
                         select_features(feats["features"], head.features) if head.features else None)
    out = {"positions": int(labels.numel()), "mean_label": float(labels.mean()), "head": scores(p, labels, outcomes)}
    for name in ("token_prob", "margin"):
        out[f"q_{name}" if name == "margin" else "q_y"] = scores(select_features(feats["features"], [name])[:, 0],
                                                               labels, outcomes)
    out["constant"] = scores(torch.full_like(p, float(labels.mean())), labels, outcomes)
    return out


def calibration_plot(probs: torch.Tensor, labels: torch.Tensor, outcomes: torch.Tensor, path: str | Path,
                     bins: int = 10, title: str = "acceptance head calibration") -> None:
    """Reliability diagram: mean soft label and observed acceptance frequency per bin of predicted p."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = torch.linspace(0, 1, bins + 1)
    idx = torch.bucketize(probs.clamp(0, 1 - 1e-9), edges[1:-1])
    xs, ys, fs, ns = [], [], [], []
    for b in range(bins):
        m = idx == b
        if int(m.sum()) == 0:
            continue
        xs.append(float(probs[m].mean()))
        ys.append(float(labels[m].mean()))
        fs.append(float(outcomes[m].float().mean()))
        ns.append(int(m.sum()))
    fig, ax = plt.subplots(figsize=(4.5, 4.5), dpi=120)
    ax.plot([0, 1], [0, 1], "--", color="gray", lw=1, label="perfect calibration")
    ax.plot(xs, ys, "o-", label="mean soft label min(1, p/q)")
    ax.plot(xs, fs, "s:", label="sampled acceptance frequency")
    for x, y, n in zip(xs, ys, ns):
        ax.annotate(str(n), (x, y), textcoords="offset points", xytext=(3, -10), fontsize=6)
    ax.set_xlabel("predicted acceptance probability")
    ax.set_ylabel("observed")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ------------------------------------------------------------------------------------ training
def train_head(feats: dict[str, torch.Tensor], cfg: Optional[HeadTrainConfig] = None,
               head: Optional[AcceptanceHead] = None, progress: bool = True, train_mask: Optional[torch.Tensor] = None,
               **head_kwargs) -> tuple[AcceptanceHead, dict]:
    """Train a head on ``draft_features(...)`` output. Positions of examples in the held-out split
    (``split_by_example``; or outside ``train_mask`` when given) are kept for evaluation. Returns the head
    and a report with the held-out metrics (:func:`evaluate`), the loss history and the settings."""
    cfg = cfg or HeadTrainConfig()
    hidden, labels = feats["hidden"], feats["labels"].float()
    if hidden.shape[0] == 0:
        raise ValueError("no counted positions in the training data")
    X = select_features(feats["features"], cfg.features) if cfg.features else None
    H = hidden.shape[1]
    torch.manual_seed(cfg.seed)
    if head is None:
        head = AcceptanceHead(H, cfg.num_layers, features=cfg.features, use_hidden=cfg.use_hidden,
                              input_position=cfg.input_position, training=asdict(cfg), **head_kwargs)
    head.check_draft(H)
    if train_mask is None:
        tr, ho = split_by_example(feats["example"], cfg.held_out_frac, cfg.seed)
    else:
        tr, ho = train_mask, ~train_mask
    if X is not None:
        head.set_feature_normalization(X[tr].mean(0), X[tr].std(0))
    head.mean_accept = float(labels[tr].mean())
    h_in = hidden if cfg.use_hidden else None
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    tr_idx = tr.nonzero().squeeze(-1)
    steps_per_epoch = max(1, math.ceil(tr_idx.numel() / cfg.batch_size))
    total = steps_per_epoch * cfg.epochs
    warm = max(1, int(cfg.warmup_frac * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm))))
    g = torch.Generator().manual_seed(cfg.seed)

    def batch(idx):
        return (h_in[idx] if h_in is not None else None), (X[idx] if X is not None else None)

    history = []
    head.train()
    bar = tqdm(range(cfg.epochs), desc="head training", disable=not progress, unit="epoch")
    for epoch in bar:
        perm = tr_idx[torch.randperm(tr_idx.numel(), generator=g)]
        tot = 0.0
        for s in range(steps_per_epoch):
            idx = perm[s * cfg.batch_size : (s + 1) * cfg.batch_size]
            loss = weighted_bce(head(*batch(idx)), labels[idx], cfg.rejection_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += loss.item() * idx.numel()
        with torch.no_grad():
            held_loss = weighted_bce(head(*batch(ho)), labels[ho], cfg.rejection_weight).item() if ho.any() else float("nan")
        history.append({"epoch": epoch + 1, "train_loss": tot / tr_idx.numel(), "held_out_loss": held_loss})
        bar.set_postfix(train=f"{tot / tr_idx.numel():.4f}", held_out=f"{held_loss:.4f}")
    head.eval()
    with torch.no_grad():
        p_ho = head.predict(*batch(ho)) if ho.any() else torch.zeros(0)
    report = {"held_out": evaluate(p_ho, labels[ho], feats["accept"][ho]) if ho.any() else {}, "history": history,
              "train_positions": int(tr.sum()), "held_out_positions": int(ho.sum()), "config": asdict(cfg)}
    return head, report
