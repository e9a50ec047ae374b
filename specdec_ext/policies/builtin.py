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
from .base import CandidateLengthPolicy, DraftStep, _check_k
from .goodput import BatchBudget, BatchCosts, CostModel, GoodputRule


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

    def add_rows(self, n):
        self.k = torch.cat([self.k, torch.full((n,), self.initial_k, dtype=torch.int64)])


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
            so a row's seeded output in a batch equals its output alone.
        measured_costs: once rounds have been measured, the budget corrects the table's cost of each depth by what
            rounds of that depth measured, and the head's survivals by the tokens they turned into, and chooses
            each round's depth cap (0: a plain step) by the goodput expected from both (default; see
            :class:`~specdec_ext.policies.goodput.BatchBudget`); ``False`` decides from the profiled table alone, so
            the decisions, and a sampled row's draws, are reproducible run to run.
        budget_options: keyword arguments of the budget (:class:`~specdec_ext.policies.goodput.BatchBudget`, e.g.
            ``{"switch_margin": 0.05, "headroom": 0.0}``); only with ``threshold="auto"`` and ``batch_budget``.
            Raises TypeError for a name the budget does not take, ValueError without the budget.

    Which candidate a step scores depends on the head (``AcceptanceHead.input_position``): a
    ``"proposal"`` head scores candidate k at step k and may stop at any K >= 1; the paper's
    ``"candidate"`` head reads the hidden state at candidate k - 1, available at step k, so a stop at
    step k ends the round with one candidate beyond those scored (the reference implementation's
    order), and its smallest K is 2.
    """

    def __init__(self, head, threshold=0.7, k_min: int = 1, k_max: int = 20, batch_budget: bool = True,
                 measured_costs: bool = True, budget_options: Optional[Mapping] = None):
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
        self._survivals: list = []
        self._unscored = False
        self.name = f"specdec++-{threshold if self.auto else format(threshold, 'g')}"
        self.costs: Optional[CostModel] = None
        self.rule: Optional[GoodputRule] = None
        self._weights = None
        self.cum_accept: Optional[torch.Tensor] = None
        self.history: Optional[torch.Tensor] = None
        self._prev_features = None

    # the engine reads these after configure()
    @property
    def needs_hidden(self) -> bool:
        return self.head.use_hidden

    needs_probs = False  # greedy: the features come from DraftStep.logits by the fused op

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

    def reset(self, batch_size, device):
        self._weights = self.head.fused_weights(device)
        feats = self.head.features
        self._conf_only = tuple(feats) == CONFIDENCE_FEATURES  # the op's output is the feature matrix as it is
        self._columns = [(n, CONFIDENCE_FEATURES.index(n) if n in CONFIDENCE_FEATURES else None) for n in feats]
        self._uses_history = any(i is None for _, i in self._columns)  # recent_accept
        self.cum_accept = torch.ones(batch_size, dtype=torch.float32, device=device)
        self.history = torch.full((batch_size,), HISTORY_PRIOR, dtype=torch.float32, device=device)
        self._prev_features = None
        if self.rule is not None:
            self.rule.reset(batch_size)
        # a batch of several rows under threshold="auto": the verification budget decides for the batch
        self.use_budget = self.budget is not None and batch_size > 1 and self.head.input_position == "proposal"
        self._plain = False
        if self.use_budget:
            self.budget.reset(batch_size)

    def draft_overhead(self, ms_per_token):
        if self.use_budget:
            self.budget.overhead = ms_per_token

    def draft_reads(self, ms):
        if self.use_budget:
            self.budget.read_ms = ms

    def rows_together(self, together):
        if self.use_budget:
            self.budget.together = bool(together)

    def draft_round(self, width):
        self._plain = self.use_budget and not self.budget.plan(int(self.cum_accept.shape[0]), width)
        return not self._plain

    def begin_round(self):
        self.cum_accept.fill_(1.0)
        self._prev_features = None
        self._survivals = []
        self._unscored = False  # the round's last slot went unscored (BatchBudget.score_last)
        self._steps = 0  # draft steps this round (should_stop's last k)

    def _features(self, info) -> Optional[torch.Tensor]:
        """The head's input features of the candidates just drafted, ``[B, F]`` (None without features)."""
        if not self._columns:
            return None
        dist, is_logits = (info.probs, False) if info.probs is not None else (info.logits, True)
        conf = ops.confidence_features(dist, info.tokens, is_logits)
        if self._conf_only:
            return conf
        cols = []
        for name, i in self._columns:
            if i is not None:
                cols.append(conf[:, i])
            else:  # recent_accept: candidate k is scored assuming candidates 1..k-1 accepted
                cols.append(history_after_accepts(self.history, info.step - 1).to(conf.device))
        return torch.stack(cols, -1)

    def should_stop(self, info):
        head, k = self.head, info.step
        self._steps = k
        capped = self.use_budget and k >= max(self.k_min, self.budget.cap)
        if self.use_budget and not self.budget.score_last and (self.budget.blind or capped):
            # the budget stops the batch at its cap whatever the head says, and a blind round (BatchBudget.blind) does
            # not ask below it: the head's features and forward are skipped (one round in ``score_every`` at the
            # budget's best depth still scores every slot, for its statistics)
            self._unscored = True
            return torch.full((info.batch_size,), capped, dtype=torch.bool)
        dev = self._weights[-1].device
        features = self._features(info)
        if features is not None:
            features = features.to(dev)
        if head.input_position == "candidate":  # score candidate k - 1 from the state at it
            scored_features, self._prev_features = self._prev_features, features
            if k == 1:
                return torch.full((info.batch_size,), k >= self.max_candidates, dtype=torch.bool)
            features = scored_features
        hidden = info.hidden.to(dev) if head.use_hidden else None
        h = 1.0 if self.auto else float(self.threshold)  # the auto rule keeps only the op's bounds
        _, stop = ops.acceptance_head_step(hidden, features, *self._weights, self.cum_accept, k, self.k_min,
                                           self.max_candidates, h)
        stop = stop.cpu()
        if self.use_budget:  # rows stop together, when the batch's next slots do not pay (BatchBudget)
            S = self.cum_accept.detach().double().cpu()
            if info.drafting is not None:  # a row that stopped has no slot here, one without room no next slot
                S = S * info.drafting.double()
            self._survivals.append(S)
            room = S * info.room.double() if info.room is not None else S
            if k >= self.k_min and not self.budget.go_on(k, room):
                stop = torch.ones_like(stop)
        elif self.auto and self.k_min <= k < self.max_candidates:
            stop = stop | self.rule.stop(k, self.cum_accept)
        return stop

    def verify_depth(self, num_drafted):
        if not self.use_budget:
            return num_drafted
        # [B, k]: S_bj, 0 past a row's own candidates (DraftStep.drafting)
        self._S = S = torch.stack(self._survivals, 1) if self._survivals else None
        if self._unscored:  # the slot at the cap has no survival: the planned depth is verified whole
            self._drafted = self._depth = self._steps
            return num_drafted
        if S is None:
            return num_drafted
        self._drafted, self._depth = S.shape[1], self.budget.depth(S)
        return num_drafted.clamp(max=self._depth)

    def end_round(self, num_drafted, num_accepted):
        if self._uses_history:
            self.history = history_update(self.history, num_drafted, num_accepted)
        if self.rule is not None and not self.use_budget:  # the per-row rule sits out a budgeted call
            self.rule.update(num_drafted, num_accepted)
        if self.use_budget and self._plain:
            self.budget.update(num_drafted.shape[0], 0, 0, num_drafted.shape[0])
        elif self.use_budget and (self._survivals or self._unscored):
            self.budget.update(num_drafted.shape[0], self._drafted, self._depth, int((num_accepted + 1).sum()),
                               self._S)

    def round_time(self, ms):
        if self.use_budget:
            self.budget.observe(ms)

    def select_rows(self, index):
        self.cum_accept = self.cum_accept[index.to(self.cum_accept.device)]
        self.history = self.history[index.to(self.history.device)]
        if self.rule is not None and not self.use_budget:
            self.rule.select(index)

    def add_rows(self, n):
        self.cum_accept = torch.cat([self.cum_accept, self.cum_accept.new_ones(n)])
        self.history = torch.cat([self.history, self.history.new_full((n,), HISTORY_PRIOR)])
        if self.rule is not None and not self.use_budget:
            self.rule.add_rows(n)

    def describe(self):
        return f"{self.name} ({self.head.describe()})"


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
