"""The built-in candidate-length policies."""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Optional

import torch

from .. import ops
from ..head import AcceptanceHead
from ..head.features import CONFIDENCE_FEATURES, HISTORY_PRIOR, history_after_accepts, history_update
from .base import CandidateLengthPolicy, DraftStep, RoundPlan, StopRule, _check_k
from .goodput import BatchBudget, BatchCosts, CostModel, GoodputRule, SurvivalCalibration


class Autoregressive(CandidateLengthPolicy):
    """Plain target-only decoding: the baseline every speedup is measured against."""

    name = "autoregressive"
    speculative = False
    max_candidates = 0

    def plan(self, ctx):
        return RoundPlan(0)


class FixedK(CandidateLengthPolicy):
    """Speculative decoding with a fixed candidate length K (Leviathan et al. 2023; Chen et al. 2023)."""

    def __init__(self, k: int = 4):
        self.k = _check_k("k (candidate length)", k)
        self.max_candidates = self.k
        self.name = f"fixed-{k}"

    def plan(self, ctx):
        return RoundPlan(self.k)

    def should_stop(self, info: DraftStep) -> torch.Tensor:
        return torch.full((info.batch_size,), info.step >= self.k, dtype=torch.bool)


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


class SpecDecPP(CandidateLengthPolicy):
    """SpecDec++ (Huang, Guo, Wang 2024, Sec. 3.2): an acceptance head predicts p_hat_k for each candidate,
    and drafting stops once the predicted probability that some candidate is rejected, 1 - prod_k p_hat_k,
    exceeds the stop threshold h, with the candidate length K held within [``k_min``, ``k_max``]
    (paper: h in {0.3, 0.7}, bounds [2, 20]). Each step runs through the fused ``acceptance_head_step`` op.

    Args:
        head: an :class:`~specdec_ext.head.AcceptanceHead`, or a mapping ``{"greedy": head, "sample": head}``
            from which each generation call takes the head for its decoding mode.
        threshold: h in [0, 1], or ``"auto"``: no hand-set threshold; drafting continues while one more
            candidate, weighted by the predicted survival S_k = prod_{j<=k} p_hat_j of the round so far, is
            expected to add more tokens per ms than the pair's goodput: stop after candidate k when
            S_k < lambda * (draft_ms + step_ms + verify(k+2) - verify(k+1)), with the costs from the pair's
            profile and lambda the row's running goodput in tokens/ms (:class:`~specdec_ext.policies.goodput.GoodputRule`).
            At batch size > 1 (with a ``"proposal"`` head) the rows decide together instead, with a verification
            budget across the batch from a profiled cost table by batch size
            (:class:`~specdec_ext.policies.goodput.BatchBudget`): whether the batch drafts at all this round (if
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
            so a row's seeded output in a batch equals its output alone (with ``calibrate=False`` too).
        measured_costs: once rounds have been measured, the budget corrects the table's cost of each depth by what
            rounds of that depth measured, and the head's survivals by the tokens they turned into, and chooses
            each round's depth cap (0: a plain step) by the goodput expected from both (default; see
            :class:`~specdec_ext.policies.goodput.BatchBudget`); ``False`` decides from the profiled table alone, so
            the decisions, and a sampled row's draws, are reproducible run to run.
        budget_options: keyword arguments of the budget (:class:`~specdec_ext.policies.goodput.BatchBudget`, e.g.
            ``{"switch_margin": 0.05, "headroom": 0.0}``); only with ``threshold="auto"`` and ``batch_budget``.
            Raises TypeError for a name the budget does not take, ValueError without the budget.
        calibrate: with ``threshold="auto"``'s per-row rule, scale the head's survivals by how many candidates the
            rounds accepted against how many the head predicted (default;
            :class:`~specdec_ext.policies.goodput.SurvivalCalibration`), kept across this policy's calls and
            forgotten by :meth:`reset_adaptation`; the predictions come back in the round's one read. One scale for
            all rows, learned from earlier rounds and calls, so a sampled row's draws depend on what came before
            (their distribution does not; greedy tokens do not change). ``False``: the head's survivals as they
            are, decisions reproducible call to call.

    Which candidate a step scores depends on the head (``AcceptanceHead.input_position``): a
    ``"proposal"`` head scores candidate k at step k and may stop at any K >= 1; the paper's
    ``"candidate"`` head reads the hidden state at candidate k - 1, available at step k, so a stop at
    step k ends the round with one candidate beyond those scored (the reference implementation's
    order), and its smallest K is 2.
    """

    def __init__(self, head, threshold=0.7, k_min: int = 1, k_max: int = 20, batch_budget: bool = True,
                 measured_costs: bool = True, budget_options: Optional[Mapping] = None, calibrate: bool = True):
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
        self._weights = None
        self.history: Optional[torch.Tensor] = None
        self._round = None
        self._plain = False
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
            # a budget is kept from call to call with the same cost table and head: what it measured (cost ratios
            # per depth, the head's calibration, the probe schedule; BatchBudget.reset) carries over, also past a
            # call of one row (no table given, and the per-row rule decides: use_budget needs batch size > 1)
            if batch_costs is not None and (self.budget is None or self.budget.batch is not batch_costs
                                            or self._budget_head is not self.head):
                self.budget = BatchBudget(batch_costs, measure=self.measured_costs, **self.budget_options)
                self._budget_head = self.head

    def _buffers(self, rows: int, device) -> dict:
        """The head rule's per-round tensors for ``rows`` rows on ``device`` (running survival, the previous
        candidate's features, per-row thresholds ``[k_max, rows]`` and their host copy (pinned off the CPU; the same
        tensor on it), acceptance history and the predicted accepted candidates the calibration reads), kept from
        round to round and refilled in place, so a captured draft step reads the same addresses every round
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
                "predicted": torch.zeros(rows, dtype=torch.float32, device=device)}
            kept["rows_host"] = kept["rows"] if kept["rows"].device.type == "cpu" else torch.full(
                (self.max_candidates, rows), -math.inf, dtype=torch.float32,
                pin_memory=kept["rows"].device.type == "cuda")
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

    def plan(self, ctx):
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
        # the per-row goodput rule (threshold="auto" without the budget): c S_k < lambda_b marginal(k)
        self._round = _HeadRule(self, budget, self.auto and not self.use_budget, skip_from)
        return RoundPlan(cap, self._round)

    def observe(self, result):
        if self._uses_history:
            self.history = history_update(self.history, torch.tensor(result.drafted, dtype=torch.int64),
                                          torch.tensor(result.accepted, dtype=torch.int64))
        if self.rule is not None and not self.use_budget:  # the per-row rule sits out a budgeted call
            self.rule.update(result.drafted, result.accepted)
            if self.calibration is not None and result.readback:  # [P] predicted accepted counts, padding rows last
                scored = result.accepted if self.head.input_position == "proposal" else \
                    [min(a, max(d - 1, 0)) for a, d in zip(result.accepted, result.drafted)]  # candidate K unscored
                self.calibration.update(sum(result.readback[0][: len(result.accepted)]), sum(scored))
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
        self.budget = None

    def describe(self):
        extra = f", survivals x {self.calibration.scale:.3g}" if self.calibration is not None else ""
        return f"{self.name} ({self.head.describe()}{extra})"


class _HeadRule(StopRule):
    """SpecDec++'s stop rule for one round, on the device: the acceptance head's fused step per candidate
    (``ops.acceptance_head_step``: p_hat, the running product S_k, the bounds and the threshold h), and

    - ``threshold="auto"`` at one row, or per-row (``per_row``): stop once c S_k < lambda_b marginal(k), the right
      side divided by the calibration c written before the round from each row's running goodput
      (:meth:`GoodputRule.thresholds`) into a kept ``[k_max, B]`` float32 buffer, the op's ``stop_below`` (step k
      reads row k - 1, contiguous);
    - the batch verification budget: the batch stops once the summed survivals of the rows with room fall below
      ``budget[k - 1]`` (:meth:`BatchBudget.go_threshold`), the head skipped from slot ``skip_from`` on (an
      unscored capped slot), and after drafting one depth for every row (:meth:`BatchBudget.depth`, computed on the
      device); the survivals and that depth come back with the round's tokens.

    Which candidate a step scores depends on the head (``AcceptanceHead.input_position``): a ``"proposal"`` head
    scores candidate k at step k; the paper's ``"candidate"`` head reads the hidden state at candidate k - 1, so a
    stop at step k ends the round with one candidate beyond those scored, and its smallest K is 2."""

    def __init__(self, policy: SpecDecPP, budget: Optional[list], per_row: bool, skip_from: Optional[int]):
        head = policy.head
        self.head, self.weights = head, policy._weights
        self.k_min, self.k_max = policy.k_min, policy.max_candidates
        self.h = 1.0 if policy.auto else float(policy.threshold)  # the auto rules keep only the op's bounds
        self.columns = [CONFIDENCE_FEATURES.index(n) if n in CONFIDENCE_FEATURES else None for n in head.features]
        self.conf_only = tuple(head.features) == CONFIDENCE_FEATURES
        self.history = policy.history
        self.budget, self.per_row, self.skip_from = budget, per_row, skip_from
        self.rows: Optional[torch.Tensor] = None  # [k_max, B] float32: the per-row rule's thresholds
        self.policy = policy
        self.predicted: Optional[torch.Tensor] = None  # [B]: sum of S_k over each row's scored candidates
        self.needs_hidden = bool(head.use_hidden)
        self.unscored = False

    def begin(self, batch_size, device):
        dev = self.weights[-1].device
        self.survivals: list = []
        self.unscored = False
        self.depth_value = None
        pad = batch_size - self.history.shape[0]  # rows padded to a batch bucket: never drafting, decisions unread
        if self.budget is None:  # the policy's buffers, refilled in place: the steps can be captured (capture_key)
            kept = self.policy._buffers(batch_size, dev)
            self.cum = kept["cum"].fill_(1.0)
            self.prev = kept["prev"]
            if self.per_row:  # the live rows' columns rewritten (a padding row's stale ones decide nothing read)
                p = self.policy
                scale = p.calibration.scale if p.calibration is not None else 1.0
                p.rule.thresholds(self.k_max, self.k_min, self.k_max, scale, out=kept["rows_host"])
                self.rows = kept["rows"]
                if kept["rows_host"] is not self.rows:  # pinned: no wait for the device
                    self.rows.copy_(kept["rows_host"], non_blocking=True)
                if p.calibration is not None:
                    self.predicted = kept["predicted"].zero_()
            if any(c is None for c in self.columns):
                kept["history"].fill_(HISTORY_PRIOR)[: self.history.shape[0]].copy_(self.history)
                self.history = kept["history"]
            return
        self.cum = torch.ones(batch_size, dtype=torch.float32, device=dev)
        self.prev = None  # (the budget decides for the batch: no per-row survivals, self.rows is None)
        if any(c is None for c in self.columns):
            self.history = torch.cat([self.history, self.history.new_full((pad,), HISTORY_PRIOR)]).to(dev)

    def written(self):
        if self.budget is not None:
            return []
        return [self.cum, self.prev] + ([self.predicted] if self.predicted is not None else [])

    def capture_key(self):
        if self.budget is not None:  # the budget's thresholds are host numbers and its survivals a host list
            return None
        tensors = [t for t in self.weights if t is not None] + [self.cum, self.prev]
        tensors += [self.rows] if self.rows is not None else []
        tensors += [self.predicted] if self.predicted is not None else []
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
        if self.predicted is not None:  # S_k of the rows whose candidate this step scored
            self.predicted.addcmul_(self.cum, info.drafting.to(dev))
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
        S = torch.stack(self.survivals, 1)  # [B, j]: S_bj, 0 past a row's own candidates
        b = self.policy.budget
        gain = torch.cat([S.new_zeros(1, dtype=torch.float64), S.double().sum(0).cumsum(0)])
        values = b.head_scale * gain - torch.tensor(b.depth_costs(S.shape[0], S.shape[1]), dtype=torch.float64,
                                                    device=S.device)
        self.depth_value = S.shape[1] - torch.argmax(values.flip(0))  # the deepest of equal values
        return torch.minimum(drafted, self.depth_value.to(drafted.device))

    def readback(self):
        if self.predicted is not None:
            return [self.predicted]
        if self.budget is None or not self.survivals:
            return []
        S = torch.stack(self.survivals, 1)
        return [S] if self.depth_value is None else [S, self.depth_value.view(1)]


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
