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
