"""The goodput arithmetic of the ``threshold="auto"`` per-row rule, and the online calibration of the head's survivals.

With per-candidate survival S_k = prod_{j<=k} p_hat_j (the predicted probability that candidates 1..k are all
accepted), a round of K candidates emits 1 + sum_{k<=K} S_k tokens in expectation (Leviathan et al. 2023, Eq. 1, with
per-candidate rather than constant acceptance) and costs T(K) (:class:`~specdec_ext.policies.costs.CostModel`). The
long-run goodput is E[tokens] / E[time] per round (a renewal-reward ratio); the rule that maximises it drafts one more
candidate while its expected tokens exceed lambda times its cost, lambda being the goodput itself (Dinkelbach's method
for ratio objectives). vLLM's adaptive-K rule (pull request 44336) maximises the same ratio over a fixed K per step;
its DSpark verification scheduler (pull request 47808) ranks drafted slots by survival against a profiled cost table.
The batch verification budget (``policies/budget.py``) applies the same ratio to a batch; the choice among this rule
and fixed thresholds by measured goodput is ``policies/select.py``'s.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .costs import CostModel


class GoodputRule:
    """The ``threshold="auto"`` stop rule, per row (Dinkelbach's method for the goodput ratio):

        stop after candidate k  iff  S_k < lambda * marginal_ms(k),

    S_k = prod_{j<=k} p_hat_j being the predicted survival of the round so far, which bounds what one
    more candidate can add (its expected tokens are S_k * p_hat_{k+1} <= S_k, and p_hat_{k+1} is not
    known before its draft forward), and lambda the row's goodput in tokens/ms: exponential averages
    (weight ``decay`` per round) of tokens emitted and of modelled round time T(K), starting from the best
    fixed K's goodput at the head's mean training acceptance (``prior_goodput``) with weight
    ``prior_ms``. Rows are independent, so a row's decisions in a batch equal its decisions alone.
    Used by :class:`~specdec_ext.policies.SpecDecPP` and by the offline replay (``training/replay.py``).
    """

    def __init__(self, costs: CostModel, mean_accept: Optional[float], k_max: int, decay: float = 0.2,
                 prior_ms: float = 20.0):
        self.costs, self.decay, self.prior_ms = costs, decay, prior_ms
        self.prior = prior_goodput(costs, mean_accept, k_max)
        self._marginal = [costs.marginal_ms(k) for k in range(0, k_max + 1)]
        self._round = [costs.round_time(k) for k in range(0, k_max + 1)]
        self._margins: dict = {}  # (cap, k_lo, k_hi) -> [cap, 1] float32 marginal ms (thresholds)
        self._margin_lists: dict = {}  # (cap, k_lo, k_hi) -> the same as host numbers (margins)
        self.tokens = self.time = None

    def reset(self, batch_size: int) -> None:
        self.tokens = [self.prior * self.prior_ms] * batch_size  # per-row floats: B is small, tensors cost more
        self.time = [self.prior_ms] * batch_size

    def measured(self, c: tuple) -> None:
        """Price rounds by measured costs from now on: a round of k candidates takes ``c[0] + (c[1] + c[2]) k`` ms and
        one more candidate ``c[1] + c[2]`` (``StopSelector``'s fit of the rounds' wall time on draft steps and
        verified tokens, :class:`~specdec_ext.policies.select.RoundTime`), each at least 1 us."""
        per = max(c[1] + c[2], 1e-3)
        self._marginal = [per] * len(self._marginal)
        self._round = [max(c[0] + per * k, 1e-3) for k in range(len(self._round))]
        self._margins.clear()
        self._margin_lists.clear()

    def _marginal_ms(self, k: int) -> float:
        """``costs.marginal_ms(k)``, from the table kept up to ``k_max``."""
        return self._marginal[k] if k < len(self._marginal) else self.costs.marginal_ms(k)

    def thresholds(self, cap: int, k_lo: int, k_hi: int, scale: float = 1.0,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[cap, B]`` float32: entry ``[k - 1, b]`` is the survival below which row b stops after candidate k,
        lambda_b marginal_ms(k) / ``scale``, for ``k_lo <= k < k_hi``, and -inf elsewhere (no stop there); the layout
        of ``ops.acceptance_head_step``'s ``stop_below``, one row per draft step. ``scale``: the head's survivals'
        calibration c (:class:`SurvivalCalibration`; the rule compares c S_k with lambda marginal_ms(k)).

        ``out``: a float32 CPU tensor ``[cap, >= B]`` whose first B columns receive the thresholds (one
        multiplication per round's plan, by a Python number at B = 1), returned; without it, a new tensor."""
        key = (cap, k_lo, k_hi)
        margins = self._margins.get(key)
        if margins is None:
            margins = self._margins[key] = torch.tensor(
                [[self._marginal_ms(k)] if k_lo <= k < k_hi else [-math.inf] for k in range(1, cap + 1)],
                dtype=torch.float32)
        B = len(self.tokens)
        if B == 1:
            rate = self.tokens[0] / (self.time[0] * scale)
        else:
            rate = torch.tensor([t / (m * scale) for t, m in zip(self.tokens, self.time)], dtype=torch.float32)
        if out is None:
            return margins * rate
        return torch.mul(margins, rate, out=out[:cap, :B])

    def rates(self, scale: float = 1.0) -> list:
        """Each row's lambda_b / ``scale`` in tokens/ms (the factor :meth:`thresholds` multiplies the margins by)."""
        return [t / (m * scale) for t, m in zip(self.tokens, self.time)]

    def margins(self, cap: int, k_lo: int, k_hi: int) -> list:
        """``marginal_ms(k)`` for k = 1 .. ``cap`` where ``k_lo <= k < k_hi``, -inf elsewhere (ms): :meth:`thresholds`
        before its multiplication, as host numbers."""
        key = (cap, k_lo, k_hi)
        hit = self._margin_lists.get(key)
        if hit is None:
            hit = self._margin_lists[key] = [self._marginal_ms(k) if k_lo <= k < k_hi else -math.inf
                                             for k in range(1, cap + 1)]
        return hit

    def update(self, num_drafted, num_accepted, emitted=None) -> None:
        """After verification: rows drafted ``num_drafted`` and emitted ``num_accepted + 1`` tokens (or ``emitted``
        when given); each ``[B]`` int64 tensors or lists of ints."""
        drafted = num_drafted.tolist() if isinstance(num_drafted, torch.Tensor) else num_drafted
        if emitted is None:
            accepted = num_accepted.tolist() if isinstance(num_accepted, torch.Tensor) else num_accepted
            toks = [a + 1 for a in accepted]
        else:
            toks = emitted.tolist() if isinstance(emitted, torch.Tensor) else emitted
        a, keep, table = self.decay, 1.0 - self.decay, self._round
        self.tokens = [keep * t + a * e for t, e in zip(self.tokens, toks)]
        self.time = [keep * tm + a * (table[n] if n < len(table) else self.costs.round_time(n))
                     for tm, n in zip(self.time, drafted)]

    def select(self, index: torch.Tensor) -> None:
        idx = index.tolist()
        self.tokens, self.time = [self.tokens[i] for i in idx], [self.time[i] for i in idx]

    def add_rows(self, n: int) -> None:
        """``n`` new rows, each starting from the prior as at ``reset``."""
        self.tokens = self.tokens + [self.prior * self.prior_ms] * n
        self.time = self.time + [self.prior_ms] * n


class SurvivalCalibration:
    """An online calibration of the acceptance head's survivals for ``threshold="auto"``'s per-row rule: a scale c
    with which the rule stops after candidate k when c S_k < lambda marginal_ms(k) (:class:`GoodputRule`).

    A calibrated head predicts the accepted count: a round's accepted candidates are sum_k 1[candidates 1..k
    accepted], each term of expectation S_k given what the head read, and where drafting stops depends only on the
    predictions, so E[accepted] = E[sum_{k <= K} S_k]. On prompts unlike the head's training data its p_hat may sit
    too low or too high; c is the ratio of exponential averages (weight ``decay`` per round) of the accepted counts
    and of the predicted ones, each starting at ``prior`` (c = 1), held within [``lo``, ``hi``]. One scale, not a
    refit of the head: a scale on S_k is what moves the rule's stops, and a round's accepted count is all a round
    shows (Platt scaling, Platt 1999, fits two numbers to per-candidate labels; the rounds give one count each).

    Kept by the policy across generation calls (the prompts a generator meets), reset by :meth:`reset`
    (``SpecDecPP.reset_adaptation``); a few float operations per round."""

    def __init__(self, decay: float = 0.02, prior: float = 25.0, lo: float = 0.5, hi: float = 2.0):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"SurvivalCalibration: decay must lie in (0, 1], got {decay!r}")
        if not prior > 0.0:
            raise ValueError(f"SurvivalCalibration: prior must be > 0 (accepted candidates' worth), got {prior!r}")
        if not 0.0 < lo <= 1.0 <= hi:
            raise ValueError(f"SurvivalCalibration: need 0 < lo <= 1 <= hi, got lo={lo!r}, hi={hi!r}")
        self.decay, self.prior, self.lo, self.hi = decay, prior, lo, hi
        self.rounds = 0
        self.reset()

    def reset(self) -> None:
        """Forget every round: c = 1."""
        self.accepted = self.predicted = self.prior
        self.rounds = 0

    @property
    def scale(self) -> float:
        """c: averaged accepted over predicted accepted candidates, within [lo, hi]."""
        return min(max(self.accepted / self.predicted, self.lo), self.hi)

    def update(self, predicted: float, accepted: float) -> None:
        """One round: its rows' predicted accepted candidates (sum of their S_k over the candidates they drafted and
        the head scored) and the candidates they accepted among those."""
        keep = 1.0 - self.decay
        self.predicted = keep * self.predicted + predicted
        self.accepted = keep * self.accepted + accepted
        self.rounds += 1


def prior_goodput(costs: CostModel, mean_accept: Optional[float], k_max: int) -> float:
    """A starting lambda: the best fixed K's goodput at the head's mean training acceptance (0.6 if unknown)."""
    return costs.best_fixed(0.6 if mean_accept is None else min(max(mean_accept, 0.0), 0.99), k_max)[1]
