"""SpecDec++ (Huang, Guo, Wang 2024): the acceptance head's stop rule, with a fixed stop threshold h or
``threshold="auto"`` (the per-row rule with its choice of stop rule by measured goodput, or the batch verification
budget)."""

from __future__ import annotations

import functools
import inspect
import math
import struct
import time
from collections.abc import Mapping
from typing import Callable, Optional

import torch

from .. import ops
from ..head import AcceptanceHead
from ..head.features import CONFIDENCE_FEATURES, HISTORY_PRIOR, history_after_accepts, history_update
from ..transfer import PinnedRing
from .base import CandidateLengthPolicy, RoundPlan, StopRule, _check_k
from .budget import BatchBudget
from .costs import BatchCosts, CostModel
from .goodput import GoodputRule, SurvivalCalibration
from .select import DEFAULT_THRESHOLDS, StopSelector

MEASURED_ROUNDS = 32  # with the selector, the goodput rule takes the measured round costs every this many rounds
PLAIN_RUN = 16  # plain steps between two of the selector's rounds where drafting does not pay (StopSelector.plain_pays)


class SpecDecPP(CandidateLengthPolicy):
    """SpecDec++ (Huang, Guo, Wang 2024, Sec. 3.2): an acceptance head predicts p_hat_k for each candidate,
    and drafting stops once the predicted probability that some candidate is rejected, 1 - prod_k p_hat_k,
    exceeds the stop threshold h, with the candidate length K held within [``k_min``, ``k_max``]
    (paper: h in {0.3, 0.7}, bounds [2, 20]). Each step runs through the fused ``acceptance_head_step`` op.

    Args:
        head: an :class:`~specdec_ext.head.AcceptanceHead`, or a mapping ``{"greedy": head, "sample": head}``
            from which each generation call takes the head for its decoding mode.
        threshold: h in [0, 1], or ``"auto"``: no hand-set threshold. Each round plays one of several stop rules,
            chosen by the goodput the rounds measured (``select``): a fixed h from ``select_thresholds``, or the
            goodput rule, which drafts while one more candidate, weighted by the predicted survival
            S_k = prod_{j<=k} p_hat_j of the round so far, is expected to add more tokens per ms than the pair's
            goodput: stop after candidate k when S_k < lambda * (draft_ms + step_ms + verify(k+2) - verify(k+1)),
            with the costs from the pair's profile (with ``select``, from the rounds' measured times once 32 were
            measured) and lambda the row's running goodput in tokens/ms
            (:class:`~specdec_ext.policies.goodput.GoodputRule`). One row at a time, where no stop rule's measured
            goodput reaches a plain step's (after 64 rounds), plain steps replace the rounds, 16 between two of
            the selector's (:meth:`~specdec_ext.policies.select.StopSelector.plain_pays`).
            At batch size > 1 (with a ``"proposal"`` head) the rows decide together instead, with a verification
            budget across the batch from a profiled cost table by batch size
            (:class:`~specdec_ext.policies.budget.BatchBudget`): whether the batch drafts at all this round (if
            not, a step of plain decoding without a draft forward), how deep it drafts, and how many of the
            drafted slots it verifies (possibly none), one depth for every row. The last two decisions are made within a round from
            the head's step at each slot below the depth planned; with ``budget_options={"in_round": False}`` a
            round drafts and verifies the planned depth, and the head runs only in the budget's scored rounds (one
            in four, which draft one slot past that depth, and those that explore or probe a depth), for its running
            survivals.
        k_min, k_max: bounds on K (``k_max`` is K_max).
        batch_budget: with ``threshold="auto"``, use the verification budget across the batch at batch size > 1
            (default). Its decisions couple the rows, so a sampled row's tokens then depend on the rest of its
            batch (their distribution does not); ``False`` keeps every row's decisions its own (per-row rule),
            so a row's seeded output in a batch equals its output alone (with ``calibrate=False`` and ``select=False``
            too).
        measured_costs: once rounds have been measured, the budget corrects the table's cost of each depth by what
            rounds of that depth measured, and the head's survivals by the tokens they turned into, and chooses
            each round's depth cap (0: a plain step) by the goodput expected from both (default; see
            :class:`~specdec_ext.policies.budget.BatchBudget`); ``False`` decides from the profiled table alone, so
            the decisions, and a sampled row's draws, are reproducible run to run.
        budget_options: keyword arguments of the budget (:class:`~specdec_ext.policies.budget.BatchBudget`, e.g.
            ``{"switch_margin": 0.05, "headroom": 0.0}``); only with ``threshold="auto"`` and ``batch_budget``.
            Raises TypeError for a name the budget does not take, ValueError without the budget.
        calibrate: with ``threshold="auto"``'s per-row rule, scale the head's survivals by how many candidates the
            rounds accepted against how many the head predicted (default;
            :class:`~specdec_ext.policies.goodput.SurvivalCalibration`), kept across this policy's calls and
            forgotten by :meth:`reset_adaptation`; the predictions come back in the round's one read. One scale for
            all rows, learned from earlier rounds and calls, so a sampled row's draws depend on what came before
            (their distribution does not; greedy tokens do not change). ``False``: the head's survivals as they
            are, decisions reproducible call to call.
        select: with ``threshold="auto"``'s per-row rule, choose each round's stop rule among a fixed h for each of
            ``select_thresholds`` and the goodput rule by measured goodput, tokens per ms of the rounds' measured
            wall time (:class:`~specdec_ext.policies.select.StopSelector`: Thompson sampling over arms that learn
            from each other's rounds through the survivals read back with the tokens), kept across this policy's
            calls and forgotten by :meth:`reset_adaptation` (default). The choice depends on measured times, so a
            sampled row's draws do too (their distribution does not; greedy tokens do not change). ``False``: the
            goodput rule alone.
        select_thresholds: the fixed stop thresholds h among which ``select`` chooses (with the goodput rule).

    Which candidate a step scores depends on the head (``AcceptanceHead.input_position``): a
    ``"proposal"`` head scores candidate k at step k and may stop at any K >= 1; the paper's
    ``"candidate"`` head reads the hidden state at candidate k - 1, available at step k, so a stop at
    step k ends the round with one candidate beyond those scored (the reference implementation's
    order), and its smallest K is 2.
    """

    def __init__(self, head, threshold=0.7, k_min: int = 1, k_max: int = 20, batch_budget: bool = True,
                 measured_costs: bool = True, budget_options: Optional[Mapping] = None, calibrate: bool = True,
                 select: bool = True, select_thresholds=DEFAULT_THRESHOLDS):
        heads = dict(head) if isinstance(head, Mapping) else {"any": head}
        for key, h in heads.items():
            if not isinstance(h, AcceptanceHead):
                raise TypeError(f"SpecDecPP needs an AcceptanceHead (or a mapping of them), got {type(h).__name__}"
                                + (f" for {key!r}" if key != "any" else ""))
        if isinstance(head, Mapping) and not set(heads) <= {"greedy", "sample"}:
            raise ValueError(f"SpecDecPP: a mapping of heads has keys 'greedy' and/or 'sample', got {sorted(heads)}")
        self.auto = threshold == "auto"
        if not self.auto and not (isinstance(threshold, (int, float)) and 0.0 <= threshold <= 1.0):
            raise ValueError(f"stop threshold h must lie in [0, 1] or be 'auto', got {threshold!r}")
        self.k_min = _check_k("k_min", k_min)
        self.max_candidates = _check_k("k_max", k_max)
        if k_min > k_max:
            raise ValueError(f"k_min ({k_min}) must be <= k_max ({k_max})")
        self.heads = heads
        self.head = next(iter(heads.values()))
        self.threshold = threshold
        self.needs_costs = self.auto
        self.needs_batch_costs = self.auto and bool(batch_budget)
        self.measured_costs = bool(measured_costs)
        self.budget_options = dict(budget_options or {})
        if self.budget_options:
            if not self.needs_batch_costs:
                raise ValueError("budget_options: the batch budget runs only with threshold='auto' and "
                                 "batch_budget=True")
            known = set(inspect.signature(BatchBudget).parameters) - {"batch", "measure"}
            unknown = sorted(set(self.budget_options) - known)
            if unknown:
                raise TypeError(f"budget_options: BatchBudget takes no {unknown}; it takes {sorted(known)}")
            BatchBudget(BatchCosts([1], [[1.0, 2.0]], [[1.0, 2.0]]), **self.budget_options)  # bad values: raise now
        self.budget: Optional[BatchBudget] = None
        self._budget_head = None  # the head the budget measured (its calibration is that head's)
        self.use_budget = False
        self.name = f"specdec++-{threshold if self.auto else format(threshold, 'g')}"
        self.costs: Optional[CostModel] = None
        self.rule: Optional[GoodputRule] = None
        self.calibration = SurvivalCalibration() if self.auto and calibrate else None
        self.selector = StopSelector(select_thresholds) if self.auto and select else None
        self._arm: Optional[int] = None  # the selector's arm of the planned round
        self._planned: Optional[tuple] = None  # (room per row, early_exit, goodput rates) of the planned round
        self._fixed_arms: dict = {}  # (depths the rows reach, first depth) -> the fixed arms' thresholds and bounds
        self._weights = None
        self.history: Optional[torch.Tensor] = None
        self._round = None
        self._plain = False
        self._plain_run = 0  # plain steps since the selector's last round
        self._fused = None  # (the head's fingerprint, its fused weights)
        self._kept: dict = {}  # (rows, device) -> the head rule's per-round buffers (_buffers)

    @property
    def needs_hidden(self) -> bool:
        return self.head.use_hidden

    def configure(self, sampling, costs=None, batch_costs=None):
        mode = "greedy" if sampling is None or sampling.greedy else "sample"
        if "any" in self.heads:
            self.head = self.heads["any"]
        elif mode in self.heads:
            self.head = self.heads[mode]
        else:
            raise ValueError(f"SpecDecPP: no acceptance head for {mode} decoding (heads given for {sorted(self.heads)})")
        if self.auto:
            if costs is None:
                raise ValueError("SpecDecPP(threshold='auto') needs the pair's CostModel (the engine profiles it)")
            self.costs = costs
            self.rule = GoodputRule(costs, self.head.mean_accept, self.max_candidates)
            self._fixed_arms.clear()
            if self.selector is not None:
                self.selector.configure(StopSelector.prior_from(costs))
                if self.selector.time.rounds >= MEASURED_ROUNDS:  # what earlier calls measured
                    self._measured_costs()
            # a budget is kept from call to call with the same cost table and head: what it measured (cost ratios
            # per depth, the head's calibration, the probe schedule; BatchBudget.reset) carries over, also past a
            # call of one row (no table given, and the per-row rule decides: use_budget needs batch size > 1)
            if batch_costs is not None and (self.budget is None or self.budget.batch is not batch_costs
                                            or self._budget_head is not self.head):
                self.budget = BatchBudget(batch_costs, measure=self.measured_costs, **self.budget_options)
                self._budget_head = self.head

    def _buffers(self, rows: int, device) -> dict:
        """The head rule's per-round tensors for ``rows`` rows on ``device`` (running survival, the previous
        candidate's features, per-row thresholds ``[k_max, rows]``, acceptance history, their host copies (pinned
        buffers in rotation on a GPU, ``transfer.PinnedRing``), and the survivals after each step ``[k_max, rows]``
        that the calibration and the selector read back), kept from round to round and refilled in place, so a
        captured draft step reads the same addresses every round
        (``StopRule.capture_key``)."""
        key = (rows, torch.device(device))
        kept = self._kept.get(key)
        F = len(self.head.features)
        if kept is None or kept["prev"].shape[1] != F:
            kept = self._kept[key] = {
                "cum": torch.ones(rows, dtype=torch.float32, device=device),
                "prev": torch.zeros(rows, F, dtype=torch.float32, device=device),
                "rows": torch.full((self.max_candidates, rows), -math.inf, dtype=torch.float32, device=device),
                "history": torch.full((rows,), HISTORY_PRIOR, dtype=torch.float32, device=device),
                "log": torch.ones(self.max_candidates, rows, dtype=torch.float32, device=device)}
            # host copies written each round and copied without a wait (pinned, in rotation: transfer.PinnedRing)
            kept["rows_host"] = PinnedRing((self.max_candidates, rows), torch.float32, device, fill=-math.inf)
            kept["history_host"] = PinnedRing((rows,), torch.float32, device, fill=HISTORY_PRIOR)
        return kept

    def reset(self, batch_size, device):
        fp = (id(self.head), torch.device(device), tuple((p.data_ptr(), p._version) for p in self.head.parameters()))
        if self._fused is None or self._fused[0] != fp:  # the same tensors from call to call while the head is
            self._fused = (fp, self.head.fused_weights(device))  # unchanged: captured steps keep reading them
        self._weights = self._fused[1]
        self._device = device
        self.history = torch.full((batch_size,), HISTORY_PRIOR, dtype=torch.float32)
        if self.rule is not None:
            self.rule.reset(batch_size)
        # a batch of several rows under threshold="auto": the verification budget decides for the batch
        self.use_budget = self.budget is not None and batch_size > 1 and self.head.input_position == "proposal"
        if self.use_budget:
            self.budget.reset(batch_size)
        self._round: Optional[_HeadRule] = None
        self._plain = False

    @property
    def plans_ahead(self) -> bool:
        """Rounds may overlap (:attr:`CandidateLengthPolicy.plans_ahead`) except under the batch verification budget,
        whose plan and result are one round's bookkeeping, and with a head that reads the rows' acceptance history
        (a round planned ahead would score with a history a round old: not what the head learned, and a row's
        decisions would then depend on where the rows beside it end)."""
        return not self.use_budget and not self._uses_history

    def plan(self, ctx):
        plan = self._plan(ctx)
        plan.note = (self._arm, self._planned, self._round, self._plain)  # observe() credits this plan
        return plan

    def _plan(self, ctx):
        B = ctx.batch_size
        self._plain = False
        budget = None
        cap, skip_from = self.max_candidates, None
        if self.use_budget:
            b = self.budget
            b.overhead, b.read_ms, b.together = ctx.draft_overhead, ctx.draft_reads, bool(ctx.together)
            if not b.plan(B, ctx.width):
                self._plain = True
                self._round = None
                return RoundPlan(0)
            cap = b.cap
            if b.blind:  # no head below the cap: the round drafts and verifies the planned depth (BatchBudget.blind)
                self._round = None
                return RoundPlan(cap)
            budget = [b.go_threshold(B, k) for k in range(1, cap + 1)]
            if not b.score_last:  # the budget stops the batch at its cap whatever the head says: that slot unscored
                skip_from = max(self.k_min, cap)
        if self.selector is not None and not self.use_budget and B == 1 and self.selector.plain_pays() \
                and self._plain_run < PLAIN_RUN:  # drafting does not pay here: a plain step (StopSelector.plain_pays)
            self._plain_run += 1
            self._plain, self._round, self._arm = True, None, None
            return RoundPlan(0)
        self._plain_run = 0
        # threshold="auto" without the budget: per-row thresholds, the selector's arm or the goodput rule's
        write = self._plan_thresholds(ctx) if self.auto and not self.use_budget else None
        self._round = _HeadRule(self.head, self._weights, self.k_min, self.max_candidates,
                                1.0 if self.auto else float(self.threshold), self.history, self._buffers, write,
                                write is not None and (self.calibration is not None or self.selector is not None),
                                self.budget if budget is not None else None, budget, skip_from)
        return RoundPlan(cap, self._round)

    def _plan_thresholds(self, ctx) -> Callable:
        """The per-row rule's round: the selector's arm (``select``), what the round's counterfactuals need later
        (:meth:`_observe_arms`), and a function writing the arm's thresholds into a ``[k_max, >= B]`` float32 CPU
        tensor (``stop_below``'s layout, a row per draft step): 1 - h everywhere for a fixed h, or the goodput rule's
        lambda_b marginal_ms(k) / c (:meth:`GoodputRule.thresholds`)."""
        scale = self.calibration.scale if self.calibration is not None else 1.0
        arm = h = None
        if self.selector is not None:
            t0 = time.perf_counter()
            arm = self.selector.choose(self._depth_order)
            h = self.selector.arms[arm].h
            self._planned = (list(ctx.room), ctx.early_exit, self.rule.rates(scale))
            self.selector.spent_s += time.perf_counter() - t0
        self._arm = arm
        B, k_max = ctx.batch_size, self.max_candidates
        if h is None:  # the goodput rule
            return lambda out: self.rule.thresholds(k_max, self.k_min, k_max, scale, out=out)
        t = _float32(1.0 - h)
        return lambda out: out[:, :B].fill_(t)

    def _measured_costs(self) -> None:
        """The goodput rule priced by what the rounds cost where they run (the selector's fit)."""
        self.rule.measured(self.selector.time.c)
        self._fixed_arms.clear()

    @functools.cached_property
    def _depth_order(self) -> list:
        """The selector's arms, the deepest first (the largest h; the goodput rule's arm last)."""
        arms = self.selector.arms
        return sorted(range(len(arms)), key=lambda a: -arms[a].h if arms[a].h is not None else math.inf)

    def _observe_arms(self, result, survivals: list) -> None:
        """The selector's round (:meth:`StopSelector.tick`) and, where the arms learn from it
        (:meth:`StopSelector.credit`), every arm's thresholds per row and their bounds over the depths each row could
        reach, and how the round's reads turn a depth into draft steps and verified tokens."""
        tokens = sum(result.accepted) + len(result.accepted)  # each row's accepted candidates and its one more
        if not self.selector.tick(self._arm, result.cycle_ms, result.steps, result.verified, tokens):
            return
        room, early_exit, rates = self._planned
        B = len(result.drafted)
        k_max, lo = self.max_candidates, max(self.k_min, 1 if self.head.input_position == "proposal" else 2)
        reach = tuple(min(r, k_max) for r in room[:B])
        margins = self.rule.margins(k_max, self.k_min, k_max)
        key = (reach, lo)
        fixed = self._fixed_arms.get(key)  # the fixed arms' thresholds and bounds, the margins' range per row
        # (cleared where the goodput rule's margins change: _measured_costs, configure)
        if fixed is None:
            if len(self._fixed_arms) >= 256:  # rows' rooms of every kind (a batch's ends): kept small
                self._fixed_arms.clear()
            empty = (math.inf, -math.inf)
            fixed = self._fixed_arms[key] = {
                a: ([t] * B, [(t, t) if lo < r else empty for r in reach])
                for a, t in ((a, _float32(1.0 - arm.h)) for a, arm in enumerate(self.selector.arms)
                             if arm.h is not None)}
            fixed[None] = [(min(margins[lo - 1: r - 1]), max(margins[lo - 1: r - 1])) if lo < r else empty
                           for r in reach]
        thresholds, bounds = [], []
        for a, arm in enumerate(self.selector.arms):
            if arm.h is None:  # the goodput rule: t_k = margins[k - 1] * rate_b, bounded over the depths rows reach
                thresholds.append([(margins, rate) for rate in rates[:B]])
                bounds.append([(lo_m * rate, hi_m * rate) for (lo_m, hi_m), rate in zip(fixed[None], rates)])
            else:
                thresholds.append(fixed[a][0])
                bounds.append(fixed[a][1])
        steps, verified, depth = result.steps, result.verified, max(result.drafted)
        if early_exit is True or early_exit == "device":
            steps_of = (lambda d: d) if steps == depth else (lambda d: steps)
        elif isinstance(early_exit, frozenset):  # the first read after which no row drafts, else the round's cap
            tiers, cap = sorted(early_exit), min(k_max, max(room[:B]))
            steps_of = lambda d: min([k for k in tiers if k >= d] + [cap])  # noqa: E731
        else:  # the draft ran to the cap
            steps_of = lambda d: steps  # noqa: E731
        verified_of = steps_of if verified == steps else (lambda d: verified)
        self.selector.credit(self._arm, thresholds, bounds, lo, survivals, result.drafted, result.accepted, steps_of,
                             verified_of, steps, verified)

    def observe(self, result):
        if result.plan is not None and result.plan.note is not None:  # the round's own plan (a later one may exist)
            self._arm, self._planned, self._round, self._plain = result.plan.note
        if self._plain and self.selector is not None and not self.use_budget:  # drafting did not pay: a plain step
            self.selector.played_plain(result.cycle_ms)
            return
        if self._uses_history:
            self.history = history_update(self.history, torch.tensor(result.drafted, dtype=torch.int64),
                                          torch.tensor(result.accepted, dtype=torch.int64))
        if self.rule is not None and not self.use_budget:  # the per-row rule sits out a budgeted call
            self.rule.update(result.drafted, result.accepted)
            if result.readback:  # per row: its survival after each draft step (padding rows beyond the live ones)
                survivals = result.readback[0]
                if self.calibration is not None:  # the predicted accepted count: S_k over the candidates scored
                    proposal = self.head.input_position == "proposal"
                    scored = result.accepted if proposal else \
                        [min(a, max(d - 1, 0)) for a, d in zip(result.accepted, result.drafted)]  # candidate K unscored
                    first = 0 if proposal else 1
                    predicted = sum(sum(s[first: d]) for s, d in zip(survivals, result.drafted))
                    self.calibration.update(predicted, sum(scored))
                if self._arm is not None and result.steps:
                    t0 = time.perf_counter()
                    self._observe_arms(result, survivals)
                    self.selector.spent_s += time.perf_counter() - t0
                    fit = self.selector.time
                    if fit.rounds >= MEASURED_ROUNDS and fit.rounds % MEASURED_ROUNDS == 0:
                        self._measured_costs()
        if not self.use_budget:
            return
        b, B = self.budget, len(result.drafted)
        if self._plain:
            b.update(B, 0, 0, B)
        else:
            S, depth = None, result.steps  # blind: the planned depth, drafted and verified whole
            if self._round is not None and result.readback:
                S = torch.tensor(result.readback[0], dtype=torch.float64).view(B, -1)
                if not self._round.unscored:
                    depth = int(result.readback[1][0])
            b.update(B, result.steps, depth, sum(result.accepted) + B, S)
        b.observe(result.ms)

    @property
    def _uses_history(self) -> bool:
        return any(n not in CONFIDENCE_FEATURES for n in self.head.features)

    def select_rows(self, index):
        self.history = self.history[index.cpu()]
        if self.rule is not None and not self.use_budget:
            self.rule.select(index)

    def add_rows(self, n):
        self.history = torch.cat([self.history, self.history.new_full((n,), HISTORY_PRIOR)])
        if self.rule is not None and not self.use_budget:
            self.rule.add_rows(n)
        rows = self.history.shape[0]
        if not self.use_budget and self.budget is not None and rows > 1 and self.head.input_position == "proposal":
            self.use_budget = True  # a call that began with one row (requests arriving one by one) now has several
            self.budget.reset(rows)

    def reset_adaptation(self) -> None:
        """Forget what this policy learned from the rounds it observed across calls: the survivals' calibration
        (``calibrate``) and the batch budget's measured costs and calibration (the next call measures anew)."""
        if self.calibration is not None:
            self.calibration.reset()
        if self.selector is not None:
            self.selector.reset()
        self.budget = None

    def describe(self):
        extra = f", survivals x {self.calibration.scale:.3g}" if self.calibration is not None else ""
        if self.selector is not None and self.selector.history:
            shares = sorted(self.selector.shares(256).items(), key=lambda kv: -kv[1])
            extra += ", stop rule " + " ".join(f"{name} {share:.0%}" for name, share in shares[:3])
        return f"{self.name} ({self.head.describe()}{extra})"


