"""The scheduler: requests in slots, their prefills, and the rounds that serve them.

Each live request has a slot in both models' caches (:mod:`~specdec_ext.engine.backends`), the live rows being slots
``0 .. B - 1``; the host keeps each row's context (prompt and generated tokens), how much of it each cache holds,
its limit and its round count. Before a round the policy plans it (:meth:`~specdec_ext.policies.CandidateLengthPolicy.plan`);
the round runs as fixed-shape steps with one read-back (:class:`~specdec_ext.engine.round.StepRunner`); the host then
appends each row's emitted tokens, cut at its ``max_new_tokens`` and at EOS, streams them, and lets finished rows
go: the last live rows take their slots (the caches move only those rows), and queued requests take the free slots
after them (continuous batching), their prompts prefilled into those slots by the target.

The draft reads a request's context when the request first drafts (a request served by plain steps alone, as under
the verification budget where speculation does not pay, never costs a draft read), and after plain steps the tokens
they committed, both before the round and outside its time. Its cache holds a row's context but its last token,
which each round feeds again beside the new one.

Queued requests join as ``admission=`` says (``engine/admission.py``: eager, ahead from a staging cache, grouped).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from ..policies.base import RoundContext, RoundPlan, RoundResult
from .admission import AdmissionRule
from .cache import check_fits
from .kv_cache import compaction
from .processor import HostProcessor
from .steps import RoundInputs
from .sampling import RowSampling, SamplingConfig
from .stats import GenerationStats, RoundStats

# admission="ahead": the most requests the target prefills together ahead of their admission. On the bundled pair
# in bf16 (2-core Intel Xeon with AMX, HumanEval prompts) a prefill's cost per prompt token was lowest in groups of
# 8-16 (100-130 us) and higher in groups of 1-2 (130-160 us) and 32-64 (130-180 us).
AHEAD_ROWS = 16


@dataclass
class Request:
    """A request: ``prompt`` token ids, at most ``limit`` new tokens, Philox ``seed``, ``sampling`` settings;
    ``base``: the prefix a logits processor sees before the generated tokens (the prompt as given, padding
    included, as transformers gives it), None without a processor."""

    prompt: list
    limit: int
    seed: int
    sampling: SamplingConfig
    base: Optional[list] = None
    arrival_ms: float = 0.0  # when the request arrives, in ms of the call's clock (queued requests wait for it)


@dataclass
class Row:
    """A live request's host state: ``ctx`` its context (prompt, then generated tokens); ``rounds`` the rounds it
    took part in (its Philox offset); the draft holds ``ctx[draft_from:draft_to]`` (``draft_from`` None: unread);
    ``lookup``: a prompt-lookup draft's n-gram index of ``ctx`` (``engine/lookup.py``), made at its first round."""

    req: int
    ctx: list
    prompt_len: int
    rounds: int = 0
    draft_from: Optional[int] = None
    draft_to: int = 0
    lookup: Optional[object] = None

    @property
    def generated(self) -> int:
        return len(self.ctx) - self.prompt_len


@dataclass
class Measured:
    """What the scheduler measured that later rounds and calls decide from, carried by the generator from call to
    call: the draft's reads of requests' contexts (``read_ms`` in all over ``read_rows`` requests: what drafting adds
    outside the rounds, :meth:`Scheduler._draft_overhead`) and continuous batching's admissions ``(rows, prompt tokens,
    ms)``, the last :attr:`AdmissionRule.MAX_POINTS` (its fit). A call starts from a copy and returns its own."""

    read_ms: float = 0.0
    read_rows: int = 0
    admissions: list = field(default_factory=list)

    def copy(self) -> "Measured":
        return Measured(self.read_ms, self.read_rows, list(self.admissions))


@dataclass
class ContinuousOutput:
    """What :meth:`SpeculativeGenerator.generate_continuous` returns. new_tokens: each request's generated
    token ids, in the order of the prompts; admitted_ms / finished_ms: per request, ms from the call's
    start to the start of its prefill and to the end of its last round; stats: :class:`GenerationStats` of
    the whole call (``RoundStats.rows`` hold request indices); arrival_ms: per request, when it arrived;
    token_ms: per request, when each of its tokens was emitted (the end of the round that emitted it). Times are
    on the call's clock: ms since its start, plus the idle time skipped while no request had arrived (nothing
    sleeps; ``generate_continuous(arrival_ms=...)``)."""

    new_tokens: list[list[int]]
    admitted_ms: list[float]
    finished_ms: list[float]
    stats: GenerationStats
    arrival_ms: list = None
    token_ms: list = None
    measured: Optional[Measured] = None  # what the call measured, with what earlier calls had (Measured)

    def tokens_per_s(self) -> list[float]:
        """Per request: its tokens over the time from its admission to its last round (tokens/s)."""
        return [len(t) / ((f - a) / 1e3) if f > a else 0.0
                for t, a, f in zip(self.new_tokens, self.admitted_ms, self.finished_ms)]


