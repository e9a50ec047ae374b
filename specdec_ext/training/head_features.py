"""What the acceptance head reads, computed once from the frozen draft for every labelled position
of a :class:`~specdec_ext.training.head_data.HeadDataset`.

* ``position="proposal"`` (recipe "deployment"): the draft runs over prompt + X; at response position i
  the head reads the hidden state at index P + i - 1 (the input of the LM head that gave q_i), and the
  confidence features of (q_i, Y_i). Every response position counts.
* ``position="candidate"`` (recipe "paper"): the draft runs over prompt + Z (Z_i = X_i where the data
  set's ``take_target`` is set, else Y_i); the head reads the hidden state at index P + i (after Z_i);
  only positions with Z_i = Y_i count.

* ``position="candidate", contexts="target"`` (evaluation of a paper-style head on the positions a
  "proposal" head is evaluated on): the state after feeding Y_i at context prompt + X_<i, at every
  response position; where Y_i != X_i that state needs its own draft forward over prompt + X_<i + Y_i.

Every name of ``head.features.FEATURES`` is computed (columns in that order); a head picks its own.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..engine.runner import model_device
from ..engine.sampling import process_logits
from ..head.features import CONFIDENCE_FEATURES, FEATURES, confidence_features, history_offline
from ..head.module import INPUT_POSITIONS
from .head_data import HeadDataset


def _groups(data: HeadDataset, batch_tokens: int):
    lengths = (data.offsets[1:] - data.offsets[:-1]).tolist()
    i = 0
    while i < len(lengths):
        j, longest = i + 1, lengths[i]
        while j < len(lengths) and (j - i + 1) * max(longest, lengths[j]) <= batch_tokens:
            longest = max(longest, lengths[j])
            j += 1
        yield list(range(i, j))
        i = j


@torch.inference_mode()
def draft_features(draft, data: HeadDataset, position: str = "proposal", batch_tokens: int = 8192,
                   progress: bool = True, contexts: str = "mixed") -> dict[str, torch.Tensor]:
    """Returns ``hidden`` ``[M, H]`` float32, ``features`` ``[M, len(FEATURES)]`` float32 (columns
    ``FEATURES``), ``labels`` ``[M]``, ``accept`` ``[M]`` bool, ``example`` ``[M]`` and ``index`` ``[M]``
    (the response position) for the M counted positions, in example order."""
    if position not in INPUT_POSITIONS:
        raise ValueError(f"position must be one of {INPUT_POSITIONS}, got {position!r}")
    if contexts not in ("mixed", "target"):
        raise ValueError(f"contexts must be 'mixed' or 'target', got {contexts!r}")
    on_target = position == "candidate" and contexts == "target"
    cfg = data.config
    captured = {}
    hook = draft.get_output_embeddings().register_forward_pre_hook(lambda m, a: captured.__setitem__("h", a[0]))
    dev = model_device(draft)
    out = {k: [] for k in ("hidden", "features", "labels", "accept", "example", "index")}
    try:
        bar = tqdm(total=len(data), desc="draft features", disable=not progress, unit="ex")
        for group in _groups(data, batch_tokens):
            seqs = []
            for e in group:
                sl = data.example(e)
                ids = data.input_ids[sl].clone()
                if position == "candidate" and not on_target:
                    P = int(data.response_start[e])
                    take = data.take_target[sl][P:]
                    ids[P:] = torch.where(take, data.target_tokens[sl][P:], data.candidates[sl][P:])
                seqs.append(ids)
            L = max(s.numel() for s in seqs)
            ids = torch.zeros(len(group), L, dtype=torch.long)
            mask = torch.zeros(len(group), L, dtype=torch.long)
            for r, s in enumerate(seqs):
                ids[r, : s.numel()] = s
                mask[r, : s.numel()] = 1
            logits = draft(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.float().cpu()
            h = captured["h"].float().cpu()
            for r, e in enumerate(group):
                sl = data.example(e)
                P, n = int(data.response_start[e]), seqs[r].numel() - int(data.response_start[e])
                y = data.candidates[sl][P:]
                if position == "proposal":
                    counted = torch.ones(n, dtype=torch.bool)
                    hid = h[r, P - 1 : P - 1 + n]
                elif on_target:
                    counted = torch.ones(n, dtype=torch.bool)
                    hid = h[r, P : P + n].clone()
                    x = seqs[r][P:]
                    for i in (y != x).nonzero().squeeze(-1).tolist():  # the state after Y_i at context X_<i
                        alt = torch.cat([seqs[r][: P + i], y[i : i + 1]]).unsqueeze(0).to(dev)
                        draft(input_ids=alt)
                        hid[i] = captured["h"][0, -1].float().cpu()
                else:
                    counted = (seqs[r][P:] == y)
                    hid = h[r, P : P + n]
                q = torch.softmax(logits[r, P - 1 : P - 1 + n], -1) if cfg.decoding == "greedy" else \
                    process_logits(logits[r, P - 1 : P - 1 + n], cfg.sampling)
                conf = confidence_features(q, y, CONFIDENCE_FEATURES)
                hist = history_offline(data.accept_sample[sl][P:])
                feats = torch.cat([conf, hist.unsqueeze(-1)], -1)
                assert feats.shape[-1] == len(FEATURES)
                out["hidden"].append(hid[counted])
                out["features"].append(feats[counted])
                out["labels"].append(data.labels[sl][P:][counted])
                out["accept"].append(data.accept_sample[sl][P:][counted])
                out["example"].append(torch.full((int(counted.sum()),), e, dtype=torch.int64))
                out["index"].append(torch.arange(n)[counted])
            bar.update(len(group))
        bar.close()
    finally:
        hook.remove()
    return {k: torch.cat(v) for k, v in out.items()}


def select_features(features: torch.Tensor, names) -> torch.Tensor:
    """The columns ``names`` of a ``draft_features`` feature matrix."""
    cols = [FEATURES.index(n) for n in names]
    return features[:, cols]
