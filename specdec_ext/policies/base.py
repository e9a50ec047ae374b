"""The candidate-length policy interface: a policy plans each round, and learns from its result.

Before a round the engine gives the policy a :class:`RoundContext` (the live rows, how far each may draft, the cache
width, what drafting would cost outside the round) and gets a :class:`RoundPlan`: the round's depth cap K (0: a step
of plain decoding, the draft does not run), per-row caps, and a :class:`StopRule` that decides, candidate by
candidate, which rows stop drafting. The built-in rules decide on the device from tensors (the draft's confidence,
the acceptance head's step), so a round reads nothing back to the host before its emitted tokens: those rules can be
captured in a CUDA graph. After the round the policy gets a :class:`RoundResult` (candidates drafted and accepted per
row, the rule's survivals where it asked for them, the round's ms). A policy never touches models or caches.

A policy written for the per-step interface (``should_stop`` on a :class:`DraftStep`, ``end_round``) keeps working:
the default :meth:`CandidateLengthPolicy.plan` wraps it in a host rule, which the engine calls with host decisions
(each step's answer is read back: correct, not capturable). State is per row, so that a row's decisions in a batch
equal its decisions alone (the batch verification budget of ``threshold="auto"`` aside, which decides for the batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch


@dataclass
class DraftStep:
    """What the engine knows after drafting candidate ``step`` (1-based) of a round, as tensors on the draft's device.

    step: the index of the candidate just drafted, i.e. the round's candidate length K if drafting
        stopped now.
    token_prob: ``[B]`` float32, q(x) of the candidate under the draft's processed distribution q
        (softmax at temperature 1 when decoding greedily); given when sampling or when the rule ``needs_probs``.
    probs: ``[B, V]`` float32, that draft distribution q; given likewise.
    hidden: ``[B, H]``, the draft's last hidden state from which the candidate was sampled (the input of
        the LM head that gave q). For ``step > 1`` this is also the hidden state *at* candidate ``step - 1`` (the
        forward that fed it proposed this one), which is what the SpecDec++ paper's head reads.
    tokens: ``[B]`` int64, the candidate ids just drafted.
    logits: ``[B, V]`` float32, the draft's logits from which the candidate came, with ``-inf`` outside a row's
        top-k / top-p set (under greedy decoding the raw logits, and q = softmax(logits)).
    drafting: ``[B]`` bool, rows whose candidate ``step`` is real (they had not stopped before this step);
        the other rows' entries are stale and their decisions ignored.
    room: ``[B]`` bool, rows that may draft candidate ``step + 1`` (drafting, and below their cap and the tokens
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


@dataclass
class RoundContext:
    """What the engine tells a policy before a round (:meth:`CandidateLengthPolicy.plan`).

    batch_size: live rows B. width: the target cache's widest live row, in columns (a batched verification's cost
    grows with it). room: per row, the most candidates it may draft this round (its tokens left minus one; 0 for a
    row whose context is a single token, which drafts from its second round on). draft_overhead: ms per emitted
    token that the draft's reads of requests' contexts add outside the rounds while such reads are still to come
    (0 otherwise, and until one was measured). draft_reads: ms the draft would spend before this round reading the
    live rows it has not read, were the round to draft. together: a continuous batch's live rows are in lockstep
    (several rows, each with the same number of tokens left). early_exit: the engine reads, between draft steps,
    whether any row still drafts (False: the draft runs to the cap whatever the rule says; a frozenset of steps:
    only after those; ``"device"``: the GPU decides in a captured round, ``engine.steps.exit_steps``). matches: per
    row, the length n of the suffix a prompt-lookup draft matched this round (0: none; ``engine/lookup.py``), empty
    for a draft model. copies: per row, the tokens the prompt-lookup proposer copied for it this round (its
    continuation; 0: no match), where the pair has one."""

    batch_size: int
    width: int = 0
    room: Sequence[int] = ()
    draft_overhead: float = 0.0
    draft_reads: float = 0.0
    together: bool = False
    early_exit: Union[bool, frozenset, str] = True
    matches: Sequence[int] = ()
    copies: Sequence[int] = ()


@dataclass
class RoundPlan:
    """A round as a policy plans it. cap: the most draft steps (candidates per row); 0 makes the round one step of
    plain decoding by the target alone. rule: the per-step stop decisions (None: each row drafts to its cap).
    row_caps: per row, a cap of its own (at most ``cap``). note: the policy's own record of what it planned, handed
    back with the round's result (:attr:`RoundResult.plan`), so that a policy which plans a round before it has
    observed the one before (overlapped rounds, :attr:`CandidateLengthPolicy.plans_ahead`) credits each result to
    the plan it ran. proposer: the round verifies the prompt-lookup proposer's copies (capped at each row's copy)
    instead of the draft model's candidates, where the pair has both (:class:`~specdec_ext.policies.lookup.CopyOrDraft`)."""

    cap: int
    rule: Optional["StopRule"] = None
    row_caps: Optional[Sequence[int]] = None
    note: object = None
    proposer: bool = False


@dataclass
class RoundResult:
    """What a round did (:meth:`CandidateLengthPolicy.observe`): drafted[b] candidates row b verified, accepted[b] of
    them accepted; steps: draft forwards run (0: a plain step); verified: the width the target verified (candidates
    per row; at most ``steps``); readback: the rule's :meth:`StopRule.readback` values, as host lists; ms: the round's
    wall time (its steps and read-back); cycle_ms: the wall time from the end of the call's previous round to the end
    of this one, the host's work between rounds included (its admissions and the draft's reads of new requests
    excluded): what a round costs where it runs, 0 for a call's first round. Both 0 for a tensor-parallel target,
    whose ranks must decide alike. plan: the :class:`RoundPlan` the round ran (None where the caller gives none:
    the policy's last plan)."""

    drafted: list[int]
    accepted: list[int]
    steps: int = 0
    verified: int = 0
    readback: list = field(default_factory=list)
    ms: float = 0.0
    cycle_ms: float = 0.0
    plan: Optional[RoundPlan] = None


class StopRule:
    """A round's stop decisions, candidate by candidate (:meth:`step`), made by a policy's :meth:`plan`.

    A device rule (the built-in ones) computes its decisions from the tensors of :class:`DraftStep` on the device and
    reads nothing back, so the round stays capturable. A rule with ``host = True`` decides on the host (each step's
    decision is read back). ``needs_hidden`` / ``needs_probs``: :class:`DraftStep` carries the hidden state / the
    draft's probabilities."""

    host = False
    needs_hidden = False
    needs_probs = False

    def begin(self, batch_size: int, device: torch.device) -> None:
        """Start the round's drafting for ``batch_size`` rows."""

    def step(self, info: DraftStep) -> torch.Tensor:
        """``[B]`` bool on the draft's device: rows that stop drafting after this candidate."""
        raise NotImplementedError

    def depth(self, drafted: torch.Tensor, steps: int) -> Optional[torch.Tensor]:
        """After ``steps`` draft steps: how many of its ``drafted[b]`` candidates (``[B]`` int64, device) each row
        verifies, as a ``[B]`` device tensor (None: all). A batch-level verification budget returns fewer."""
        return None

    def readback(self) -> list[torch.Tensor]:
        """Device tensors to read back with the round's tokens (in the round's one read); their host values reach the
        policy in :attr:`RoundResult.readback`, as nested lists of the tensors' shapes."""
        return []

    def capture_key(self) -> Optional[tuple]:
        """A key under which a draft step running this rule can be captured in a CUDA graph and replayed in later
        rounds, or None (the default: the rule runs eagerly, the draft's forward alone replayed). A rule returns a
        key only where :meth:`step` keeps no host state between steps and reads and writes only tensors that
        :meth:`begin` refills in place each round; the key holds every constant the steps bake in and the
        addresses of those tensors, so a replay under an equal key reads what an eager step would."""
        return None

    def written(self) -> list[torch.Tensor]:
        """The tensors :meth:`step` writes in place (a capturable rule's running state): restored after the
        warm-up run that precedes a capture."""
        return []


class _HostRule(StopRule):
    """A policy's per-step interface (``begin_round``, ``should_stop``, ``verify_depth``) as a host rule."""

    host = True

    def __init__(self, policy: "CandidateLengthPolicy"):
        self.policy = policy
        self.needs_hidden = bool(getattr(policy, "needs_hidden", False))
        self.needs_probs = bool(getattr(policy, "needs_probs", False))

    def begin(self, batch_size, device):
        self.policy.begin_round()

    def step(self, info):
        return torch.as_tensor(self.policy.should_stop(info)).to(info.tokens.device, torch.bool)

    def depth(self, drafted, steps):
        n = self.policy.verify_depth(drafted.cpu())
        return None if n is None else n.to(drafted.device)


class CandidateLengthPolicy:
    """Base class. A subclass either plans rounds (:meth:`plan`, :meth:`observe`; the built-in policies), or sets
    ``name`` and ``max_candidates`` and implements ``should_stop`` (the per-step interface, decided on the host)."""

    name = "policy"
    speculative = True      # False: plain target-only decoding
    needs_hidden = False    # True: DraftStep.hidden is needed (per-step interface)
    needs_probs = False     # True: token_prob / probs are needed even when decoding greedily (per-step interface)
    needs_costs = False     # True: configure() must receive the pair's CostModel (policies/costs.py)
    needs_batch_costs = False  # True: configure() receives batch_costs= (BatchCosts) for calls of several rows
    max_candidates = 1      # an upper bound on the candidates per round (K_max)
    # True: plan() may be called for round r + 1 before observe() of round r (overlapped rounds, engine/scheduler.py):
    # observe() credits the plan it is handed (RoundResult.plan), and a plan made without round r's result is sound
    # (only later by a round). False (the default, and every per-step-interface policy): rounds never overlap.
    plans_ahead = False

    def configure(self, sampling, costs=None) -> None:
        """Called once per generation call before ``reset``: the decoding settings
        (:class:`~specdec_ext.engine.SamplingConfig`) and, for ``needs_costs`` policies, the pair's
        :class:`~specdec_ext.policies.costs.CostModel` (and ``batch_costs=`` for ``needs_batch_costs`` policies)."""

    def reset(self, batch_size: int, device: torch.device) -> None:
        """Start a generation call with ``batch_size`` rows."""

    def plan(self, ctx: RoundContext) -> RoundPlan:
        """The round's plan (module docstring). Default: the per-step interface, ``max_candidates`` candidates at most
        and :meth:`should_stop` asked after each on the host; :meth:`draft_round` False makes the round a plain step."""
        if not self.speculative or not self.draft_round(ctx.width):
            return RoundPlan(0)
        return RoundPlan(self.max_candidates, _HostRule(self))

    def observe(self, result: RoundResult) -> None:
        """After the round (module docstring). Default: :meth:`end_round` with the drafted and accepted counts."""
        if type(self).end_round is not CandidateLengthPolicy.end_round:  # the counts as tensors only for an override
            self.end_round(torch.tensor(result.drafted, dtype=torch.int64),
                           torch.tensor(result.accepted, dtype=torch.int64))

    # ---------------------------------------------------------------- the per-step interface
    def draft_round(self, width: int) -> bool:
        """Before a round: whether the live rows draft at all (default: yes). False makes the round one step of
        plain decoding by the target alone (``end_round`` then gets zeros). ``width``: the target's cache width."""
        return True

    def begin_round(self) -> None:
        """Start a draft round for the live rows."""

    def should_stop(self, info: DraftStep) -> torch.Tensor:
        """``[B]`` bool: stop drafting after this candidate. Rows at ``max_candidates`` always stop."""
        raise NotImplementedError

    def verify_depth(self, num_drafted: torch.Tensor) -> Optional[torch.Tensor]:
        """After drafting, before verification: how many of its ``num_drafted[b]`` candidates (``[B]`` int64) each
        row verifies (default: all)."""
        return num_drafted

    def end_round(self, num_drafted: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Feedback after verification: candidates drafted and accepted per row (``[B]`` int64)."""

    # ---------------------------------------------------------------- rows
    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the state of rows ``index`` only, in that order (finished rows leave the batch; the last rows take
        their places)."""

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
