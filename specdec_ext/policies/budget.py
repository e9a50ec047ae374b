"""The verification budget across a batch (``threshold="auto"`` at batch size > 1): :class:`BatchBudget`, with the
Kalman filter of the rounds' measured costs against the profiled table (``policies/drift.py``).
``docs/design.md`` ("The batch verification budget") gives each rule with the paired run behind it.
"""

from __future__ import annotations

import copy
import math
from typing import Optional

import torch

from .costs import BatchCosts
from .drift import DriftFilter


def _nearest_measured(values: list) -> list[float]:
    """Each entry, or where it is None the nearest entry that is not (the lower one on a tie); all 0.0 when every
    entry is None. One pass each way (the budget reads it once per measured round)."""
    n = len(values)
    below: list = [None] * n  # (distance, value) of the nearest measured entry at or below j
    last = None
    for j in range(n):
        if values[j] is not None:
            last = j
        below[j] = None if last is None else (j - last, values[last])
    out, last = [0.0] * n, None
    for j in range(n - 1, -1, -1):
        if values[j] is not None:
            last = j
        up = None if last is None else (last - j, values[last])
        lo = below[j]
        out[j] = (lo if up is None or (lo is not None and lo[0] <= up[0]) else up)[1] if (lo or up) else 0.0
    return out


READS_FREE_STEPS = 4  # reads worth at most this many plain steps never hold back a probe of drafting (BatchBudget)
LONG_SAMPLES = 8  # fair samples of a slot before its long-run mean survival is used (BatchBudget._long_gain)
EARLY_ROUNDS = 3  # a depth's first measured rounds, whose lower median sets its cost (BatchBudget.observe)


