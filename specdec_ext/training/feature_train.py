"""Training a feature-level draft (EAGLE) for a given target (``specdec train-draft --kind eagle``).

The draft (:class:`~specdec_ext.engine.feature_draft.FeatureDraft`) reads, at position t, the token x_t and the
target's feature f_{t-1} (its final-norm output, what its LM head reads) and predicts f_t; the target's output rows
of the N ids it emits most often turn the prediction into a distribution over x_{t+1}. It starts from one of the
target's decoder layers (its first by default) with ``fc`` reading the embedding alone.

The data are the target's own continuations of prompts drawn from what ships on the machine, never the evaluation
prompts (:mod:`.draft_data`, the distilled draft's), and the target's features at every position of them, computed
once (the target as it is loaded, bfloat16 for speed) into ``work/features-NNNN.pt``.

The loss (Li et al. 2024, EAGLE, section 3.2: a feature regression beside the token loss), at every position:
forward KL from the target's distribution over the subset (softmax of its own output rows over f_t, so no teacher
file) to the draft's, plus :data:`FEATURE_WEIGHT` times the smooth L1 distance between the predicted and the true
f_t. Drafting k tokens ahead reads the draft's own predicted features, so each batch runs twice: once reading the
target's features, once reading the first pass's predictions (detached), both losses summed (a one-step form of
the training-time test of EAGLE-3, Li et al. 2025, section 3.2). Checkpoints into ``work/eagle-checkpoint.pt``;
a rerun resumes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..engine.feature_draft import FeatureDraft, shifted
from .draft_train import (_batches, _pad, fit, held_out_split, new_draft, optimizer, resumed,
                          sequences_and_vocabulary, stored, training_report)

FEATURE_WEIGHT = 0.5  # the smooth L1 feature term beside the KL term (nats per position)
SHARD = 512  # sequences per features file


def new_feature_draft(target, token_ids: torch.Tensor, layer: int = 0) -> FeatureDraft:
    """A :class:`FeatureDraft` for ``target``: the target's decoder layer ``layer`` and final norm, its token
    embedding and output rows of ``token_ids`` (frozen), and ``fc`` passing the embedding through (the feature's
    half zero). float32.

    Raises ValueError for a layer index outside the target's layers."""
    model = new_draft(target, token_ids, (layer,))
    H = model.config.hidden_size
    fc = torch.nn.Linear(2 * H, H, bias=True)
    with torch.no_grad():
        fc.weight.zero_()
        fc.weight[:, :H].copy_(torch.eye(H))
        fc.bias.zero_()
    return FeatureDraft(model, fc)


def trainable(draft: FeatureDraft) -> list[torch.nn.Parameter]:
    """What training changes and a shipped feature draft stores: ``fc``, the decoder layer and the final norm."""
    m = draft.model.model
    return list(draft.fc.parameters()) + list(m.layers.parameters()) + list(m.norm.parameters())


@torch.inference_mode()
def target_features(target, seqs, work: Path, batch_tokens: int = 4096, progress: Optional[Callable] = None) -> list:
    """The target's final-norm output at every position of every sequence: ``[n_i, H]`` bfloat16 per sequence, in
    files of :data:`SHARD` sequences under ``work`` (each written once; a rerun reads them)."""
    out: list = []
    bar = progress(total=sum(len(s[0]) for s in seqs), desc="target features", unit="tok") if progress else None
    for lo in range(0, len(seqs), SHARD):
        part = seqs[lo: lo + SHARD]
        path = Path(work) / f"features-{lo // SHARD:04d}.pt"
        if path.exists():
            feats = torch.load(path)
        else:
            feats = [None] * len(part)
            order = sorted(range(len(part)), key=lambda i: len(part[i][0]))
            batch: list = []
            for j, i in enumerate(order):
                batch.append(i)
                if j + 1 < len(order) and len(part[order[j + 1]][0]) * (len(batch) + 1) <= batch_tokens:
                    continue
                ids, mask = _pad(part, batch)
                h = target.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state
                for r, i2 in enumerate(batch):
                    feats[i2] = h[r, : len(part[i2][0])].to(torch.bfloat16).clone()
                batch = []
            tmp = path.with_suffix(".tmp")
            torch.save(feats, tmp)
            tmp.replace(path)
        out += feats
        if bar is not None:
            bar.update(sum(len(s[0]) for s in part))
    if bar is not None:
        bar.close()
    return out


def _pad_features(feats: list, batch: list, T: int) -> torch.Tensor:
    H = feats[batch[0]].shape[-1]
    x = torch.zeros(len(batch), T, H)
    for r, i in enumerate(batch):
        x[r, : feats[i].shape[0]] = feats[i].float()
    return x


def _losses(draft: FeatureDraft, ids, mask, f, noise: float = 0.0, gen: Optional[torch.Generator] = None):
    """Both passes' losses summed over valid positions, the positions counted, and per pass the positions where the
    draft's argmax is the target's (greedy acceptance, teacher-forced)."""
    rows = draft.model.get_output_embeddings().weight
    with torch.no_grad():
        logp = F.linear(f, rows.float()).log_softmax(-1)  # the target's distribution over the subset at each t
        best = logp.argmax(-1)
    valid = mask
    n = int(valid.sum())
    total, agree = 0.0, []
    inp = shifted(f)
    if noise:
        inp = inp + noise * inp.pow(2).mean(-1, keepdim=True).sqrt() * torch.randn(inp.shape, generator=gen)
    for _ in range(2):
        logits, h = draft(ids, inp, mask.long())
        lq = logits.log_softmax(-1)
        kl = (logp.exp() * (logp - lq)).sum(-1)
        reg = F.smooth_l1_loss(h.float(), f, reduction="none").mean(-1)
        total = total + ((kl + FEATURE_WEIGHT * reg) * valid).sum()
        agree.append(int(((logits.argmax(-1) == best) & valid).sum()))
        inp = shifted(h.detach().float())
    return total, n, agree


