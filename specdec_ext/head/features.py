"""Draft-confidence features: what the draft's own distribution says about a candidate.

Computed from the draft's processed distribution q of a candidate (the distribution the candidate was
sampled from: softmax at temperature 1 under greedy decoding, the temperature / top-k / top-p
distribution under sampling) and the candidate token y:

* ``token_prob``: q(y), the draft's probability of its own candidate (Hugging Face's assistant
  confidence; under greedy decoding the top-1 probability);
* ``margin``: q's top-1 minus top-2 probability;
* ``entropy``: H(q) = -sum_v q(v) log q(v), in nats.

On the bundled pair these predict greedy acceptance better than the paper's head on the hidden
state alone (ROC AUC 0.75 / 0.79 / 0.69 on HumanEval, against 0.68 for a head on the hidden state
alone); the head combines them with the hidden state (see ``AcceptanceHead``).
"""

from __future__ import annotations

from typing import Sequence

import torch

CONFIDENCE_FEATURES = ("token_prob", "margin", "entropy")
FEATURES = CONFIDENCE_FEATURES + ("recent_accept",)  # recent_accept: see "acceptance history" below


def check_feature_names(names: Sequence[str]) -> tuple[str, ...]:
    names = tuple(names)
    unknown = [n for n in names if n not in FEATURES]
    if unknown:
        raise ValueError(f"unknown confidence feature(s) {unknown}: expected names from {FEATURES}")
    if len(set(names)) != len(names):
        raise ValueError(f"confidence features listed twice: {list(names)}")
    return names


def confidence_features(dist: torch.Tensor, tokens: torch.Tensor, names: Sequence[str] = CONFIDENCE_FEATURES,
                        logits: bool = False) -> torch.Tensor:
    """Features of candidates ``tokens`` ``[...]`` (int64) under the draft distribution q, given as
    probabilities ``dist`` ``[..., V]`` (rows summing to 1) or, with ``logits=True``, as logits (q = softmax,
    what greedy decoding uses). Returns float32 ``[..., len(names)]`` in the order of ``names``; computed
    by the fused ``ops.confidence_features`` (one row of V read twice)."""
    from .. import ops

    names = check_feature_names(names)
    if any(n not in CONFIDENCE_FEATURES for n in names):
        raise ValueError(f"confidence_features computes {CONFIDENCE_FEATURES}, not {list(names)}")
    lead = dist.shape[:-1]
    all3 = ops.confidence_features(dist.reshape(-1, dist.shape[-1]), tokens.reshape(-1), logits).view(*lead, 3)
    if tuple(names) == CONFIDENCE_FEATURES:
        return all3
    return all3[..., [CONFIDENCE_FEATURES.index(n) for n in names]]


# ------------------------------------------------------------------------------ acceptance history
# ``recent_accept``: an exponential average of the row's observed acceptance outcomes (1 accepted, 0
# rejected), decay HISTORY_DECAY per outcome, starting at HISTORY_PRIOR. The outcomes carry information
# about the target that the draft's own state cannot have. Offline (training data) every earlier
# response position's outcome is known; at run time only the candidates the target has tested are, and
# within a round candidate j is scored assuming candidates 1..j-1 accepted (the event p_hat_j is
# conditioned on), so its value is the row's average moved j - 1 times toward 1.
HISTORY_DECAY = 0.7
HISTORY_PRIOR = 0.75
HISTORY_FEATURES = ("recent_accept",)


def history_after_accepts(value: torch.Tensor, accepts: int) -> torch.Tensor:
    """The history average after ``accepts`` more accepted outcomes: d^a * value + (1 - d^a)."""
    f = HISTORY_DECAY ** accepts
    return value * f + (1.0 - f)


def history_update(value: torch.Tensor, num_drafted: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """Rows' averages after a verification: num_accepted ones, then a zero if a candidate was rejected."""
    acc = num_accepted.to(value.device, torch.float64)
    f = torch.pow(torch.full_like(acc, HISTORY_DECAY), acc)
    v = value.double() * f + (1.0 - f)
    rejected = (num_accepted < num_drafted).to(value.device)
    return torch.where(rejected, v * HISTORY_DECAY, v).to(value.dtype)


def history_offline(outcomes: torch.Tensor) -> torch.Tensor:
    """``[n]`` bool outcomes of one response -> ``[n]`` float32: the average over the outcomes before each position."""
    out = torch.empty(outcomes.numel(), dtype=torch.float32)
    v = HISTORY_PRIOR
    for i, o in enumerate(outcomes.tolist()):
        out[i] = v
        v = HISTORY_DECAY * v + (1.0 - HISTORY_DECAY) * (1.0 if o else 0.0)
    return out
