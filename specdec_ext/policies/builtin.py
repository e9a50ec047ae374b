"""The built-in candidate-length policies (SpecDec++'s in ``policies/specdecpp.py``)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..head import AcceptanceHead
from .base import CandidateLengthPolicy, RoundPlan, StopRule, _check_k
from .lookup import LookupStop
from .specdecpp import SpecDecPP


class Autoregressive(CandidateLengthPolicy):
    """Plain target-only decoding: the baseline every speedup is measured against."""

    name = "autoregressive"
    speculative = False
    plans_ahead = True
    max_candidates = 0

    def plan(self, ctx):
        return RoundPlan(0)


class FixedK(CandidateLengthPolicy):
    """Speculative decoding with a fixed candidate length K (Leviathan et al. 2023; Chen et al. 2023)."""

    plans_ahead = True

    def __init__(self, k: int = 4):
        self.k = _check_k("k (candidate length)", k)
        self.max_candidates = self.k
        self.name = f"fixed-{k}"

    def plan(self, ctx):
        return RoundPlan(self.k)


class Heuristic(CandidateLengthPolicy):
    """Hugging Face's heuristic schedule: K += 2 after a fully accepted round, else K = max(1, K - 1).

    Args: initial_k (HF's historical default 5), max_k (cap, 20). State is per row (each row's K is its cap).
    """

    name = "heuristic"

    def __init__(self, initial_k: int = 5, max_k: int = 20):
        self.initial_k = _check_k("initial_k", initial_k)
        self.max_candidates = _check_k("max_k", max_k)
        if initial_k > max_k:
            raise ValueError(f"initial_k ({initial_k}) must be <= max_k ({max_k})")
        self.k: list[int] = []

    def reset(self, batch_size, device):
        self.k = [self.initial_k] * batch_size

    def plan(self, ctx):
        return RoundPlan(max(self.k), row_caps=self.k)

    def observe(self, result):
        self.k = [min(k + 2, self.max_candidates) if a >= n else max(1, k - 1)
                  for k, n, a in zip(self.k, result.drafted, result.accepted)]

    def select_rows(self, index):
        self.k = [self.k[i] for i in index.tolist()]

    def add_rows(self, n):
        self.k = self.k + [self.initial_k] * n


class _ThresholdRule(StopRule):
    """A per-row stop rule on the draft's own distribution (device): ``stop(info)`` of the policy."""

    needs_probs = True

    def __init__(self, stop):
        self._stop = stop

    def step(self, info):
        return self._stop(info)


class Confidence(CandidateLengthPolicy):
    """Stop when the draft's probability of its own candidate falls below ``threshold``
    (Hugging Face's ``assistant_confidence_threshold``, default 0.4), or at ``max_k``."""

    plans_ahead = True

    def __init__(self, threshold: float = 0.4, max_k: int = 20):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"confidence threshold must lie in [0, 1], got {threshold}")
        self.threshold = threshold
        self.max_candidates = _check_k("max_k", max_k)
        self.name = f"confidence-{threshold:g}"

    def plan(self, ctx):
        return RoundPlan(self.max_candidates, _ThresholdRule(lambda info: info.token_prob < self.threshold))


class AdaEDL(CandidateLengthPolicy):
    """AdaEDL (Agrawal et al. 2024): stop when the entropy-based lower bound on the acceptance
    probability, 1 - sqrt(gamma * H(q)) with H in nats, falls below ``lam``, or at ``max_k``."""

    plans_ahead = True

    def __init__(self, gamma: float = 0.2, lam: float = 0.4, max_k: int = 20):
        if gamma <= 0 or not math.isfinite(gamma):
            raise ValueError(f"gamma must be a positive number, got {gamma}")
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam must lie in [0, 1], got {lam}")
        self.gamma, self.lam = gamma, lam
        self.max_candidates = _check_k("max_k", max_k)
        self.name = f"adaedl-{lam:g}"

    def plan(self, ctx):
        return RoundPlan(self.max_candidates, _ThresholdRule(self._stop))

    def _stop(self, info):
        q = info.probs
        entropy = -(q * torch.log(q.clamp_min(1e-30))).sum(-1)
        return (1.0 - torch.sqrt(self.gamma * entropy)) < self.lam


def make_policy(name: str, head: Optional[AcceptanceHead] = None, **kwargs) -> CandidateLengthPolicy:
    """Build a policy by name: autoregressive, fixed (k), heuristic, confidence, adaedl, specdecpp (head), lookup
    (SpecDec++'s stop rule over prompt lookup, :class:`~specdec_ext.policies.lookup.LookupStop`)."""
    key = name.lower().replace("-", "").replace("+", "p").replace("_", "")
    if key in ("autoregressive", "ar", "plain"):
        return Autoregressive()
    if key == "fixed":
        return FixedK(**kwargs)
    if key == "heuristic":
        return Heuristic(**kwargs)
    if key == "confidence":
        return Confidence(**kwargs)
    if key == "adaedl":
        return AdaEDL(**kwargs)
    if key in ("specdecpp", "specdecplusplus"):
        if head is None:
            raise ValueError("the specdecpp policy needs an acceptance head (head=...)")
        return SpecDecPP(head, **kwargs)
    if key == "lookup":
        return LookupStop(**kwargs)
    raise ValueError(f"unknown policy {name!r}: expected autoregressive, fixed, heuristic, confidence, adaedl, "
                     "specdecpp or lookup")
