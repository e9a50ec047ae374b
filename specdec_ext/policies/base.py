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

    step: the index of the candidate just drafted, i.e. the round's candidate length K if drafting
        stopped now.
    token_prob: ``[B]`` float32, q(x) of the candidate under the draft's processed distribution q
        (softmax at temperature 1 when decoding greedily); given when sampling or when ``needs_probs``.
    probs: ``[B, V]`` float32, that draft distribution q; given likewise.
    hidden: ``[B, H]``, the draft's last hidden state from which the candidate was sampled (the input of
        the LM head that gave q), only for policies with ``needs_hidden``. For ``step > 1`` this is also
        the hidden state *at* candidate ``step - 1`` (the forward that fed it proposed this one), which
        is what the SpecDec++ paper's head reads.
    tokens: ``[B]`` int64, the candidate ids just drafted.
    logits: ``[B, V]`` float32, the draft's raw logits from which the candidate came (always given; under
        greedy decoding q = softmax(logits)).
    drafting: ``[B]`` bool, rows whose candidate ``step`` is real (they had not stopped before this step);
        the other rows' entries are stale and their decisions ignored.
    room: ``[B]`` bool, rows that may draft candidate ``step + 1`` (drafting, and below K_max and the tokens
        the row may still emit).

    Stopping after candidate ``step`` costs no further draft forward: the engine feeds a candidate to
    the draft only to propose the next one, so a round of K candidates costs K draft forwards.
    """

    step: int
    batch_size: int
    token_prob: Optional[torch.Tensor] = None
    probs: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None
    tokens: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    drafting: Optional[torch.Tensor] = None
    room: Optional[torch.Tensor] = None


class CandidateLengthPolicy:
    """Base class. Subclasses set ``name`` and ``max_candidates`` and implement ``should_stop``."""

    name = "policy"
    speculative = True      # False: plain target-only decoding
    needs_hidden = False    # True: DraftStep.hidden is needed
    needs_probs = False     # True: token_prob / probs are needed even when decoding greedily
    needs_costs = False     # True: configure() must receive the pair's CostModel (policies/goodput.py)
    max_candidates = 1      # an upper bound on the candidates per round (K_max)
    # set by the engine before each reset(): True when the target verifies rows of different depths without padding
    # (engine/packing.py), so a row's unverified slots save their cost; False: a round costs its deepest row's depth
    packed_verification = False

    def configure(self, sampling, costs=None) -> None:
        """Called once per generation call before ``reset``: the decoding settings
        (:class:`~specdec_ext.engine.SamplingConfig`) and, for ``needs_costs`` policies, the pair's
        :class:`~specdec_ext.policies.goodput.CostModel`."""

    def reset(self, batch_size: int, device: torch.device) -> None:
        """Start a generation call with ``batch_size`` rows."""

    def draft_overhead(self, ms_per_token: float) -> None:
        """Before each :meth:`draft_round`: the wall time (ms) that drafting adds outside the rounds per token a
        request emits, as the engine estimates it. The draft reads a request's context once, when the request
        first drafts (``SpeculativeGenerator._catch_up``); the engine gives that read's measured mean ms per
        request spread over the tokens a request emits (the call's ``max_new_tokens``, or their mean) while such
        reads are still to come (some live row is unread, or requests wait in a continuous batch's queue), else 0
        (what was read is paid for), and 0 until it has measured one. Policies that weigh drafting against plain
        decoding may add it to a drafting round's cost (the batch budget of ``threshold="auto"`` does); default:
        ignored."""

    def rows_together(self, together: bool) -> None:
        """Before each :meth:`draft_round` of a continuous batch (``SpeculativeGenerator.generate_continuous``):
        whether its live rows are in lockstep, that is, it has several and every one has the same number of tokens
        left, so under plain steps the rows finish in the same round: the queue's next requests then join them in
        one admission, and the call never runs rounds with fewer rows at its end. A round that drafts ends that for
        the rest of the call (rows accept different numbers of tokens). Policies that weigh drafting against plain
        decoding may demand more of drafting while the rows are together (the batch budget of ``threshold="auto"``
        does); default: ignored. ``generate()``'s batches, which no request joins, are not reported."""

    def draft_reads(self, ms: float) -> None:
        """Before each :meth:`draft_round`: the ms the draft would spend, before this round, reading the contexts of
        the live rows it has not read yet (``SpeculativeGenerator._catch_up``; the measured mean ms per request
        times the unread rows, 0 until a read was measured), were the round to draft. Policies that choose between
        drafting and plain steps may weigh it (the batch budget of ``threshold="auto"`` spaces its probes of
        drafting by it); default: ignored."""

    def draft_round(self, width: int) -> bool:
        """Before a round: whether the live rows draft at all (default: yes). False makes the round one step of
        plain decoding by the target alone (the draft catches up on the tokens it missed when it next drafts;
        ``end_round`` then gets zeros). ``width``: the target's cache width in columns (positions, holes
        included), on which a batched verification's cost depends."""
        return True

    def begin_round(self) -> None:
        """Start a draft round for the live rows."""

    def should_stop(self, info: DraftStep) -> torch.Tensor:
        """``[B]`` bool: stop drafting after this candidate. Rows at ``max_candidates`` always stop."""
        raise NotImplementedError

    def verify_depth(self, num_drafted: torch.Tensor) -> torch.Tensor:
        """After drafting, before verification: how many of its ``num_drafted[b]`` candidates (``[B]`` int64) each
        row verifies (default: all). A batch-level verification budget returns fewer; 0 for every row makes the
        round one step of plain decoding. Rows may differ: the target verifies each row's own candidates (packed
        where :attr:`packed_verification`, else padded to the deepest row with holes)."""
        return num_drafted

    def end_round(self, num_drafted: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Feedback after verification: candidates drafted and accepted per row (``[B]`` int64)."""

    def round_time(self, ms: float) -> None:
        """After ``end_round``: the round's measured wall time in ms (not reported for a tensor-parallel target,
        whose ranks must decide alike). Policies that learn from measured costs use it."""

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the state of rows ``index`` only (finished rows leave the batch)."""

    def add_rows(self, n: int) -> None:
        """Continuous batching: ``n`` new rows join after the live ones, each starting as a row does at
        ``reset``. Policies with per-row state override it beside ``select_rows``; the default serves
        stateless policies.

        Raises: NotImplementedError for a policy that overrides ``select_rows`` (so keeps per-row state) but
            not this method."""
        if type(self).select_rows is not CandidateLengthPolicy.select_rows:
            raise NotImplementedError(f"policy {self.name!r} keeps per-row state (it overrides select_rows) but does "
                                      "not implement add_rows(n), so it cannot take new rows mid-generation "
                                      "(generate_continuous)")

    def describe(self) -> str:
        return self.name


def _check_k(name: str, value: int, low: int = 1) -> int:
    if not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value
