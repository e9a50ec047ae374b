"""SpecDec++'s stop rule over prompt lookup: how many of a match's copied tokens to verify, row by row.

A prompt-lookup round (``engine/lookup.py``) can verify any prefix of the continuation it copied. Copying more is
worth it only while the next copied token is likely enough to be accepted for its verification to pay. SpecDec++
(Huang et al. 2024, Sec. 3) stops drafting when the predicted probability that at least one candidate is rejected
exceeds a stop threshold h; its acceptance head reads the draft's hidden state. A copy has no hidden state, but it
has what predicts its acceptance: the length n of the suffix it matched, the candidate's position t in the copy, and
whether the row's previous copy was accepted whole (a copy that keeps matching tends to go on). The acceptance
head here is a table over those features, learned online from the verifications themselves: candidate t's
conditional acceptance probability

    a(n, s, t) = (accepted + w m) / (tried + w),   m = (accepted over all t + w0 a0) / (tried over all t + w0),

counts of candidates t that were verified after candidates 1 .. t - 1 were accepted, shrunk to the pooled rate m
of the same (n, s) (prior a0 = 0.5, weights w = 4, w0 = 2), kept per decoding mode (greedy, sampled).

With a number h the round verifies candidates up to the first t where 1 - prod_{i <= t} a_i > h (SpecDec++'s rule,
Sec. 3.2). With ``"auto"`` it verifies the j that maximises the expected goodput

    E(j) / T(j),   E(j) = 1 + sum_{i=1..j} prod_{t<=i} a_t,   T(j) = round_ms + j (draft_ms + step_ms) + verify_ms(j+1),

the expected tokens emitted over the round's time priced by the pair's measured costs (``policies/costs.py``; the
emitted-token expectation of Leviathan et al. 2023, Eq. 1, with per-position rates); j = 0 is a plain step. Rows
decide alone (a batch verifies its deepest row's candidates).

:class:`CopyOrDraft` puts the copy beside a draft model: before each round it compares the copy's best expected
goodput with the draft rounds' and runs the round as the better of the two.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Union

from .base import CandidateLengthPolicy, RoundPlan, _check_k
from .costs import CostModel, MeasuredRates

PRIOR, PRIOR_WEIGHT, POOL_WEIGHT = 0.5, 2.0, 4.0
# CopyOrDraft: draft rounds tried (first candidates verified) before a plain step may replace them where nothing is
# copied: with fewer, an unlucky start (the first few drafts rejected) would stop the draft for good
PLAIN_AFTER = 64
# CopyOrDraft at one row: while its measured draft rounds emit fewer tokens per ms than plain steps, one round in this
# many still drafts, so that the measured rate follows a draft that starts to pay
EXPLORE_EVERY = 32


class AcceptanceTable:
    """Online per-feature acceptance counts of copied candidates (module docstring): ``rates(n, streak, L)`` gives
    a(n, s, t) for t = 1 .. L; ``add(n, streak, verified, accepted)`` counts a verified copy."""

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.counts: dict = {}  # (mode, n, streak) -> ([tried per t], [accepted per t])

    def _cell(self, key):
        if key not in self.counts:
            self.counts[key] = ([0] * self.k_max, [0] * self.k_max)
        return self.counts[key]

    def rates(self, key: tuple, length: int) -> list[float]:
        tried, acc = self._cell(key)
        pooled = (sum(acc) + PRIOR_WEIGHT * PRIOR) / (sum(tried) + PRIOR_WEIGHT)
        return [(acc[t] + POOL_WEIGHT * pooled) / (tried[t] + POOL_WEIGHT) for t in range(min(length, self.k_max))]

    def tried(self, key: tuple) -> int:
        """How many first candidates were verified under ``key``."""
        return self.counts[key][0][0] if key in self.counts else 0

    def add(self, key: tuple, verified: int, accepted: int) -> None:
        tried, acc = self._cell(key)
        for t in range(min(verified, accepted + 1, self.k_max)):  # candidates 1 .. accepted + 1 were tried
            tried[t] += 1
            acc[t] += t < accepted


def best_depth(rates: list[float], costs) -> tuple:
    """(j, rate): the candidates j of a round that maximise its expected tokens per ms E(j) / T(j) (module
    docstring), given candidate t's conditional acceptance rate ``rates[t - 1]`` and a :class:`CostModel`
    (``round_time``, ``plain_ms``); j = 0 is a plain step."""
    best, best_rate, tokens = 0, 1.0 / costs.plain_ms(), 1.0
    for j, s in enumerate(_spans(rates), 1):
        tokens += s
        rate = tokens / costs.round_time(j)
        if rate > best_rate:
            best, best_rate = j, rate
    return best, best_rate


class LookupStop(CandidateLengthPolicy):
    """SpecDec++'s stop rule for a prompt-lookup draft (module docstring): per row, the number of copied candidates
    verified this round, from an online acceptance table over (match length, previous copy accepted whole,
    position) and the stop threshold ``threshold`` (a number h in [0, 1], or ``"auto"``: the expected goodput
    priced by the pair's measured costs). At most ``k_max`` candidates a round.

    Raises ValueError for a threshold outside [0, 1] that is not ``"auto"`` or a ``k_max`` below 1."""

    def __init__(self, threshold: Union[float, str] = "auto", k_max: int = 8):
        self.auto = threshold == "auto"
        if not self.auto and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                              or not 0.0 <= threshold <= 1.0):
            raise ValueError(f"threshold: expected a stop threshold h in [0, 1] or 'auto', got {threshold!r}")
        self.threshold = threshold
        self.max_candidates = _check_k("k_max", k_max)
        self.needs_costs = self.auto
        self.name = f"lookup-{'auto' if self.auto else f'h={threshold:g}'}"
        self.table = AcceptanceTable(self.max_candidates)
        self.costs = None
        self.mode = "greedy"
        self.streak: list[bool] = []  # per row: its previous round's copy was accepted whole
        self._planned: Optional[RoundPlan] = None

    def configure(self, sampling, costs=None):
        self.mode = "greedy" if sampling is None or sampling.greedy else "sample"
        if self.auto:
            if costs is None:
                raise ValueError("threshold='auto' needs the pair's CostModel (configure(sampling, costs))")
            self.costs = costs

    def reset(self, batch_size, device):
        self.streak = [False] * batch_size

    def depth(self, rates: list[float]) -> int:
        """The candidates to verify given candidate t's acceptance rate ``rates[t - 1]`` (all the row may copy)."""
        return self.best(rates)[0]

    def best(self, rates: list[float]) -> tuple:
        """(:meth:`depth`, its expected tokens per ms under the costs; 0.0 with a threshold h)."""
        if not rates:
            return 0, 0.0
        if not self.auto:
            spans = _spans(rates)
            for t, s in enumerate(spans, 1):
                if 1.0 - s > self.threshold:
                    return t, 0.0
            return len(spans), 0.0
        return best_depth(rates, self.costs)

    def plan(self, ctx):
        matches = list(ctx.matches) or [0] * ctx.batch_size
        keys, caps = [], []
        for room, n, streak in zip(ctx.room, matches, self.streak):
            key = (self.mode, n, streak)
            keys.append(key)
            caps.append(self.depth(self.table.rates(key, room)) if n > 0 and room > 0 else 0)
        self._planned = RoundPlan(max(caps, default=0), row_caps=caps, note=keys)
        return self._planned

    def observe(self, result):
        plan = result.plan if result.plan is not None else self._planned
        keys = plan.note if plan is not None else None
        for b, (d, a) in enumerate(zip(result.drafted, result.accepted)):
            if keys is not None and d > 0:
                self.table.add(keys[b], d, a)
            if b < len(self.streak):
                self.streak[b] = d > 0 and a >= d

    def select_rows(self, index):
        self.streak = [self.streak[i] for i in index.tolist()]

    def add_rows(self, n):
        self.streak = self.streak + [False] * n

    def describe(self) -> str:
        return self.name


class CopyOrDraft(CandidateLengthPolicy):
    """Per round, prompt lookup's copy or a draft model's candidates: whichever promises more tokens per ms.

    A copy is worth a great deal where the output repeats its context and nothing elsewhere; a draft model predicts
    the text a copy cannot. Before each round this policy compares the copy's expected goodput (:class:`LookupStop`'s
    acceptance table at the rows' matches, priced without draft forwards) with the draft's (its rounds' acceptance by
    position, counted online, priced by the pair's measured costs), and runs the round as a copy round (the plan's
    ``proposer``), as ``draft``'s round (any policy: its own plan and stop rule), or, where nothing is copied and the
    draft's rounds (at least :data:`PLAIN_AFTER` of them) do not pay for their steps, as a plain step. The batch
    decides together (mean goodput over the live rows). Each sub-policy learns only from the rounds it planned.

    At one row the draft's rounds are also priced as they ran: where, over at least :data:`PLAIN_AFTER` of them,
    they emitted fewer tokens per ms of measured cycle (:class:`~specdec_ext.policies.costs.MeasuredRates`)
    than plain steps do (their measured cycle, else the profile's), a round copies where a copy pays and otherwise
    takes a plain step, drafting once in :data:`EXPLORE_EVERY` rounds to keep the measure current (kept from call to
    call; :meth:`reset_adaptation` forgets it). The pair's profile prices a verification and a round's bookkeeping
    as measured once (with a 4-bit SmolLM2-135M on a 2-core Xeon, a K = 1 verification as one step), so a draft
    accepting 16% of its candidates looked like it paid while its rounds ran below plain decoding's rate (this rule
    is what ``threshold="auto"``'s own plain fallback does).

    Args: draft: the policy of the draft model's rounds. copy: the copy rounds' :class:`LookupStop` (default
    ``LookupStop("auto")``, which needs the pair's costs: so does this policy).

    Raises TypeError for a ``copy`` that is not a LookupStop or a ``draft`` that does not draft."""

    plans_ahead = False
    needs_costs = True

    def __init__(self, draft: CandidateLengthPolicy, copy: Optional[LookupStop] = None):
        copy = LookupStop("auto") if copy is None else copy
        if not isinstance(copy, LookupStop):
            raise TypeError(f"copy: expected a LookupStop, got {type(copy).__name__}")
        if not isinstance(draft, CandidateLengthPolicy) or not draft.speculative or isinstance(draft, LookupStop):
            raise TypeError(f"draft: expected the policy of a draft model's rounds, got {draft!r}")
        self.copy, self.draft = copy, draft
        self.name = f"copy-or-draft({copy.describe()}, {draft.describe()})"
        self.max_candidates = max(copy.max_candidates, draft.max_candidates)
        self.needs_batch_costs = bool(getattr(draft, "needs_batch_costs", False))
        self.drafted = AcceptanceTable(min(draft.max_candidates, 32))  # the draft rounds' acceptance by position
        self.copy_costs = self.pair_costs = None
        self._planned: Optional[RoundPlan] = None
        self.rates = MeasuredRates()  # the draft's rounds and plain steps at one row, as measured (class docstring)
        self.since_draft = 0  # rounds since the last draft round

    def draft_pays(self) -> bool:
        """Whether the draft's rounds, as measured, emit at least as many tokens per ms as plain steps (True until
        :data:`PLAIN_AFTER` of them were measured)."""
        return self.rates.rounds < PLAIN_AFTER or not self.rates.slower_than_plain(self.pair_costs.plain_ms())

    @property
    def needs_hidden(self) -> bool:
        return bool(getattr(self.draft, "needs_hidden", False))

    @property
    def needs_probs(self) -> bool:
        return bool(getattr(self.draft, "needs_probs", False))

    def configure(self, sampling, costs=None, batch_costs=None):
        if costs is None:
            raise ValueError("CopyOrDraft needs the pair's CostModel (configure(sampling, costs))")
        self.pair_costs = costs
        self.copy_costs = CostModel(costs.verify_ms, 0.0, 0.0, costs.round_ms, costs.meta)  # no draft forward
        self.copy.configure(sampling, self.copy_costs)
        given = costs if self.draft.needs_costs else None
        if self.needs_batch_costs:
            self.draft.configure(sampling, given, batch_costs=batch_costs)
        else:
            self.draft.configure(sampling, given)

    def reset(self, batch_size, device):
        self.copy.reset(batch_size, device)
        self.draft.reset(batch_size, device)

    def reset_adaptation(self) -> None:
        """Forget the measured rates, kept from call to call (a call of 64 tokens is shorter than the
        :data:`PLAIN_AFTER` rounds they need), and what the draft's policy learned across calls."""
        self.rates.reset()
        self.since_draft = 0
        if hasattr(self.draft, "reset_adaptation"):
            self.draft.reset_adaptation()

    def plan(self, ctx):
        copies = list(ctx.copies) or [0] * ctx.batch_size
        cctx = replace(ctx, room=[min(r, c) for r, c in zip(ctx.room, copies)])
        rates = []
        for room, n, streak in zip(cctx.room, list(ctx.matches) or [0] * ctx.batch_size, self.copy.streak):
            key = (self.copy.mode, n, streak)
            rates.append(best_depth(self.copy.table.rates(key, room), self.copy_costs)[1] if n and room else
                         1.0 / self.copy_costs.plain_ms())
        deepest = max(ctx.room, default=0)
        depth, draft_rate = best_depth(self.drafted.rates(("draft", self.copy.mode), deepest), self.pair_costs)
        # at one row, the draft's rounds as measured against plain steps (class docstring)
        slow = ctx.batch_size == 1 and not self.draft_pays() and self.since_draft + 1 < EXPLORE_EVERY
        if any(copies) and (slow or sum(rates) / len(rates) >= draft_rate):
            plan = self.copy.plan(cctx)
            self._planned = RoundPlan(plan.cap, plan.rule, plan.row_caps, ("copy", plan), proposer=True)
        elif slow or (depth == 0 and self.drafted.tried(("draft", self.copy.mode)) >= PLAIN_AFTER):
            self._planned = RoundPlan(0, note=("plain", None))  # the draft's rounds have not paid for their steps
        else:
            plan = self.draft.plan(ctx)
            self._planned = RoundPlan(plan.cap, plan.rule, plan.row_caps, ("draft", plan))
        return self._planned

    def observe(self, result):
        plan = result.plan if result.plan is not None else self._planned
        source, inner = plan.note if plan is not None and isinstance(plan.note, tuple) else ("draft", None)
        self.since_draft = 0 if source == "draft" else self.since_draft + 1
        ms, rows = result.cycle_ms, len(result.accepted)
        if source == "copy":
            self.copy.observe(replace(result, plan=inner))
            return
        self.copy.streak = [False] * len(self.copy.streak)
        if source == "plain":
            if rows == 1:
                self.rates.add_plain(ms)
            return
        if rows == 1:
            self.rates.add_round(sum(result.accepted) + rows, ms)
        self.draft.observe(replace(result, plan=inner))
        if result.steps:
            for d, a in zip(result.drafted, result.accepted):
                if d:
                    self.drafted.add(("draft", self.copy.mode), d, a)

    def select_rows(self, index):
        self.copy.select_rows(index)
        self.draft.select_rows(index)

    def add_rows(self, n):
        self.copy.add_rows(n)
        self.draft.add_rows(n)

    def describe(self) -> str:
        return self.name


def _spans(rates: list[float]) -> list[float]:
    """P(candidates 1 .. t all accepted) from each candidate's conditional rate."""
    out, s = [], 1.0
    for a in rates:
        s *= a
        out.append(s)
    return out