@dataclass
class Settings:
    """A run's settings: the end-of-sequence ids, the streamer (one request), the logits processor, the admission
    mode, ``early_exit`` (:class:`~specdec_ext.engine.round.StepRunner`), the draft's context window, whether requests
    join mid-call (continuous batching), whether the rounds are timed for the policy (not for a tensor-parallel
    target, whose ranks must decide alike), the draft's parameters over the target's (the estimate of a draft read
    before one was measured; None: unknown), and whether rounds may overlap the host (``Scheduler._overlaps``)."""

    eos: set
    streamer: object = None
    processor: Optional[Callable] = None
    admission: str = "eager"
    early_exit: Union[bool, frozenset, str] = True
    draft_context: Optional[int] = None
    continuous: bool = False
    timed: bool = True
    draft_share: Optional[float] = None
    overlap: bool = False


class Scheduler:
    """Serves ``requests`` with at most ``batch_size`` live, through backends ``target`` and ``draft`` (None for plain
    decoding), the step ``runner`` (:class:`~specdec_ext.engine.round.StepRunner`) and ``policy`` (module docstring),
    the target's vocabulary having ``vocab`` ids. ``measured``: what earlier calls measured (:class:`Measured`; the run
    works on a copy and returns it in its output)."""

    def __init__(self, runner, policy, target, draft, requests: list, batch_size: int, settings: Settings, vocab: int,
                 measured: Optional[Measured] = None, staging: Optional[tuple] = None, proposer=None):
        self.runner, self.pol, self.target, self.draft, self.vocab = runner, policy, target, draft, vocab
        # the prompt-lookup backend: the draft itself (draft="ngram"), or beside a draft model (lookup=True), or None
        self.proposer = proposer if proposer is not None else (draft if getattr(draft, "proposes", False) else None)
        self.requests, self.batch_size, self.set = requests, batch_size, settings
        self.stats = GenerationStats(policy=policy.describe(), batch_size=batch_size)
        self.measured = (measured or Measured()).copy()
        self.rule = AdmissionRule(settings.admission == "grouped", self.measured.admissions) \
            if settings.continuous else None
        self.queue = list(range(len(requests)))
        self.live: list[Row] = []
        self.tokens: list = [[] for _ in requests]
        self.admitted_ms = [0.0] * len(requests)
        self.finished_ms = [0.0] * len(requests)
        self.staging = staging  # (target, draft) backends of admission="ahead", or None
        self.staged: list = []  # [(request, staging row, draft read?)] prefilled ahead, in order
        self._sampling = None
        self.t_start = time.perf_counter()
        self.skipped_ms = 0.0  # idle time skipped while no request had arrived (the clock jumps, nothing sleeps)
        self._cycle: Optional[tuple] = None  # (perf_counter, prefill ms) at the last round's end (RoundResult.cycle_ms)
        self.token_ms: list = [[] for _ in requests]

    def _ms(self, t: Optional[float] = None) -> float:
        """The call's clock at ``t`` (perf_counter seconds; now by default): ms since the start, plus skipped idle."""
        return ((time.perf_counter() if t is None else t) - self.t_start) * 1e3 + self.skipped_ms

    def _arrived(self) -> int:
        """How many of the queue's first requests have arrived (the queue is in arrival order: a binary search, as
        it runs every round)."""
        return bisect.bisect_right(self.queue, self._ms(), key=lambda r: self.requests[r].arrival_ms)

    def _skip_to_arrival(self) -> None:
        """No request live and none arrived: the clock jumps to the next arrival."""
        if self.queue and not self._arrived():
            self.skipped_ms += self.requests[self.queue[0]].arrival_ms - self._ms()

    # ------------------------------------------------------------------------ the run
    def run(self) -> ContinuousOutput:
        self._skip_to_arrival()
        n = min(self.batch_size, self._arrived())
        columns = max(len(r.prompt) + r.limit for r in self.requests)
        slots = self.runner.bucket(self.batch_size)
        starts = [(b, slots) for b in (self.target, self.draft) if b is not None]
        starts += [(b, min(self.batch_size, AHEAD_ROWS)) for b in self.staging or () if b is not None]
        needed: dict = {}
        for b, rows in starts:  # refused before anything is allocated or prefilled
            needed[b.device] = needed.get(b.device, 0) + b.new_bytes(rows, columns)
        check_fits(needed)
        for b, rows in starts:
            b.start(rows, columns)
        self.pol.reset(n, self.draft.device if self.draft is not None else self.target.device)
        self._admit(n, first=True)
        ahead: Optional[_Flight] = None  # a round launched before the one before it was read (overlapped rounds)
        while self.live or self.queue or self.staged:
            if not self.live:  # idle: the next requests join once they arrive
                self._skip_to_arrival()
                self._admit(min(self.batch_size, self._arrived() + len(self.staged)))
                continue
            flight = ahead or self._launch()
            ahead = self._launch_ahead(flight)
            done = self._finish(flight)
            if ahead is not None:
                if not done:
                    continue  # the same rows go on: nothing leaves or joins while a round is in flight
                done = sorted(set(done) | set(self._finish(ahead, set(done))))  # their tokens of it are dropped
                ahead = None
            free = self.batch_size - (len(self.live) - len(done))
            waiting = self._arrived() + len(self.staged)
            take = min(free, waiting)
            if take and (self.rule is None or self.rule.ready(
                    self.batch_size - len(self.live), waiting, len(self.live) - len(done), self.batch_size,
                    self.stats.rounds[-1].total_ms)):
                self._leave(done)
                self._admit(take)
            elif done:
                self._leave(done)
        self.stats.wall_ms = (time.perf_counter() - self.t_start) * 1e3
        for b in (self.target, self.draft):
            if b is not None:
                b.close()
        return ContinuousOutput(self.tokens, self.admitted_ms, self.finished_ms, self.stats,
                                [r.arrival_ms for r in self.requests], self.token_ms, self.measured)

    # ------------------------------------------------------------------------ rows
    def _leave(self, done: list) -> None:
        """Rows ``done`` (positions) leave: the last live rows take their slots."""
        if not done:
            return
        order = compaction(len(self.live), done)
        self.live = [self.live[i] for i in order]
        self.target.select(order, [len(r.ctx) - 1 for r in self.live])
        if self.draft is not None:
            self.draft.select(order, [self._draft_columns(r) for r in self.live])
        self.pol.select_rows(torch.tensor(order, dtype=torch.int64))

    @staticmethod
    def _draft_columns(row: Row) -> int:
        return 0 if row.draft_from is None else row.draft_to - row.draft_from

    def _admit(self, count: int, first: bool = False) -> None:
        """The queue's next ``count`` requests join the batch in the slots after the live rows: prefilled by the
        target there (the longest first, so each group of similar length fills consecutive slots), or taken from
        the staging caches (admission="ahead", after the first fill)."""
        t0 = time.perf_counter()
        self._reserve(len(self.live) + count)
        if self.staging is None or first:
            ids = sorted(self.queue[:count], key=lambda r: -len(self.requests[r].prompt))
            del self.queue[:count]
            rows = [Row(r, list(self.requests[r].prompt), len(self.requests[r].prompt)) for r in ids]
            slots = list(range(len(self.live), len(self.live) + len(rows)))
            self.target.append(slots, [r.ctx[:-1] for r in rows], [0] * len(rows))
            self.stats.prefill_ms += (time.perf_counter() - t0) * 1e3
            self._observe_admission(ids, t0)
        else:
            rows = self._from_staging(count)
        for r in rows:
            self.admitted_ms[r.req] = self._ms(t0)
        self.live += rows
        if not first:
            self.pol.add_rows(len(rows))
            self.stats.admissions += 1

    def _reserve(self, slots: int) -> None:
        """Room in both caches for ``slots`` rows of every live and queued request's length."""
        cols = max(len(self.requests[r].prompt) + self.requests[r].limit for r in
                   [row.req for row in self.live] + self.queue + [s[0] for s in self.staged])
        for b in (self.target, self.draft):
            if b is not None:
                b.reserve(slots, cols, len(self.live))

    def _from_staging(self, count: int) -> list:
        """admission="ahead": ``count`` requests from the staging caches, the next group staged when they run dry."""
        st_target, st_draft = self.staging
        rows, at = [], len(self.live)
        while len(rows) < count:
            if not self.staged:
                self._stage(count - len(rows))
            k = min(count - len(rows), len(self.staged))
            part, self.staged = self.staged[:k], self.staged[k:]
            slots = list(range(at + len(rows), at + len(rows) + k))
            self.target.take(slots, st_target, [s for _, s, _ in part],
                             [len(self.requests[r].prompt) - 1 for r, _, _ in part])
            read = [(slot, s, d) for slot, (_, s, d) in zip(slots, part) if d is not None]
            if read and self.draft is not None:
                self.draft.take([x for x, _, _ in read], st_draft, [s for _, s, _ in read],
                                [d[1] - d[0] for _, _, d in read])
            for r, _, d in part:
                row = Row(r, list(self.requests[r].prompt), len(self.requests[r].prompt))
                if d is not None:
                    row.draft_from, row.draft_to = d
                rows.append(row)
        return rows

    def _stage(self, need: int) -> None:
        """Prefill the queue's next ``max(need, min(batch_size, AHEAD_ROWS))`` requests into the staging caches (the
        draft's too while the batch drafts), the longest first."""
        st_target, st_draft = self.staging
        take = min(max(need, min(self.batch_size, AHEAD_ROWS)), max(need, self._arrived()))  # arrived ones only
        fifo = self.queue[:take]
        group = sorted(fifo, key=lambda r: -len(self.requests[r].prompt))  # staging slots: the longest first
        del self.queue[:take]
        t0 = time.perf_counter()
        prompts = [self.requests[r].prompt for r in group]
        columns = max(len(p) + self.requests[r].limit for p, r in zip(prompts, group))
        for b in self.staging:
            if b is not None:
                b.start(len(group), columns)
        st_target.append(list(range(len(group))), [p[:-1] for p in prompts], [0] * len(group))
        self.stats.prefill_ms += (time.perf_counter() - t0) * 1e3
        self._observe_admission(group, t0)
        reads = [None] * len(group)
        if st_draft is not None and self.draft is not None and _drafting(self.stats.rounds):
            t1 = time.perf_counter()
            spans = [self._window(len(p)) for p in prompts]
            st_draft.append(list(range(len(group))), [p[a:b] for p, (a, b) in zip(prompts, spans)], [0] * len(group))
            self._count_read(t1, len(group))
            reads = spans
        slot = {r: i for i, r in enumerate(group)}
        self.staged = [(r, slot[r], reads[slot[r]]) for r in fifo]  # they join in the queue's order

    def _observe_admission(self, ids: list, t0: float) -> None:
        """Record a continuous batch's admission of requests ``ids`` that began at ``t0`` (its rows, prompt tokens and
        ms): the admission rule's fit, and the engine's estimate of a draft read before one is measured."""
        if self.rule is not None:  # continuous batching: the rule records into the measured admissions
            tokens = sum(len(self.requests[r].prompt) for r in ids)
            self.rule.observe(len(ids), tokens, (time.perf_counter() - t0) * 1e3)

    def _window(self, length: int) -> tuple:
        """The span ``(from, to)`` of a context of ``length`` tokens the draft reads first: all of it but the last two
        tokens (each round feeds those), or with ``draft_context`` W what of them lies in the context's last W
        tokens (the draft then sees at most max(W, 2) tokens of it)."""
        to = max(0, length - 2)
        w = self.set.draft_context
        return (0 if w is None else min(to, max(0, length - w)), to)

    def _count_read(self, t0: float, requests: int) -> float:
        ms = (time.perf_counter() - t0) * 1e3
        self.stats.prefill_ms += ms
        self.stats.draft_prefill_ms += ms
        if requests:
            self.measured.read_ms += ms
            self.measured.read_rows += requests
        return ms

    def _draft_overhead(self, live: list) -> float:
        """ms per emitted token that drafting adds outside the rounds (``RoundContext.draft_overhead``): the draft's
        measured mean ms to read a request's context (over this generator's calls) over the tokens a request emits (the
        requests' mean ``max_new_tokens``), while reads are still to come (a live row unread, or requests queued); else
        0. Before any read was measured, the target's measured mean prefill ms per request
        (continuous batching's admissions) times the draft's share of the pair's parameters, and 0 without either
        (docs/design.md, The batch verification budget). 0 where the rounds are not timed (a tensor-parallel target,
        whose ranks decide alike)."""
        if not self.set.timed or not (any(r.draft_from is None for r in live) or self.queue or self.staged):
            return 0.0
        mean_limit = sum(r.limit for r in self.requests) / len(self.requests)
        m = self.measured
        if m.read_rows:
            return m.read_ms / m.read_rows / mean_limit
        if not m.admissions or self.draft is None or self.set.draft_share is None:
            return 0.0
        per_request = sum(ms for _, _, ms in m.admissions) / max(1, sum(rows for rows, _, _ in m.admissions))
        return per_request * self.set.draft_share / mean_limit

    def _draft_reads(self, live: list) -> float:
        """ms the draft would spend reading the live rows it has not read if this round drafted: the measured mean
        ms per request times those rows (0 before any read was measured, and where the rounds are not timed)."""
        m = self.measured
        if not self.set.timed or not m.read_rows:
            return 0.0
        return m.read_ms / m.read_rows * sum(r.draft_from is None for r in live)

    def _catch_up(self) -> None:
        """Before a round that drafts: the draft reads each unread row's context and the tokens plain steps
        committed since it last drafted (all but each context's last two tokens)."""
        unread = [i for i, r in enumerate(self.live) if r.draft_from is None]
        if unread:
            t0 = time.perf_counter()
            spans = [self._window(len(self.live[i].ctx)) for i in unread]
            self.draft.append(unread, [self.live[i].ctx[a:b] for i, (a, b) in zip(unread, spans)], [0] * len(unread))
            for i, (a, b) in zip(unread, spans):
                self.live[i].draft_from, self.live[i].draft_to = a, b
            self._count_read(t0, len(unread))
        behind = [i for i, r in enumerate(self.live) if r.draft_to < len(r.ctx) - 2]
        if behind:
            t0 = time.perf_counter()
            rows = [self.live[i] for i in behind]
            self.draft.append(behind, [r.ctx[r.draft_to: len(r.ctx) - 2] for r in rows],
                              [self._draft_columns(r) for r in rows])
            for r in rows:
                r.draft_to = len(r.ctx) - 2
            self.stats.draft_deferred_ms += self._count_read(t0, 0)

    # ------------------------------------------------------------------------ a round
    def _room(self, row: Row) -> int:
        return 0 if len(row.ctx) < 2 else self.requests[row.req].limit - row.generated - 1

    def _propose(self, room: list) -> list:
        """The prompt-lookup proposer (``engine/lookup.py``): each live row's candidates from its context, set for
        the round; returns each row's room capped at its candidates' count (:meth:`LookupBackend.propose`)."""
        t0 = time.perf_counter()
        for r in self.live:
            if r.lookup is None:
                r.lookup = self.proposer.proposer.new_state()
        room = self.proposer.propose([(r.lookup, r.ctx) for r in self.live], room)
        self.stats.draft_forward_ms += (time.perf_counter() - t0) * 1e3
        return room

    def _plan(self, room: Optional[list], width: int, copies: Optional[list] = None) -> tuple:
        """The policy's plan for the live rows (``room``: each row's cap, None for a policy that never drafts;
        ``width``: the target cache's widest row; ``copies``: each row's prompt-lookup copy, where the pair has a
        proposer) and the round's depth: ``(cap, plan)``; a plan on the proposer's copies is capped at them."""
        if not self.pol.speculative:
            return 0, RoundPlan(0)
        live = self.live
        left = {self.requests[r.req].limit - r.generated for r in live}
        matched = self.proposer.matched if self.proposer is not None else ()
        plan = self.pol.plan(RoundContext(len(live), width, room, self._draft_overhead(live), self._draft_reads(live),
                                          self.set.continuous and len(live) > 1 and len(left) == 1,
                                          self.set.early_exit, matched, copies or ()))
        room = copies if plan.proposer else room
        caps = room if plan.row_caps is None else [min(a, c) for a, c in zip(room, plan.row_caps)]
        return max(0, min(plan.cap, max(caps))), plan

    def _launch(self) -> "_Flight":
        """Plan a round from the host's state, catch the draft up, and launch it."""
        room = [self._room(r) for r in self.live] if self.pol.speculative else None
        copies = self._propose(room) if room is not None and self.proposer is not None else None
        if copies is not None and self.proposer is self.draft:  # draft="ngram": the copies are the candidates
            room = copies
        cap, plan = self._plan(room, max(len(r.ctx) for r in self.live) - 1, copies)
        if cap > 0 and not plan.proposer:
            self._catch_up()
        t0 = time.perf_counter()
        inp = self._inputs(cap > 0, copies if plan.proposer else room)
        return self._enqueue(cap, plan, inp, t0)

    def _enqueue(self, cap: int, plan: RoundPlan, inp: RoundInputs, t0: float) -> "_Flight":
        drafter = None if cap == 0 else self.proposer if plan.proposer else self.draft
        launched = self.runner.launch(drafter, self.target, inp,
                                      RoundPlan(cap, plan.rule, plan.row_caps), self.set.early_exit,
                                      stage=self._overlaps())
        return _Flight(launched, cap, plan, t0)

    def _overlaps(self) -> bool:
        """Whether the next round may be launched before this one is read (overlapped rounds, SGLang's overlap
        scheduler): asked for (``Settings.overlap``), rounds over a bucket's persistent inputs (CUDA graphs) with
        the draft on the target's device, no host logits processor (it reads each round's tokens), and a policy
        that plans ahead (:attr:`~specdec_ext.policies.CandidateLengthPolicy.plans_ahead`)."""
        return (self.set.overlap and self.runner.buckets is not None and self.set.processor is None
                and self.proposer is None  # a proposer reads the host's contexts before a round
                and (self.draft is None or self.draft.device == self.target.device) and self.pol.plans_ahead)

    def _launch_ahead(self, flight: "_Flight") -> Optional["_Flight"]:
        """The round after ``flight``, launched before ``flight`` is read, its inputs written on the device
        (:meth:`StepRunner.advance`), where rounds overlap (:meth:`_overlaps`) and nothing else must happen between
        them: no queued request that could join (a free slot and one waiting), and where the policy drafts, a
        drafting ``flight`` (the draft has read every row; after plain steps it reads their tokens first, on the
        host), and no row whose context is one token. The plan sees each row's room after ``flight`` at most (one
        token fewer than :meth:`_room`): the round drafts at least as deep as with the exact rooms, and the device
        caps each row at its exact room, so a row's candidates are the same. Rows that finish in ``flight`` (EOS,
        or their limit) are seen a round late: their tokens of this round are dropped. The widths given are upper
        bounds (the bucketed steps read the whole cache). None where the rounds do not overlap."""
        if flight.launched.staged is None or not self._overlaps():
            return None
        if self.pol.speculative and not flight.cap:
            return None
        live = self.live
        if len(live) < self.batch_size and (self._arrived() or self.staged):
            return None
        if any(len(r.ctx) < 2 for r in live):  # a one-token context drafts from its second round (the host's room)
            return None
        room = [self.requests[r.req].limit - r.generated - 2 for r in live] if self.pol.speculative else None
        width = max(len(r.ctx) for r in live) + flight.cap  # the target's widest row after flight, at most
        cap, plan = self._plan(room, width)
        t0 = time.perf_counter()
        draws = cap > 0 or not self._sampling[1].greedy
        last, prev, room_t, _, seeds = self.runner.advance(flight.launched, cap > 0, draws)
        inp = RoundInputs(last, prev, room_t, None, self._sampling[1], self._sampling[2], seeds, width,
                          max(self._draft_columns(r) for r in live) + flight.cap + 1)
        return self._enqueue(cap, plan, inp, t0)

    def _finish(self, flight: "_Flight", dropped: frozenset = frozenset()) -> list:
        """Read a launched round, let the policy observe it, append what each row emitted (none for the rows in
        ``dropped``, which finished in the round before); returns the positions of rows that finished."""
        out = self.runner.read(flight.launched)
        t1 = time.perf_counter()
        live, cap, plan = self.live, flight.cap, flight.plan
        B = len(live)
        # the round's time: its steps and read-back (what the budget measures), from its launch or, where it was
        # launched before the last round was read (overlapped), from that read
        ms = (t1 - (flight.t0 if self._cycle is None else max(flight.t0, self._cycle[0]))) * 1e3
        cycle = 0.0 if self._cycle is None else (t1 - self._cycle[0]) * 1e3 - (self.stats.prefill_ms - self._cycle[1])
        if self.pol.speculative:
            timed = self.set.timed  # a tensor-parallel target's ranks must decide alike: no times
            self.pol.observe(RoundResult(out.drafted, out.accepted, out.steps, out.verified, out.readback,
                                         ms if timed else 0.0, max(cycle, 0.0) if timed else 0.0, plan))
        self._cycle = (t1, self.stats.prefill_ms)
        kept = [b not in dropped for b in range(B)]
        rs = RoundStats([d if k else 0 for d, k in zip(out.drafted, kept)],
                        [a if k else 0 for a, k in zip(out.accepted, kept)], [0] * B, out.draft_ms, out.verify_ms, ms,
                        [r.req for r in live])
        self.stats.rounds.append(rs)
        draft_calls, draft_s, target_calls, target_s = out.counted  # forwards the backends did not count
        self.stats.draft_calls += draft_calls
        self.stats.draft_forward_ms += draft_s * 1e3
        self.stats.target_calls += target_calls
        self.stats.target_forward_ms += target_s * 1e3
        emitted_at = self._ms()  # the round's tokens reach the host now
        done = []
        for b, row in enumerate(live):
            if not kept[b]:
                continue
            req = self.requests[row.req]
            toks = out.tokens[b][: req.limit - row.generated]
            for j, t in enumerate(toks):
                if t in self.set.eos:
                    toks = toks[: j + 1]
                    break
            row.ctx += toks
            row.rounds += 1
            if cap > 0 and not plan.proposer:  # after a round of copies the draft model reads them later
                row.draft_to = len(row.ctx) - 2
                if row.draft_from is None:
                    row.draft_from = 0
            self.tokens[row.req] += toks
            self.token_ms[row.req] += [emitted_at] * len(toks)
            rs.emitted[b] = len(toks)
            self.stats.new_tokens += len(toks)
            if self.set.streamer is not None and toks:
                self.set.streamer.put(torch.tensor(toks))
            if row.generated >= req.limit or (toks and toks[-1] in self.set.eos):
                done.append(b)
                self.finished_ms[row.req] = emitted_at
        return done

    def _inputs(self, drafting: bool, room: Optional[list]) -> RoundInputs:
        """The round's per-row inputs from the host state (``room``: each row's cap, when it drafts)."""
        live = self.live
        tdev = self.target.device
        ddev = self.draft.device if self.draft is not None else tdev
        cfgs = tuple(self.requests[r.req].sampling for r in live)
        if self._sampling is None or self._sampling[0] != cfgs:
            V = self.vocab
            self._sampling = (cfgs, RowSampling.of(list(cfgs), V, tdev), RowSampling.of(list(cfgs), V, ddev))
        single = [len(r.ctx) < 2 for r in live] if drafting else None
        draws = drafting or not self._sampling[1].greedy  # greedy plain steps draw nothing
        last, prev, room_t, extra, seeds = self.runner.row_inputs(
            [r.ctx[-1] for r in live], [r.ctx[-2] if len(r.ctx) > 1 else r.ctx[-1] for r in live] if drafting else None,
            room if drafting else None, single, [(self.requests[r.req].seed, r.rounds) for r in live] if draws else None,
            tdev, ddev)
        processor = None
        if self.set.processor is not None:
            bases = [self.requests[r.req].base + r.ctx[r.prompt_len:] for r in live]
            processor = HostProcessor(self.set.processor, bases)
        tlen = {len(r.ctx) - 1 for r in live}
        dlen = {self._draft_columns(r) for r in live} if drafting else {0}
        return RoundInputs(last, prev, room_t, extra, self._sampling[1], self._sampling[2], seeds, max(tlen), max(dlen),
                           processor,
                           tlen.pop() if len(tlen) == 1 else None, dlen.pop() if len(dlen) == 1 and extra is None else None)


@dataclass
class _Flight:
    """A launched round: the runner's :class:`~specdec_ext.engine.readback.Launched`, its depth ``cap``, the policy's
    ``plan`` and the host clock ``t0`` at its launch."""

    launched: object
    cap: int
    plan: RoundPlan
    t0: float


def _drafting(rounds: list, recent: int = 4) -> bool:
    """Whether a batch is drafting, for the draft to read staged requests with their prefill: at least three in four
    of its last ``recent`` rounds drafted (all of them while it has had fewer); one drafting round among plain steps
    is a verification budget's probe, after which it mostly goes back to plain steps (docs/design.md, Admission)."""
    last = rounds[-recent:]
    return bool(last) and sum(any(r.candidates) for r in last) * 4 >= 3 * len(last)