def evaluate(draft: FeatureDraft, seqs, feats, held: list, batch_tokens: int = 4096) -> dict:
    """On the held-out sequences: the mean loss per position and the greedy agreement reading the target's features
    (a round's first candidate) and reading the draft's own predictions (the candidates after it)."""
    tot, n, a1, a2 = 0.0, 0, 0, 0
    sub = [seqs[i] for i in held]
    sub_f = [feats[i] for i in held]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for batch in _batches(sub, batch_tokens, torch.Generator().manual_seed(0)):
            ids, mask = _pad(sub, batch)
            loss, k, (x1, x2) = _losses(draft, ids, mask, _pad_features(sub_f, batch, ids.shape[1]))
            tot, n, a1, a2 = tot + float(loss), n + k, a1 + x1, a2 + x2
    n = max(n, 1)
    return {"loss": tot / n, "agreement_target_features": a1 / n, "agreement_own_features": a2 / n, "positions": n}


def train(draft: FeatureDraft, seqs, feats, work: Path, minutes: float = 30.0, lr: float = 5e-4,
          batch_tokens: int = 2048, held_out: float = 0.03, noise: float = 0.05, seed: int = 0,
          log: Callable = print, progress: Optional[Callable] = None, steps: Optional[int] = None) -> dict:
    """Train ``draft`` (:func:`trainable`) for about ``minutes`` of wall time, or exactly ``steps`` optimizer steps
    where given: AdamW, bfloat16 autocast, linear warm-up then cosine decay (the steps estimated from the first
    steps' pace), the module docstring's loss; ``noise``: Gaussian noise on the target's features of the first
    pass, relative to their RMS (the loop: :func:`~.draft_train.fit`). Checkpoints to ``work/eagle-checkpoint.pt``
    and resumes from it. Returns the held-out metrics (:func:`evaluate`) before and after and the training log."""
    work = Path(work)
    held, train_idx = held_out_split(len(seqs), held_out, seed)
    params = trainable(draft)
    opt = optimizer(params, lr)
    ckpt = work / "eagle-checkpoint.pt"
    state = resumed(ckpt, opt, steps, log, lambda blob: draft.load_state_dict(blob["draft"], strict=False))
    if state["before"] is None:
        state["before"] = evaluate(draft, seqs, feats, held, batch_tokens)
        log(f"[train-draft] held out before: {state['before']}")
    tr_seqs = [seqs[i] for i in train_idx]
    tr_feats = [feats[i] for i in train_idx]
    gen = torch.Generator().manual_seed(seed + 7 + state["step"])

    def step_loss(batch):
        ids, mask = _pad(tr_seqs, batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, n, (a1, a2) = _losses(draft, ids, mask, _pad_features(tr_feats, batch, ids.shape[1]), noise, gen)
        return loss / max(n, 1), {"agree": f"{a1 / max(n, 1):.2f}/{a2 / max(n, 1):.2f}"}

    def save():
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"draft": {k: v for k, v in draft.state_dict().items() if "embed_tokens" not in k
                              and "lm_head" not in k}, "opt": opt.state_dict(), "state": state}, tmp)
        tmp.replace(ckpt)

    def passes(epoch):
        return _batches(tr_seqs, batch_tokens, torch.Generator().manual_seed(seed + 1 + epoch))

    fit(opt, params, state, passes, step_loss, save, minutes, lr, steps, "training the feature draft", "loss", 100,
        progress)
    return training_report(params, state, evaluate(draft, seqs, feats, held, batch_tokens), held, train_idx, log)


def train_feature_draft(target, tokenizer, out: Path, work: Path, prompts: int = 4096, max_new_tokens: int = 96,
                        vocab: int = 8192, layer: int = 0, minutes: float = 30.0, batch_size: int = 64,
                        lr: float = 5e-4, seed: int = 0, log: Callable = print,
                        progress: Optional[Callable] = None) -> dict:
    """The whole of ``specdec train-draft --kind eagle``: the target's continuations (:mod:`.draft_data`), the
    draft's vocabulary (the ``vocab`` ids most frequent in them, special tokens included), the target's features, a
    draft trained for ``minutes``, stored in ``out`` (:mod:`.draft_store`) with ``metrics.json``. Every stage
    resumes from what it finds in ``work``. Returns the metrics.

    Raises ValueError for ``vocab`` < 2 or ``minutes`` <= 0."""
    if vocab < 2 or minutes <= 0:
        raise ValueError(f"vocab must be >= 2 and minutes > 0, got {vocab} and {minutes}")
    work, out = Path(work), Path(out)
    work.mkdir(parents=True, exist_ok=True)
    seqs, token_ids, data_minutes = sequences_and_vocabulary(target, tokenizer, work, prompts, max_new_tokens, vocab,
                                                             batch_size, seed, progress)
    t1 = time.perf_counter()
    feats = target_features(target, seqs, work, progress=progress)
    t_feats = time.perf_counter() - t1
    draft = new_feature_draft(target, token_ids, layer)
    report = train(draft, seqs, feats, work, minutes, lr=lr, seed=seed, log=log, progress=progress)
    record = {"kind": FeatureDraft.kind, "layer_from": layer, "vocab_subset": len(token_ids), "prompts": prompts,
              "max_new_tokens": max_new_tokens, "stage_minutes": {
                  "data": round(data_minutes, 1), "features": round(t_feats / 60, 1), "training": report["minutes"]}}
    return stored(draft, target, out, record, report)
