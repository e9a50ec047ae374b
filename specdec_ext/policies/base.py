"""The candidate-length policy interface.

The engine asks a policy, after each drafted candidate, whether each row should stop drafting;
at the end of a round it reports how many candidates each row drafted and how many the target
accepted. A policy never touches models or caches. State is per row, so that a row's decisions
in a batch equal its decisions alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class DraftStep:
    """What the engine knows after drafting candidate ``step`` (1-based) of a round.

    token_prob: ``[B]`` float32, q(x) of the candidate just drafted under the draft's processed distribution
        (softmax at temperature 1 when decoding greedily); given when sampling or when ``needs_probs``.
    probs: ``[B, V]`` float32, that draft distribution q; given likewise.
    hidden: ``[B, H]``, the draft's last hidden state at the candidate's position (only for policies
        with ``needs_hidden``; the candidate has then been fed to the draft).

    Policies with ``needs_hidden`` decide one step later than the others: the forward pass that
    feeds candidate ``step`` to the draft also yields the draft's distribution for candidate
    ``step + 1``, so ``should_stop`` returning True ends the round with ``step + 1`` candidates, the
    last one drawn from that distribution with no further draft forward. This is the order of the
    SpecDec++ reference implementation (the stop test after drafting Y_s covers Y_1..Y_{s-1}), and
    it costs the same K draft forwards per round as a fixed candidate length K.
    """

    step: int
    batch_size: int
    token_prob: Optional[torch.Tensor] = None
    probs: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None
    tokens: Optional[torch.Tensor] = None   # [B] int64, the candidate ids just drafted


class CandidateLengthPolicy:
    """Base class. Subclasses set ``name`` and ``max_candidates`` and implement ``should_stop``."""

    name = "policy"
    speculative = True      # False: plain target-only decoding
    needs_hidden = False    # True: asked after each candidate is fed to the draft; stop = one more, then stop
    needs_probs = False     # True: token_prob / probs are needed even when decoding greedily
    max_candidates = 1      # an upper bound on the candidates per round (K_max)

    def reset(self, batch_size: int, device: torch.device) -> None:
        """Start a generation call with ``batch_size`` rows."""

    def begin_round(self) -> None:
        """Start a draft round for the live rows."""

    def should_stop(self, info: DraftStep) -> torch.Tensor:
        """``[B]`` bool: stop drafting after this candidate (``needs_hidden``: after the next one).
        Rows at ``max_candidates`` always stop."""
        raise NotImplementedError

    def end_round(self, num_drafted: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Feedback after verification: candidates drafted and accepted per row (``[B]`` int64)."""

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the state of rows ``index`` only (finished rows leave the batch)."""

    def describe(self) -> str:
        return self.name


def _check_k(name: str, value: int, low: int = 1) -> int:
    if not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value