class BatchBudget:
    """A verification budget across a batch (``threshold="auto"`` at batch size > 1): whether the batch drafts
    at all this round, how deep it drafts, and how many drafted slots it verifies, from the rows' predicted
    survivals and the profiled cost table (:class:`BatchCosts`), corrected by what the rounds measure.
    ``docs/design.md`` ("The batch verification budget") gives each rule with the paired run behind it.

    With S_bk the survival of row b's candidate k (the product of the head's p_hat, SpecDec++ Eq. 1), a round of
    depth D is expected to emit sum_b (1 + a sum_{k<=D} S_bk) tokens (Leviathan et al. 2023, Eq. 1, per slot; a the
    head's measured calibration) in T_B(D) ms; lambda, the goodput to beat (tokens/ms, Dinkelbach's method), never
    falls below plain decoding's B / T_B(0). Depth 0 is a plain step: the target decodes one token per row and
    the draft does not run.

    - :meth:`plan`, before the round: the depth cap c*, the depth of best expected goodput
      B (1 + a sum_{j<=c} g_j) / T_B(c), g_j the running mean survival of slot j over fair samples, T_B the
      table's round times the ratio rounds of that depth measured (:meth:`observe`: a depth's first
      ``EARLY_ROUNDS`` rounds set it by their lower median, then a Kalman filter of a drift common to every depth
      plus each depth's offset, ``cost_drift``; each innovation clipped to ``ratio_clip``). The neighbours
      c* +- 1 are probed every ``probe`` rounds (interval doubling while they lose); unmeasured depths within
      ``explore_within`` of the best are explored (:attr:`forced` rounds draft to their cap). The batch moves
      between plain steps and drafting only for a gain above ``switch_margin``; with ``lockstep`` (off by default),
      while the rows of a continuous batch are in lockstep (:attr:`together`), only above ``explore_within``, and
      it neither explores nor probes a drafting depth then (on a 2-core AMD EPYC, B = 4, 128 HumanEval prompts x 48
      tokens, the rule held the batch at plain steps: 0.84x fixed K = 2 against 0.90-0.93x without it; B = 16 level,
      ``docs/results/budget_paired_b4_lockstep_epyc.json``, ``budget_paired_b16_lockstep_epyc.json``). With
      ``count_overhead`` a depth's cost includes the draft's reads of unread contexts per emitted token.
    - in the round (``in_round``, default): drafting goes on after depth k < c* while
      rho_k sum_b S_bk >= lambda (T_B(k + 1) - T_B(k)), rho_k = g_{k+1} / g_k (the one-step look-ahead rule); the
      cap is c* + 1 where that depth is within ``headroom`` of c*, so the rule decides the extra slot; the head
      scores the slot at the cap one round in ``score_every`` (:attr:`score_last`), keeping g and a current.
      With ``in_round=False`` the other rounds are :attr:`blind`: they draft c* with no head step (the scored
      round drafts to c* + 1 with ``score_deeper``), the setting to measure where a head step reads its stop flag
      back to the host.
    - after the round (padded rows): the verified depth is the d <= k that maximises
      a sum_b sum_{j<=d} S_bj - lambda verify_B(d + 1): one depth for every row, as the padded forward costs.
    - between calls (:meth:`reset`): per batch size, the cost ratios, the calibration and the probe schedule
      carry over; long-run means of each slot's survival (weight ``long_decay``) are where short means return,
      ``revert`` of the way per round that samples nothing of them.

    Without ``measure`` the table alone decides and decisions are reproducible. Decisions depend on every row
    of the batch, so a sampled row's tokens depend on its batch, never their distribution: each verified slot
    is accepted by the same rejection sampling. Greedy output never depends on the decisions.

    Raises ValueError naming the option for an out-of-range option.
    """

    def __init__(self, batch: BatchCosts, decay: float = 0.2, prior_ms: float = 50.0, prior_accept: float = 0.7,
                 depth_max: int = 8, probe: int = 8, measure: bool = True, explore: int = 4, score_every: int = 4,
                 headroom: float = 0.03, explore_within: float = 0.15,
                 ratio_clip: float = 0.25, count_overhead: bool = True, cost_drift: bool = True,
                 accuracy_decay: Optional[float] = None, probe_read_share: float = 0.02, long_decay: float = 0.02,
                 revert: float = 0.2, switch_margin: float = 0.03, lockstep: bool = False, in_round: bool = True,
                 score_deeper: bool = True):
        self.in_round = bool(in_round)
        self.score_deeper = bool(score_deeper)
        self.lockstep = bool(lockstep)
        self.together = False  # the live rows are in lockstep (the engine's rows_together, before each plan)
        if not 0.0 < long_decay <= 1.0:
            raise ValueError(f"long_decay must be in (0, 1] (a running mean's weight), got {long_decay!r}")
        if not 0.0 <= revert <= 1.0:
            raise ValueError(f"revert must be in [0, 1] (a weight per plain step), got {revert!r}")
        self.long_decay, self.revert = float(long_decay), float(revert)
        if not switch_margin >= 0.0:
            raise ValueError(f"switch_margin must be >= 0 (a fraction of goodput), got {switch_margin!r}")
        self.switch_margin = float(switch_margin)
        self.cost_drift = bool(cost_drift)
        if accuracy_decay is not None and not 0.0 < accuracy_decay <= 1.0:
            raise ValueError("accuracy_decay must be in (0, 1] (a running mean's weight) or None, "
                             f"got {accuracy_decay!r}")
        self.accuracy_decay = decay if accuracy_decay is None else float(accuracy_decay)
        self.count_overhead = bool(count_overhead)
        self.overhead = 0.0  # ms per emitted token that drafting adds outside the rounds (set before each plan)
        self.read_ms = 0.0  # ms the draft would spend reading unread live rows were this round to draft (likewise)
        if not 0.0 < probe_read_share <= 1.0:
            raise ValueError("probe_read_share must be in (0, 1] (a fraction of the time spent in plain steps), "
                             f"got {probe_read_share!r}")
        self.probe_read_share = float(probe_read_share)
        if not explore_within >= 0.0:
            raise ValueError("explore_within must be >= 0 (a fraction of the best depth's goodput), "
                             f"got {explore_within!r}")
        if not ratio_clip > 0.0:
            raise ValueError(f"ratio_clip must be > 0 (a log ratio), got {ratio_clip!r}")
        self.explore_within, self.ratio_clip = float(explore_within), float(ratio_clip)
        if isinstance(score_every, bool) or not isinstance(score_every, int) or score_every < 1:
            raise ValueError(f"score_every must be an integer >= 1, got {score_every!r}")
        if not 0.0 <= headroom < 1.0:
            raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
        self.headroom = headroom
        self.batch, self.decay, self.prior_ms, self.explore = batch, decay, prior_ms, explore
        self.score_every = score_every
        self.prior_accept, self.depth_max, self.probe, self.measure = prior_accept, depth_max, probe, measure
        self.tokens = self.time = 0.0
        self.width: Optional[int] = None
        self.gain: list[float] = []
        self._kept: dict = {}  # batch size -> what earlier calls measured (reset)
        self._size: Optional[int] = None
        self.reset(1)

    # what reset() keeps per batch size from call to call (see there), by attribute
    _KEPT = ("log_ratio", "_accepted", "_predicted", "_since", "_every", "_tries", "_best", "_weight", "_early",
             "_drift", "_plain_ms", "_plain_step_ms", "_long")

    def reset(self, batch_size: int) -> None:
        """Start a call of ``batch_size`` rows. What earlier calls measured at this batch size, the per-depth cost
        ratios and the head's calibration (properties of the pair and the machine, not of the text) and the
        neighbours' probe schedule, is kept, as a server keeps it from request to request; the running survivals
        and goodput start again."""
        if self._size is not None and self.measure:
            self._kept[self._size] = {name: copy.deepcopy(getattr(self, name)) for name in self._KEPT}
        self._size = batch_size
        self.width = None
        self.together = False  # a continuous batch's engine says so before each round
        plain = batch_size / self.batch.round(batch_size, 0)  # plain decoding's goodput, tokens/ms
        self.tokens, self.time = plain * self.prior_ms, self.prior_ms
        self.gain = [self.prior_accept ** j for j in range(1, self.depth_max + 1)]
        self._seen = 0  # slots 1 .. _seen have been drafted at least once since the reset
        self._counts = [0] * self.depth_max  # rounds that drafted each slot
        # the long-run means (_long_weight) of the slots' survivals and of the head's calibration terms, with their
        # sample counts, kept from call to call: what the short running means start from and revert to (see update)
        self._long = {"gain": [None] * self.depth_max, "samples": [0] * self.depth_max, "accepted": None,
                      "predicted": None, "calibrated": 0}
        self._plain_run, self._interval = 0, self.probe  # table decisions: plain steps since drafting, probe interval
        n = self.depth_max + 1
        self._weight = [0] * n                # per drafted depth: rounds measured (at most 1 / decay)
        self._early = [[] for _ in range(n)]  # per drafted depth: the log ratios of its first rounds (observe)
        self.log_ratio = [None] * n           # per drafted depth: running mean log(measured / table ms)
        self._drift = DriftFilter(self.depth_max) if self.cost_drift else None  # cost_drift: the costs' filter
        self.accuracy: Optional[float] = None  # a: accepted tokens over the verified slots' survivals (running)
        self._accepted = self._predicted = None  # their running means (a ratio of means: a round whose survivals
        #                                          sum to little would swing a running mean of ratios)
        self._since = [0] * n                 # rounds since each depth was last played
        self._tries = [0] * n                 # rounds played to measure each depth (rows may lack the room to reach it)
        self._every = [self.probe] * n        # each neighbour's probe interval (doubles while it keeps losing)
        self._best: Optional[int] = None
        self._plain_ms = 0.0                  # measured ms of the plain steps since the batch last drafted
        self._plain_step_ms = 0.0             # the last plain step's measured ms
        self.cap = self.depth_max             # this round's cap: the most candidates per row it may draft
        self.score_last = True                # whether this round's head scores the slot at the cap (see plan)
        self.forced = False                   # this round drafts to its cap whatever the survivals (see plan)
        self._rounds = 0                      # rounds planned since the reset
        self._last = None
        self._planned: Optional[float] = None  # the expected goodput of the best depth (measure: lambda)
        self._cold = True  # the call's first round is not measured
        if batch_size in self._kept:
            for name, value in self._kept[batch_size].items():
                setattr(self, name, copy.deepcopy(value))
            # the head's calibration, likewise, from the long-run terms once they rest on LONG_SAMPLES rounds
            self._accepted, self._predicted = self._long_calibration() or (None, None)
            self.accuracy = self._accepted / self._predicted if self._predicted else None
            long = self._long_gain()
            self._seen = next((j for j, v in enumerate(long) if v is None), len(long))
            for j in range(self._seen):  # a new call starts from what the earlier ones measured, not the prior
                self.gain[j], self._counts[j] = long[j], round(1 / self.decay)

    @property
    def log_ratio(self) -> list:
        """Per drafted depth k = 0 .. ``depth_max``: the running mean log(measured / table ms) of its rounds (None
        until measured); with ``cost_drift``, the filter's estimate d + o_k (:class:`DriftFilter`)."""
        return self._log_ratio

    @log_ratio.setter
    def log_ratio(self, ratios: list) -> None:
        self._log_ratio = ratios
        self._measured()

    def _measured(self) -> None:
        """The ratios changed: what is computed from them is recomputed when next read."""
        self._ratio_list = None  # _ratios()
        self._calibrations = None  # calibration(k) for k = 0 .. depth_max
        self._costs_at = None  # _costs: (batch size, width) and the modelled ms of each depth there
        self._plain_scale = None  # exp(ratio_0): measured over table ms of a plain step (overhead_per_token)

    @property
    def head_scale(self) -> float:
        """a: the head's measured calibration (accepted tokens per unit of predicted survival), 1 until measured."""
        return 1.0 if self.accuracy is None else min(max(self.accuracy, 0.5), 2.0)

    def calibration(self, k: int) -> float:
        """How much dearer, relative to the table, a round drafting k candidates measured than a plain step:
        exp(ratio_k - ratio_0), clipped to [1/4, 4] (1 for k = 0, and while nothing is measured); ratio_k is read
        from the estimates of log(measured / table ms) per drafted depth (at most ``depth_max``) as :meth:`_ratios`
        says."""
        if self._calibrations is None:  # recomputed after each measurement: the budget reads this many times a round
            ratio, bound = self._ratios(), math.log(4.0)
            self._calibrations = [1.0] + [math.exp(min(max(x - ratio[0], -bound), bound)) for x in ratio[1:]]
        return self._calibrations[min(k, self.depth_max)]

    def _ratios(self) -> list[float]:
        """The log(measured / table ms) that :meth:`calibration` uses at each depth 0 .. ``depth_max``: each depth's
        own estimate (the drift filter's, or the running mean), or the nearest measured depth's (the lower one on a
        tie), 0 when nothing has been measured. Computed once per measurement (:meth:`_measured`)."""
        if self._ratio_list is None:
            self._ratio_list = _nearest_measured(self.log_ratio)
        return self._ratio_list

    def _round(self, B: int, k: int, verified: Optional[int] = None) -> float:
        """Modelled ms of a round drafting k and verifying ``verified`` (default k) candidates per row, at the
        current width, in plain-step time (the table's cost times ``calibration(k)``)."""
        if verified is None and k <= self.depth_max:
            return self._costs(B)[k]
        return self._table_round(B, k, verified) * self.calibration(k)

    def _costs(self, B: int) -> list[float]:
        """``_round(B, k)`` for k = 0 .. ``depth_max`` at the current width, computed once per batch size, width
        and measurement (a round reads them some thirty times: the plan, the one-step rule, the verified depth)."""
        key = (B, self.width)
        if self._costs_at is None or self._costs_at[0] != key:
            table = self.batch.round_row(B, self.depth_max, self.width)
            self._costs_at = (key, [ms * self.calibration(k) for k, ms in enumerate(table)])
        return self._costs_at[1]

    def _table_round(self, B: int, k: int, verified: Optional[int] = None) -> float:
        """The table's ms of that round (uncalibrated)."""
        return self.batch.round(B, k, self.width, verified)

    def _next_ratio(self, k: int) -> float:
        """E[p_hat of slot k + 1]: the running mean survival of slot k + 1 over that of slot k (at most 1)."""
        g = self.gain
        j = min(k, len(g) - 1)
        return min(1.0, g[j] / g[j - 1]) if j >= 1 and g[j - 1] > 0 else g[0]

    @property
    def rate(self) -> float:
        """The batch's running goodput, tokens/ms."""
        return self.tokens / self.time

    def _lambda(self, B: int) -> float:
        """lambda (tokens per plain-step ms): with ``measure``, the expected goodput of this round's best depth
        (:meth:`plan`); without, the running goodput; never below plain decoding's B / T_B(0), the goodput a
        plain step would give the time a slot costs (the opportunity cost of drafting)."""
        rate = self._planned if self.measure and self._planned is not None else self.rate
        return max(rate, B / self._round(B, 0))

    def _survival_sums(self) -> list[float]:
        """sum_{j<=c} g_j for c = 0 .. depth_max; slots never drafted yet continue the last drafted slot's ratio
        g_j / g_{j-1} (the prior's ratio while at most one slot has been drafted)."""
        g, seen = self.gain, self._seen
        step = self._next_ratio(seen - 1) if seen > 1 else self.prior_accept
        sums, last = [0.0], 1.0
        for j in range(len(g)):
            last = g[j] if j < seen or j == 0 else last * step
            sums.append(sums[-1] + last)
        return sums

    def expected_goodput(self, B: int, c: int) -> float:
        """Tokens per plain-step ms expected of a round drafting c (0 .. ``depth_max``) candidates per row:
        E / (T_B(c) + E o) with E = B (1 + a sum_{j<=c} g_j) (:meth:`_survival_sums`) and o the overhead per token
        of drafting (:meth:`overhead_per_token`; 0 for c = 0)."""
        return self._values(B)[c]

    def _values(self, B: int) -> list[float]:
        """:meth:`expected_goodput` of every depth c = 0 .. ``depth_max``, in one pass (the plan reads them all each
        round: computed depth by depth they took a third of the budget's time per round at B = 4)."""
        sums, costs = self._survival_sums(), self._costs(B)
        a, o, n = self.head_scale, self.overhead_per_token(), len(self.gain)
        values = []
        for c, ms in enumerate(costs):
            tokens = B * (1.0 + a * sums[min(c, n)])
            values.append(tokens / (ms + tokens * o) if c else tokens / ms)
        return values

    def overhead_per_token(self) -> float:
        """o: the wall time drafting adds outside the rounds per emitted token (:attr:`overhead`, the engine's
        estimate, ``CandidateLengthPolicy.draft_overhead``: the draft reading each request's context once) in
        plain-step ms (divided by exp(ratio_0), as measured rounds are); 0 without ``count_overhead``. In steady
        continuous batching a request that drafts pays its read once over its tokens, so a round emitting E
        tokens brings E o ms of reads with it. With short requests the reads weigh as much as the rounds gain
        (``SpeculativeGenerator._draft_overhead``: at B = 16, 48-token requests, about 0.1-0.2 ms per token
        against a gain in decoding of about 0.1); with long prompts they dominate."""
        if not self.count_overhead or self.overhead <= 0.0:
            return 0.0
        if self._plain_scale is None:
            self._plain_scale = math.exp(self._ratios()[0])
        return self.overhead / self._plain_scale

    def plan(self, batch_size: int, width: Optional[int] = None) -> bool:
        """Before a round: whether the batch drafts (False: one step of plain decoding), with the target cache
        ``width`` columns wide (kept for this round's other decisions); sets :attr:`cap`."""
        self.width = width
        if self.measure:
            self._rounds += 1
            self.cap = self._measured_cap(batch_size)  # sets forced
            self.score_last = self.forced or self._rounds % self.score_every == 0
            self.forced = self.score_last  # a scored round drafts to the cap: its survivals are a sample of every slot
            return self.cap > 0
        B, lam = batch_size, self._lambda(batch_size)
        plain = self._round(B, 0)
        pays = any(B * sum(self.gain[:d]) > lam * (self._round(B, d) - plain) for d in range(1, len(self.gain) + 1))
        self.cap = self.depth_max
        if pays:
            self._plain_run = 0
            return True
        if self._plain_run >= self._interval:  # a probe: drafting is checked again, less often while it loses
            self._interval *= 2
            self._plain_run = 0
            return True
        self._plain_run += 1
        self.cap = 0
        return False

    def _measured_cap(self, B: int) -> int:
        """The best depth by :meth:`expected_goodput`, except that each depth 0 .. ``explore`` expected within
        ``explore_within`` of the best is played once first (the unmeasured one nearest the best first; twice at
        most, when the rows lack the room to reach it; not in a call's first round, which is not measured), and
        that the best depth's neighbours (once measured in ``EARLY_ROUNDS`` rounds, only those within
        ``explore_within`` of it) are played again after ``probe`` rounds, the interval doubling each time one is
        played and still loses (a new best depth's own interval starts again). Sets :attr:`forced` for the rounds
        that measure a depth (those drafts go to the cap, :meth:`go_on`)."""
        values = self._values(B)
        best = max(range(len(values)), key=lambda c: (values[c], -c))
        last = 0 if self._best is None else self._best  # a batch size's first round: the draft has read nothing
        if (best == 0) != (last == 0) and values[best] < (1.0 + self.switch_margin) * values[last]:
            best = last  # between plain steps and drafting, a near tie keeps the batch where it is
        elif (values[best] < (1.0 + self.explore_within) * values[0]
              and ((last == 0 and self.log_ratio[best] is None)
                   or (self.lockstep and self.together and (last == 0 or self._cold)))):
            # from plain steps, drafting must beat them by more than the costs' error where its depth is not measured
            # yet, or where the rows are in lockstep (a drafting round would end it for the rest of the stream)
            best = 0
        self._planned = values[best]
        if best != self._best:  # the new best's interval starts again; a neighbour that kept losing keeps its own
            self._best = best
            self._every[best] = self.probe
        self._since = [s + 1 for s in self._since]
        floor = (1.0 - self.explore_within) * values[best]  # depths expected to do worse are not worth a round
        # from plain steps, a round that drafts would first make the draft read the unread rows: not worth it to
        # measure a depth or probe one until those reads are a small share of the plain steps' time
        reads_wait = best == 0 and (self.read_ms > max(self.probe_read_share * self._plain_ms,
                                                        READS_FREE_STEPS * self._plain_step_ms)
                                    or (self.lockstep and self.together))  # nor in lockstep (see the rule above)
        unmeasured = [] if self._cold else [c for c in range(min(self.explore, self.depth_max) + 1)
                                            if self.log_ratio[c] is None and self._tries[c] < 2 and values[c] >= floor
                                            and not (c and reads_wait)]
        cap = min(unmeasured, key=lambda c: (abs(c - best), c)) if unmeasured else best
        if unmeasured:
            self._tries[cap] += 1
        self.forced = bool(unmeasured)
        for c in ((best - 1, best + 1) if not unmeasured and not self._cold else ()):
            if reads_wait:
                continue
            if (0 <= c < len(values) and self._since[c] >= self._every[c]
                    and (values[c] >= floor or len(self._early[c]) < EARLY_ROUNDS)):
                # a depth measured far below is not probed again once its first rounds settled its cost
                self._every[c] *= 2
                cap, self.forced = c, True
                break
        if not self.forced and 1 <= cap < self.depth_max:
            if self.in_round and self.headroom > 0 and values[cap + 1] >= (1.0 - self.headroom) * values[cap]:
                cap += 1  # the one-step rule (go_on) decides the last slot from this round's survivals
            elif (not self.in_round and self.score_deeper and self._rounds % self.score_every == 0
                  and values[cap + 1] >= (1.0 - self.explore_within) * values[cap]):
                cap += 1  # blind rounds: the scored one (plan) samples slot c* + 1 too (see the class docstring)
        self._since[cap] = 0
        return cap

    @property
    def blind(self) -> bool:
        """Whether this round drafts to its cap without the head (``in_round=False``, with ``measure``, outside the
        scored rounds): no survivals are read below the cap, so neither :meth:`go_threshold` nor :meth:`depth` is
        asked."""
        return self.measure and not self.in_round and not self.score_last

    def go_threshold(self, B: int, k: int) -> float:
        """The live rows' summed survival sum_b S_bk at or above which the batch drafts candidate k + 1 (the one-step
        rule: a sum_b S_bk rho_k >= lambda (T_B(k + 1) - T_B(k))): +inf at or past the cap, -inf while the round
        measures its depth (:attr:`forced`). The values of one round are fixed before it drafts, so the rule is a
        comparison on the device (``policies/specdecpp.py``)."""
        if k >= self.cap:
            return math.inf
        if self.forced:  # measuring this depth's cost: the round must reach it
            return -math.inf
        need = self._lambda(B) * (self._round(B, k + 1) - self._round(B, k))
        scale = self.head_scale * self._next_ratio(k)
        if scale <= 0:
            return math.inf if need > 0 else -math.inf
        return need / scale

    def depth_costs(self, B: int, k: int) -> list[float]:
        """lambda_k verify_B(d + 1) for d = 0 .. k (what verifying d slots per row costs, in expected tokens, after k
        were drafted): :meth:`depth` keeps the d that maximises a sum_b sum_{j<=d} S_bj minus it."""
        lam = self._lambda(B) * self.calibration(k)
        return [lam * v for v in self.batch.verify_row(B, k + 1, self.width)]

    def depth(self, survivals: torch.Tensor) -> torch.Tensor:
        """The depth d in 0..k to verify, given survivals ``[B, k]`` (S_bj, 0 beyond a row's own candidates), as a
        0-dim int64 tensor on their device, computed there (no read-back: the round's rule, ``policies/specdecpp.py``):
        the d maximising a sum_b sum_{j<=d} S_bj - :meth:`depth_costs`, the deepest of equal values."""
        B, k = survivals.shape
        gain = torch.cat([survivals.new_zeros(1, dtype=torch.float64), survivals.double().sum(0).cumsum(0)])
        values = self.head_scale * gain - torch.tensor(self.depth_costs(B, k), dtype=torch.float64,
                                                       device=survivals.device)
        return k - torch.argmax(values.flip(0))

    def update(self, batch_size: int, drafted: int, depth: int, emitted: int,
               survivals: Optional[torch.Tensor] = None) -> None:
        """After the round: ``drafted`` draft steps, ``depth`` verified, ``emitted`` tokens over the batch, and the survivals ``[B, j]`` (S_bj, 0 where a row did
        not draft the slot) of the first j drafted slots the head scored (for the running mean survival per slot;
        when they cover the verified slots, also for the head's calibration). j < ``drafted`` when the round did
        not score its last slot (:attr:`score_last`). A plain step is ``drafted = depth = 0``."""
        verified = depth  # candidates per row the round's cost is read at
        table = self._table_round(batch_size, drafted, verified)
        self._last = (drafted, table)
        ms = table * self.calibration(drafted)  # _round, from the table ms just read
        a = self.decay
        self.tokens = (1 - a) * self.tokens + a * emitted
        self.time = (1 - a) * self.time + a * ms
        if verified > 0:
            self._interval = self.probe  # table decisions: a probe whose slots paid starts the interval again
        if survivals is None or not survivals.numel():
            if self.measure:
                self._revert(0)
            return
        columns = survivals.double().t().tolist()  # per slot, the rows' survivals
        # slot j is a fair sample of its survival only where reaching it did not depend on the survivals before
        # it: slot 1 always, every slot of a round that drafted to its cap (forced); a round the one-step rule
        # carried on to slot 2 was one whose slot-1 survivals were high (the running mean of slot 2 came out
        # above slot 1's, 0.89 against 0.72, and the budget drafted deeper than it paid)
        fair = len(columns) if self.forced or not self.measure else 1
        if self.measure:
            self._revert(min(fair, len(columns)))
        for j, col in enumerate(columns[: min(fair, len(self.gain))]):
            real = [v for v in col if v > 0]  # rows that drafted the slot
            if real:  # the prior counts as one round: weight 1/2, 1/3, ... then ``decay``
                self._counts[j] += 1
                w = max(a, 1.0 / (self._counts[j] + 1))
                mean = sum(real) / len(real)
                self.gain[j] = (1 - w) * self.gain[j] + w * mean
                self._seen = max(self._seen, j + 1)
                long = self._long
                long["samples"][j] += 1
                long["gain"][j] = self._average(long["gain"][j], mean, self._long_weight(long["samples"][j]))
        if self.measure and 0 < depth <= len(columns):  # the summed survivals of the rows' verified slots
            predicted = sum(sum(col) for col in columns[:depth])
            if predicted > 0:
                w = self.accuracy_decay
                self._accepted = self._average(self._accepted, float(emitted - batch_size), w)
                self._predicted = self._average(self._predicted, predicted, w)
                self.accuracy = self._accepted / self._predicted
                long = self._long
                long["calibrated"] += 1
                weight = self._long_weight(long["calibrated"])
                long["accepted"] = self._average(long["accepted"], float(emitted - batch_size), weight)
                long["predicted"] = self._average(long["predicted"], predicted, weight)

    def _long_weight(self, n: int) -> float:
        """The weight of the n-th sample (n >= 1) in a long-run mean: 1/n (a mean over the first samples) until that
        falls below ``long_decay``, then ``long_decay`` (a running mean)."""
        return max(self.long_decay, 1.0 / n)

    def _long_gain(self) -> list:
        """Per slot, the long-run mean survival, or None until the slot has been a fair sample in ``LONG_SAMPLES``
        rounds (the deeper slots are sampled only in a budget's forced and scored rounds: at B = 16 slots 3 and 4
        once or twice, at 0.12 and 0.01)."""
        long = self._long
        return [v if n >= LONG_SAMPLES else None for v, n in zip(long["gain"], long["samples"])]

    def _long_calibration(self) -> Optional[tuple]:
        """The long-run means of the head's calibration terms (accepted tokens, summed survivals of the verified
        slots), or None until ``LONG_SAMPLES`` rounds measured them: a running mean from the first round on would let
        one unlucky first round (a warm-up call that accepts nothing puts a near 0.06) hold the calibration low for
        some 50 rounds, every plain step pulling the short means towards it (:meth:`_revert`)."""
        long = self._long
        if long["calibrated"] < LONG_SAMPLES or not long["predicted"]:
            return None
        return long["accepted"], long["predicted"]

    def _revert(self, first: int) -> None:
        """A round that sampled no survival of slots ``first + 1`` and deeper (a plain step: ``first`` = 0): the
        short running means of those slots' survivals (g) move ``revert`` of the way back to their long-run means
        (:meth:`_long_gain`), and after a plain step the head's calibration terms too (:meth:`_long_calibration`).
        Without this, the estimate that made drafting (or a deeper slot) look poor stays as it was until a probe,
        and a probe is one round's sample: at B = 4 on a 2-core CPU (bf16) a stretch of rounds with low survivals
        sent the batch to plain decoding for up to a fifth of its rounds, at 0.47 tokens/ms where fixed K = 2 gave
        0.62. What the short means remember of the text fades as it would while drafting (rows change, text moves
        on); where drafting does not pay over the long run (B = 64), the long-run means say so too."""
        r = self.revert
        gain = self._long_gain()
        for j in range(first, len(self.gain)):
            v = gain[j]
            if v is not None:
                self.gain[j] += r * (v - self.gain[j])
        calibration = self._long_calibration()
        if first == 0 and calibration and self._predicted:
            self._accepted += r * (calibration[0] - self._accepted)
            self._predicted += r * (calibration[1] - self._predicted)
            self.accuracy = self._accepted / self._predicted

    def observe(self, ms: float) -> None:
        """The measured wall time (ms) of the round just updated: the log ratio of measured to table time at the
        round's drafted depth, behind :meth:`calibration`. A depth's first ``EARLY_ROUNDS`` measured rounds set
        it to their lower median (the first; the lower of two; the middle of three): a round's time only ever
        stalls upwards, and at B = 16 on a 2-core CPU one first round of depth 1 at 1.3x its usual time made plain
        decoding look best, after which the running mean needed many probes of depth 1, each a catch-up of the
        draft's unread rows, to come back; after them, the running mean (weight ``decay``) of the clipped ratios."""
        if not self.measure or self._last is None or ms <= 0:
            return
        k, table = self._last
        self._last = None
        self._plain_ms = self._plain_ms + ms if k == 0 else 0.0
        if k == 0:
            self._plain_step_ms = ms
        if self._cold:  # a call's first round: its caches grow for the first time, and every row's first tokens
            self._cold = False  # (the ends of prompts' lines) are the easiest to draft; it says little of the rest
            return
        k = min(k, self.depth_max)
        self._weight[k] = min(self._weight[k] + 1, round(1 / self.decay))
        ratio, old = math.log(ms / table), self.log_ratio[k]
        early = self._early[k]
        first = len(early) < EARLY_ROUNDS and (old is None or early)
        if first:  # a depth's first rounds: their lower median
            early.append(ratio)
            ratio = sorted(early)[(len(early) - 1) // 2]
        if self._drift is not None:  # cost_drift: every depth's cost from the filter (DriftFilter); unplayed: None
            if first:  # how far the table misjudges this depth, not a drift of all of them
                self._drift.anchor(k, ratio, self._drift.round_var / len(early))
            else:
                self._drift.observe(k, ratio, self.ratio_clip)
            self.log_ratio = [self._drift.log_ratio(j) if self._weight[j] else None for j in range(len(self._weight))]
            return
        if first:
            self.log_ratio[k] = ratio
        else:  # then a running mean in which one stalled round moves the mean by decay * ratio_clip at most
            ratio = min(max(ratio, old - self.ratio_clip), old + self.ratio_clip)
            self.log_ratio[k] = self._average(old, ratio)
        self._measured()

    def _average(self, old: Optional[float], new: float, weight: Optional[float] = None) -> float:
        """The running average (weight ``weight``, default ``decay``) after ``new``; ``new`` itself when nothing came
        before."""
        w = self.decay if weight is None else weight
        return new if old is None else (1 - w) * old + w * new
