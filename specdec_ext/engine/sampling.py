"""Sampling settings, applied identically to the draft's and the target's logits.

Order as in Hugging Face's default warpers: temperature, then top-k, then top-p. Because the
draft's q and the target's p are both the *processed* distributions, rejection sampling yields
exactly the target's processed distribution. Temperature 0 means greedy decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import MIN_TEMPERATURE


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy decoding) or at least {MIN_TEMPERATURE:g}: float32 cannot "
                             f"sample at a smaller one, got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1] or be None, got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Processed distribution, float32, same shape as ``logits`` ``[..., V]`` (not for greedy). Computed as
    softmax((x - max) / T), stable at any allowed temperature; -inf logits are masked tokens."""
    x = logits.float()
    x = (x - x.amax(-1, keepdim=True)) / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = torch.softmax(sorted_x, -1).cumsum(-1)
        remove_sorted = cum <= (1.0 - cfg.top_p)
        remove_sorted[..., -1] = False  # keep at least the most likely token
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        x = x.masked_fill(remove, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from each row of ``probs`` ``[B, V]`` with uniforms ``u`` ``[B]`` in (0, 1] -> ``[B]`` int64.

    Never returns an index with zero probability (u > 0)."""
    cum = torch.cumsum(probs.double(), -1)
    thr = (u.double().to(probs.device) * cum[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cum, thr).squeeze(-1)
    return idx.clamp_max(probs.shape[-1] - 1)


@dataclass
class RowSampling:
    """Each row's sampling settings as device tensors, for batches whose rows decode differently (requests of a
    continuous batch): ``temperature`` ``[B]`` float32 (0: greedy), ``top_k`` ``[B]`` int64 (V: off) and ``top_p``
    ``[B]`` float32 (1: off); greedy rows have neither. ``greedy`` (every row greedy), ``masks`` (some row has
    top-k or top-p) and ``vocab`` (V) are known on the host when the batch is formed, so the steps skip what no row
    needs."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    greedy: bool
    masks: bool
    vocab: int

    @classmethod
    def of(cls, configs: list, vocab: int, device) -> "RowSampling":
        """The rows' :class:`SamplingConfig` s as tensors on ``device``."""
        t = [c.temperature for c in configs]
        k = [vocab if c.greedy or c.top_k is None else min(c.top_k, vocab) for c in configs]
        p = [1.0 if c.greedy or c.top_p is None else c.top_p for c in configs]
        return cls(torch.tensor(t, dtype=torch.float32, device=device), torch.tensor(k, dtype=torch.int64, device=device),
                   torch.tensor(p, dtype=torch.float32, device=device), all(c.greedy for c in configs),
                   any(kk < vocab for kk in k) or any(pp < 1.0 for pp in p), vocab)


def mask_logits(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """``logits`` ``[B, V]`` or ``[B, n, V]`` with ``-inf`` outside each row's top-k, then top-p, set (HF's order, at
    the row's temperature, as :func:`process_logits`), float32; ``softmax(masked / T_b)`` is then row b's processed
    distribution. Rows without top-k and top-p, and every row when no row has them, keep their logits. Fixed shapes,
    no host synchronisation (capturable)."""
    x = logits.float()
    if not rows.masks:
        return x
    lead = (-1,) + (1,) * (x.dim() - 1)
    t = torch.where(rows.temperature > 0, rows.temperature, torch.ones_like(rows.temperature)).view(lead)
    z = (x - x.amax(-1, keepdim=True)) / t
    V = x.shape[-1]
    sz, order = torch.sort(z, dim=-1)  # ascending
    kth = sz.gather(-1, (V - rows.top_k).view(lead).expand(*z.shape[:-1], 1))
    sz = sz.masked_fill(sz < kth, float("-inf"))
    cum = torch.softmax(sz, -1).cumsum(-1)
    remove_sorted = cum <= (1.0 - rows.top_p).view(lead)
    remove_sorted[..., -1] = False  # keep at least the most likely token
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return x.masked_fill((z < kth) | remove, float("-inf"))


def row_probs(masked: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Each row's processed distribution ``[B, V]`` float32 from :func:`mask_logits`' output: softmax at the row's
    temperature (temperature 1 for greedy rows, the distribution their confidence features read)."""
    t = torch.where(rows.temperature > 0, rows.temperature, torch.ones_like(rows.temperature))
    return torch.softmax(masked / t.unsqueeze(-1), -1)


def draw_tokens(masked: torch.Tensor, rows: RowSampling, u: Optional[torch.Tensor],
                probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A token per row ``[B]`` int64 from :func:`mask_logits`' output ``[B, V]``: the argmax (``ops.argmax_tokens``)
    for greedy rows, an inverse-CDF draw with uniform ``u[b]`` in (0, 1] from the row's processed distribution
    (``probs``, or :func:`row_probs`) for the others (``u`` may be None when every row is greedy)."""
    from .. import ops

    greedy = ops.argmax_tokens(masked)
    if rows.greedy:
        return greedy
    drawn = sample_with_uniforms(row_probs(masked, rows) if probs is None else probs, u)
    return torch.where(rows.temperature > 0, drawn, greedy)
