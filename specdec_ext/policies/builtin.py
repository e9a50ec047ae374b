"""The built-in candidate-length policies."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import ops
from ..head import AcceptanceHead
from .base import CandidateLengthPolicy, DraftStep, _check_k


class Autoregressive(CandidateLengthPolicy):
    """Plain target-only decoding: the baseline every speedup is measured against."""

    name = "autoregressive"
    speculative = False
    max_candidates = 0


class FixedK(CandidateLengthPolicy):
    """Speculative decoding with a fixed candidate length K (Leviathan et al. 2023; Chen et al. 2023)."""

    def __init__(self, k: int = 4):
        self.k = _check_k("k (candidate length)", k)
        self.max_candidates = self.k
        self.name = f"fixed-{k}"

    def should_stop(self, info: DraftStep) -> torch.Tensor:
        return torch.full((info.batch_size,), info.step >= self.k, dtype=torch.bool)


class Heuristic(CandidateLengthPolicy):
    """Hugging Face's heuristic schedule: K += 2 after a fully accepted round, else K = max(1, K - 1).

    Args: initial_k (HF's historical default 5), max_k (cap, 20). State is per row.
    """

    name = "heuristic"

    def __init__(self, initial_k: int = 5, max_k: int = 20):
        self.initial_k = _check_k("initial_k", initial_k)
        self.max_candidates = _check_k("max_k", max_k)
        if initial_k > max_k:
            raise ValueError(f"initial_k ({initial_k}) must be <= max_k ({max_k})")
        self.k: Optional[torch.Tensor] = None

    def reset(self, batch_size, device):
        self.k = torch.full((batch_size,), self.initial_k, dtype=torch.int64)

    def should_stop(self, info):
        return info.step >= self.k

    def end_round(self, num_drafted, num_accepted):
        full = (num_accepted.cpu() >= num_drafted.cpu())
        self.k = torch.where(full, self.k + 2, (self.k - 1).clamp_min(1)).clamp_max(self.max_candidates)

    def select_rows(self, index):
        self.k = self.k[index.cpu()]


class Confidence(CandidateLengthPolicy):
    """Stop when the draft's probability of its own candidate falls below ``threshold``
    (Hugging Face's ``assistant_confidence_threshold``, default 0.4), or at ``max_k``."""

    needs_probs = True

    def __init__(self, threshold: float = 0.4, max_k: int = 20):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"confidence threshold must lie in [0, 1], got {threshold}")
        self.threshold = threshold
        self.max_candidates = _check_k("max_k", max_k)
        self.name = f"confidence-{threshold:g}"

    def should_stop(self, info):
        return ((info.token_prob < self.threshold) | (info.step >= self.max_candidates)).cpu()


class AdaEDL(CandidateLengthPolicy):
    """AdaEDL (Agrawal et al. 2024): stop when the entropy-based lower bound on the acceptance
    probability, 1 - sqrt(gamma * H(q)) with H in nats, falls below ``lam``, or at ``max_k``."""

    needs_probs = True

    def __init__(self, gamma: float = 0.2, lam: float = 0.4, max_k: int = 20):
        if gamma <= 0 or not math.isfinite(gamma):
            raise ValueError(f"gamma must be a positive number, got {gamma}")
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam must lie in [0, 1], got {lam}")
        self.gamma, self.lam = gamma, lam
        self.max_candidates = _check_k("max_k", max_k)
        self.name = f"adaedl-{lam:g}"

    def should_stop(self, info):
        q = info.probs
        entropy = -(q * torch.log(q.clamp_min(1e-30))).sum(-1)
        bound = 1.0 - torch.sqrt(self.gamma * entropy)
        return ((bound < self.lam) | (info.step >= self.max_candidates)).cpu()


class SpecDecPP(CandidateLengthPolicy):
    """SpecDec++ (Huang, Guo, Wang 2024, Sec. 3.2): the acceptance head predicts p_hat_i for each
    candidate from the draft's hidden state at it; drafting stops when 1 - prod_i p_hat_i > threshold
    (the stop threshold h), with the candidate length K held within [``k_min``, ``k_max``]
    (paper: h in {0.3, 0.7}, bounds [2, 20]). Each step runs through the fused ``acceptance_head_step`` op.

    As in the paper's reference implementation, a round ends with one candidate beyond those the head
    has scored: the forward pass that scores Y_k already gives the draft's distribution for Y_{k+1},
    so stopping after Y_k's score yields K = k + 1 candidates at K draft forwards (see
    :class:`~specdec_ext.policies.DraftStep`). Hence the smallest K the head chooses is 2."""

    needs_hidden = True

    def __init__(self, head: AcceptanceHead, threshold: float = 0.3, k_min: int = 2, k_max: int = 20):
        if not isinstance(head, AcceptanceHead):
            raise TypeError(f"SpecDecPP needs an AcceptanceHead, got {type(head).__name__}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"stop threshold h must lie in [0, 1], got {threshold}")
        self.k_min = _check_k("k_min", k_min)
        self.max_candidates = _check_k("k_max", k_max)
        if k_min > k_max:
            raise ValueError(f"k_min ({k_min}) must be <= k_max ({k_max})")
        self.head, self.threshold = head, threshold
        self.name = f"specdec++-{threshold:g}"
        self._weights = None
        self.cum_accept: Optional[torch.Tensor] = None

    def reset(self, batch_size, device):
        self._weights = self.head.fused_weights(device)
        self.cum_accept = torch.ones(batch_size, dtype=torch.float32, device=device)

    def begin_round(self):
        self.cum_accept.fill_(1.0)

    def should_stop(self, info):
        w, b, ow, ob = self._weights
        hidden = info.hidden.to(w.device)
        # the bounds apply to the round's length if it stopped now: this candidate plus the next one
        _, stop = ops.acceptance_head_step(hidden, w, b, ow, ob, self.cum_accept, info.step + 1, self.k_min,
                                           self.max_candidates, self.threshold)
        return stop

    def select_rows(self, index):
        self.cum_accept = self.cum_accept[index.to(self.cum_accept.device)]


def make_policy(name: str, head: Optional[AcceptanceHead] = None, **kwargs) -> CandidateLengthPolicy:
    """Build a policy by name: autoregressive, fixed (k), heuristic, confidence, adaedl, specdecpp (head)."""
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
    raise ValueError(f"unknown policy {name!r}: expected autoregressive, fixed, heuristic, confidence, adaedl or specdecpp")