class _HeadRule(StopRule):
    """SpecDec++'s stop rule for one round, on the device: the acceptance head's fused step per candidate
    (``ops.acceptance_head_step``: p_hat, the running product S_k, the bounds and the threshold h), and

    - ``threshold="auto"`` at one row, or per-row: stop once S_k falls below the round's thresholds, written before
      the round by ``write`` (the selector's arm: 1 - h, or the goodput rule's lambda_b marginal(k) / c,
      :meth:`SpecDecPP._plan_thresholds`) into a kept ``[k_max, B]`` float32 buffer, the op's ``stop_below`` (step k
      reads row k - 1, contiguous); each step's S_k is logged into a kept ``[k_max, B]`` buffer read back with the
      round's tokens (the calibration's predictions and the selector's counterfactual rounds);
    - the batch verification budget: the batch stops once the summed survivals of the rows with room fall below
      ``budget[k - 1]`` (:meth:`BatchBudget.go_threshold`), the head skipped from slot ``skip_from`` on (an
      unscored capped slot), and after drafting one depth for every row (:meth:`BatchBudget.depth`, computed on the
      device); the survivals and that depth come back with the round's tokens.

    Which candidate a step scores depends on the head (``AcceptanceHead.input_position``): a ``"proposal"`` head
    scores candidate k at step k; the paper's ``"candidate"`` head reads the hidden state at candidate k - 1, so a
    stop at step k ends the round with one candidate beyond those scored, and its smallest K is 2."""

    def __init__(self, head: AcceptanceHead, weights: tuple, k_min: int, k_max: int, h: float, history: torch.Tensor,
                 buffers: Callable, write: Optional[Callable] = None, logs: bool = False,
                 batch: Optional[BatchBudget] = None, budget: Optional[list] = None, skip_from: Optional[int] = None):
        """``head`` and its fused ``weights``; bounds ``k_min``, ``k_max`` and threshold ``h`` (1 for the auto rules,
        which stop by their thresholds alone); the rows' acceptance ``history``; ``buffers(rows, device)``: the
        policy's kept tensors (:meth:`SpecDecPP._buffers`); ``write``: the per-row rule's thresholds' writer, and
        ``logs``: whether its survivals are read back; ``batch``, ``budget``, ``skip_from``: the batch verification
        budget, its per-slot thresholds and the slot from which its cap stops the batch unscored."""
        self.head, self.weights = head, weights
        self.k_min, self.k_max, self.h = k_min, k_max, h
        self.columns = [CONFIDENCE_FEATURES.index(n) if n in CONFIDENCE_FEATURES else None for n in head.features]
        self.conf_only = tuple(head.features) == CONFIDENCE_FEATURES
        self.history = history
        self.buffers, self.write, self.logs = buffers, write, logs
        self.batch, self.budget, self.skip_from = batch, budget, skip_from
        self.rows: Optional[torch.Tensor] = None  # [k_max, B] float32: the per-row rule's thresholds
        self.log: Optional[torch.Tensor] = None  # [k_max, B] float32: S_k after each step (per-row rule)
        self.needs_hidden = bool(head.use_hidden)
        self.unscored = False

    def begin(self, batch_size, device):
        dev = self.weights[-1].device
        self.survivals: list = []
        self.unscored = False
        self.depth_value = None
        pad = batch_size - self.history.shape[0]  # rows padded to a batch bucket: never drafting, decisions unread
        if self.budget is None:  # the policy's buffers, refilled in place: the steps can be captured (capture_key)
            kept = self.buffers(batch_size, dev)
            self.cum = kept["cum"].fill_(1.0)
            self.prev = kept["prev"]
            if self.write is not None:  # the live rows' columns rewritten (a padding row's stale ones decide nothing
                self.rows = kept["rows"]  # that is read)
                kept["rows_host"].upload(self.rows, self.write)
                if self.logs:  # entries past a row's last step are stale: the host reads its drafted ones only
                    self.log = kept["log"]
            if any(c is None for c in self.columns):
                history = self.history
                kept["history_host"].upload(kept["history"],
                                            lambda t: t.fill_(HISTORY_PRIOR)[: history.shape[0]].copy_(history))
                self.history = kept["history"]
            return
        self.cum = torch.ones(batch_size, dtype=torch.float32, device=dev)
        self.prev = None  # (the budget decides for the batch: no per-row survivals, self.rows is None)
        if any(c is None for c in self.columns):
            self.history = torch.cat([self.history, self.history.new_full((pad,), HISTORY_PRIOR)]).to(dev)

    def written(self):
        if self.budget is not None:
            return []
        return [self.cum, self.prev] + ([self.log] if self.log is not None else [])

    def capture_key(self):
        if self.budget is not None:  # the budget's thresholds are host numbers and its survivals a host list
            return None
        tensors = [t for t in self.weights if t is not None] + [self.cum, self.prev]
        tensors += [self.rows] if self.rows is not None else []
        tensors += [self.log] if self.log is not None else []
        tensors += [self.history] if any(c is None for c in self.columns) else []  # the history feature reads it
        return (type(self), self.head.input_position, self.head.use_hidden, tuple(self.columns), self.conf_only,
                self.k_min, self.k_max, self.h, self.rows is not None, self.skip_from,
                tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors))

    def _features(self, info) -> Optional[torch.Tensor]:
        """The head's input features of the candidates just drafted, ``[B, F]`` (None without features)."""
        if not self.columns:
            return None
        dist, is_logits = (info.probs, False) if info.probs is not None else (info.logits, True)
        conf = ops.confidence_features(dist, info.tokens, is_logits)
        if self.conf_only:
            return conf
        cols = [conf[:, i] if i is not None else history_after_accepts(self.history, info.step - 1)  # recent_accept:
                for i in self.columns]  # candidate k is scored assuming candidates 1..k-1 accepted
        return torch.stack(cols, -1)

    def step(self, info):
        k, B = info.step, info.batch_size
        dev = self.cum.device
        if self.skip_from is not None and k >= self.skip_from:  # the budget's cap: stop, the head not asked
            self.unscored = True
            return torch.ones(B, dtype=torch.bool, device=info.tokens.device)
        features = self._features(info)
        if features is not None:
            features = features.to(dev)
        if self.head.input_position == "candidate":  # score candidate k - 1 from the state at it
            if self.budget is None:  # the policy's buffer (capturable): the state at the previous candidate
                scored = self.prev.clone() if k > 1 and features is not None else None
                if features is not None:
                    self.prev.copy_(features)
            else:
                scored, self.prev = self.prev, features
            if k == 1:
                return torch.full((B,), k >= self.k_max, dtype=torch.bool, device=info.tokens.device)
            features = scored
        hidden = info.hidden.to(dev) if self.head.use_hidden else None
        below = self.rows[k - 1] if self.rows is not None else None  # k <= k_max: a row per step
        _, stop = ops.acceptance_head_step(hidden, features, *self.weights, self.cum, k, self.k_min, self.k_max,
                                           self.h, below, check=False)  # no read-back: a NaN p_hat stops its row
        if self.log is not None:  # S_k after this step
            self.log[k - 1].copy_(self.cum)
        if self.budget is not None:  # rows stop together, when the batch's next slots do not pay (BatchBudget)
            S = self.cum * info.drafting.to(dev)  # a row that stopped has no slot here
            self.survivals.append(S)
            if k >= self.k_min:
                room = (S * info.room.to(dev)).double().sum()  # one without room no next slot
                stop = stop | (room < self.budget[k - 1])
        return stop.to(info.tokens.device)

    def depth(self, drafted, steps):
        if self.budget is None or self.unscored or not self.survivals:
            return None
        self.depth_value = self.batch.depth(torch.stack(self.survivals, 1))  # [B, j]: S_bj, 0 past a row's own
        return torch.minimum(drafted, self.depth_value.to(drafted.device))

    def readback(self):
        if self.log is not None:
            return [self.log.t()]  # rows first: per row its S_k after each step
        if self.budget is None or not self.survivals:
            return []
        S = torch.stack(self.survivals, 1)
        return [S] if self.depth_value is None else [S, self.depth_value.view(1)]


def _float32(x: float) -> float:
    """``x`` rounded to float32, as a threshold is when the op compares a survival with it."""
    return struct.unpack("f", struct.pack("f", x))[0]
