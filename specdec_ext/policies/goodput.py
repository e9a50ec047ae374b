"""The cost model of a speculative round and the goodput arithmetic of the ``threshold="auto"`` rule.

A round that drafts K candidates costs (in ms, measured where the pair runs by ``engine.profile``)

    T(K) = round_ms + K * (draft_ms + step_ms) + verify_ms(K + 1),

K draft forwards (the first feeds the tokens the draft has not seen, each later one a candidate),
per-candidate work outside the forward (sampling, the head, the policy), one target forward over
the last committed token and the K candidates, and per-round work (verification op, rollback).
With per-candidate survival S_k = prod_{j<=k} p_hat_j (the predicted probability that candidates
1..k are all accepted), the round emits 1 + sum_{k<=K} S_k tokens in expectation (Leviathan et al.
2023, Eq. 1, with per-candidate rather than constant acceptance). The long-run goodput is
E[tokens] / E[time] per round (a renewal-reward ratio); the rule that maximises it drafts one more
candidate while its expected tokens exceed lambda times its cost, lambda being the goodput itself
(Dinkelbach's method for ratio objectives). vLLM's adaptive-K rule (pull request 44336) maximises
the same ratio over a fixed K per step; its DSpark verification scheduler (pull request 47808)
ranks drafted slots by survival against a profiled cost table.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import torch


@dataclass
class CostModel:
    """Costs of one speculative round at batch size 1, in ms.

    verify_ms: target forward over n tokens, ``verify_ms[n - 1]`` for n = 1 .. len (non-decreasing).
    draft_ms: one draft forward (one token).
    step_ms: per-candidate work outside the draft forward (sampling, features, policy).
    round_ms: per-round work outside both models' forwards (verification op, rollback, bookkeeping).
    meta: what and where it was measured (models, dtypes, device, threads, processor, date).
    """

    verify_ms: Sequence[float]
    draft_ms: float
    step_ms: float = 0.0
    round_ms: float = 0.0
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        v = [float(x) for x in self.verify_ms]
        if not v or any(not math.isfinite(x) or x <= 0 for x in v):
            raise ValueError(f"CostModel: verify_ms must be positive finite times (ms), got {self.verify_ms!r}")
        for name in ("draft_ms", "step_ms", "round_ms"):
            x = getattr(self, name)
            if not math.isfinite(x) or x < 0:
                raise ValueError(f"CostModel: {name} must be a finite time >= 0 (ms), got {x!r}")
        self.verify_ms = tuple(v)

    def verify(self, n: int) -> float:
        """Target forward over ``n`` >= 1 tokens (ms); beyond the table, the last step's slope continues."""
        v = self.verify_ms
        if n <= len(v):
            return v[n - 1]
        slope = max(0.0, v[-1] - v[-2]) if len(v) > 1 else 0.0
        return v[-1] + slope * (n - len(v))

    def round_time(self, k: int) -> float:
        """T(K) of the module docstring for K = ``k`` candidates (ms)."""
        return self.round_ms + k * (self.draft_ms + self.step_ms) + self.verify(k + 1)

    def marginal_ms(self, k: int) -> float:
        """Extra time of candidate k + 1 in a round that has k (ms)."""
        return self.draft_ms + self.step_ms + self.verify(k + 2) - self.verify(k + 1)

    def plain_ms(self) -> float:
        """One token of target-only decoding (ms)."""
        return self.round_ms + self.verify(1)

    def best_fixed(self, alpha: float, k_max: int = 20) -> tuple[int, float]:
        """(K, goodput in tokens/ms) of the best fixed candidate length when every candidate is
        accepted with probability ``alpha`` (expected tokens (1 - alpha^(K+1)) / (1 - alpha))."""
        best = (0, 1.0 / self.plain_ms())
        for k in range(1, k_max + 1):
            tokens = k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
            rate = tokens / self.round_time(k)
            if rate > best[1]:
                best = (k, rate)
        return best

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        d = json.loads(text)
        return cls(d["verify_ms"], d["draft_ms"], d.get("step_ms", 0.0), d.get("round_ms", 0.0), d.get("meta", {}))


def isotonic(values: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators): a verification over more tokens is
    taken never to cost less; measured dips are timing noise."""
    blocks: list[list[float]] = []  # [mean, weight]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2 = blocks.pop()
            m1, w1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    out: list[float] = []
    for m, w in blocks:
        out += [m] * int(w)
    return out


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
        self.tokens = self.time = None

    def reset(self, batch_size: int) -> None:
        self.tokens = [self.prior * self.prior_ms] * batch_size  # per-row floats: B is small, tensors cost more
        self.time = [self.prior_ms] * batch_size

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
        return [self._marginal_ms(k) if k_lo <= k < k_hi else -math.inf for k in range(1, cap + 1)]

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


@dataclass
class BatchCosts:
    """Costs of a batched round (ms), measured where the pair runs with the engine itself
    (``engine.profile.profile_batches``), at the batch sizes ``sizes`` (increasing):

    round_ms[i][k]: a whole round at batch size ``sizes[i]`` that drafts and verifies k candidates per row
        (k = 0: a step of plain decoding), everything included (draft forwards, head, target forward,
        verification, rollback), for k = 0 .. len - 1;
    verify_ms[i][n - 1]: the target's forward alone over ``[sizes[i], n]`` tokens (every row verifies n
        tokens: the verification is padded to the deepest row), with a cache of ``context`` columns;
    meta: what and where it was measured;
    context, wide_context, verify_wide_ms: the cache width (columns) of ``round_ms`` / ``verify_ms``, and the
        forward's cost again at the width ``wide_context`` (same layout as ``verify_ms``). On a CPU the
        target's attention over the cache is a large share of a batched forward (bundled pair, B = 16:
        31 ms at 128 columns, 52 ms at 512), and it grows with the number of tokens per row, so what a
        candidate costs depends on the width: costs at other widths are linear in it (0 / empty: no width
        dependence).
    """

    sizes: Sequence[int]
    round_ms: Sequence[Sequence[float]]
    verify_ms: Sequence[Sequence[float]]
    meta: dict = field(default_factory=dict)
    context: int = 0
    wide_context: int = 0
    verify_wide_ms: Sequence[Sequence[float]] = ()

    def __post_init__(self):
        n = len(self.sizes)
        if not n or list(self.sizes) != sorted(set(self.sizes)) or len(self.verify_ms) != n or len(self.round_ms) != n:
            raise ValueError("BatchCosts: need increasing sizes with one round_ms and one verify_ms row each")
        self.round_ms = [isotonic(v) for v in self.round_ms]
        self.verify_ms = [isotonic(v) for v in self.verify_ms]
        self._memo: dict = {}
        if self.verify_wide_ms:
            if len(self.verify_wide_ms) != n or not 0 < self.context < self.wide_context:
                raise ValueError("BatchCosts: verify_wide_ms needs one row per size and 0 < context < wide_context")
            self.verify_wide_ms = [isotonic(v) for v in self.verify_wide_ms]

    def _at(self, B: int, values: Sequence[float]) -> float:
        s = list(self.sizes)
        if B <= s[0]:
            return values[0] * (B / s[0] if B < s[0] else 1.0)
        for i in range(1, len(s)):
            if B <= s[i]:  # linear between measured sizes
                w = (B - s[i - 1]) / (s[i] - s[i - 1])
                return (1 - w) * values[i - 1] + w * values[i]
        return values[-1] * B / s[-1]  # beyond the table: proportional to rows

    @staticmethod
    def _extend(v: Sequence[float], i: int) -> float:
        if i < len(v):
            return v[i]
        slope = max(0.0, v[-1] - v[-2]) if len(v) > 1 else 0.0
        return v[-1] + slope * (i - len(v) + 1)

    def _table(self, name: str, B: int, i: int) -> float:
        """``round_ms`` / ``verify_ms`` / ``verify_wide_ms`` at batch size B and column i (memoised: the budget
        reads the table many times per round)."""
        key = (name, B, i)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._at(B, [self._extend(v, i) for v in getattr(self, name)])
        return hit

    def round(self, B: int, k: int, width: Optional[int] = None, verified: Optional[int] = None) -> float:
        """A round that drafts k candidates per row at batch size B (ms) and verifies ``verified`` of them (None: all
        k), with a target cache of ``width`` columns (None: the profiled width); beyond the table, the last step's
        slope continues. The width moves the round's cost by what it moves the verification's, and slots drafted
        but not verified take their share of the verification off. Never below a quarter of the round's own target
        forward over ``verified + 1`` tokens (as :meth:`verify` is never below a quarter of its narrow figure):
        whole rounds and forwards are profiled apart, so on small, noisy timings the differences could otherwise
        reach zero or below, and a measured-to-modelled time ratio (``BatchBudget.observe``) its logarithm's
        domain error."""
        v = k if verified is None else verified
        ms = self._table("round_ms", B, k)
        if width is not None and self.verify_wide_ms:
            ms += self.verify(B, k + 1, width) - self.verify(B, k + 1)
        if v != k:
            ms -= self.verify(B, k + 1, width) - self.verify(B, v + 1, width)
        return max(ms, 0.25 * self.verify(B, v + 1, width))

    def verify(self, B: int, n: int, width: Optional[int] = None) -> float:
        """The target's forward over ``[B, n]`` tokens (ms) with a cache of ``width`` columns (None: ``context``):
        linear in the width through the two measured widths (never below a quarter of the narrow figure)."""
        n = int(n)
        base = self._table("verify_ms", B, n - 1)
        if width is None or not self.verify_wide_ms or width == self.context:
            return base
        return self._widen(base, self._table("verify_wide_ms", B, n - 1), width)

    def _widen(self, base: float, wide: float, width: int) -> float:
        """A forward's ms at ``width`` columns from its ms at ``context`` (``base``) and ``wide_context`` (``wide``)."""
        slope = max(0.0, wide - base) / (self.wide_context - self.context)
        return max(0.25 * base, base + slope * (width - self.context))

    def _row(self, name: str, B: int, n: int) -> list[float]:
        """Columns 0 .. n - 1 of ``round_ms`` / ``verify_ms`` / ``verify_wide_ms`` at batch size B (memoised)."""
        key = ("row", name, B, n)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = [self._table(name, B, i) for i in range(n)]
        return hit

    def verify_row(self, B: int, n_max: int, width: Optional[int] = None) -> list[float]:
        """``[verify(B, n, width) for n = 1 .. n_max]`` (ms), computed at once: the budget reads every depth's cost
        each round, at a width that changes every round."""
        base = self._row("verify_ms", B, n_max)
        if width is None or not self.verify_wide_ms or width == self.context:
            return list(base)
        return [self._widen(b, w, width) for b, w in zip(base, self._row("verify_wide_ms", B, n_max))]

    def round_row(self, B: int, k_max: int, width: Optional[int] = None) -> list[float]:
        """``[round(B, k, width) for k = 0 .. k_max]`` (ms), every slot verified, computed at once."""
        v = self.verify_row(B, k_max + 1, width)
        narrow = self._row("verify_ms", B, k_max + 1) if width is not None and self.verify_wide_ms else v
        return [max(ms + (vk - nk), 0.25 * vk) for ms, vk, nk in zip(self._row("round_ms", B, k_max + 1), v, narrow)]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "BatchCosts":
        d = json.loads(text)
        return cls(d["sizes"], d["round_ms"], d["verify_ms"], d.get("meta", {}), d.get("context", 0),
                   d.get("wide_context", 0), d.get("verify_wide_ms", ()))


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


class DriftFilter:
    """A Kalman filter of the rounds' measured costs against the table, with ``BatchBudget(cost_drift=True)``:
    log(measured / table ms) of a round of depth k is d + o_k + noise, d a drift common to every depth (o_0 = 0,
    so d is that of a plain step) and o_k how much dearer than the table, relative to a plain step, a round of k
    candidates is. d follows a random walk of ``drift_sd`` per round (the machine's load, the contexts' width, the
    text: on the bundled pair at B = 4 on a 2-core CPU, every depth's rounds ran some 25% over the table in one
    stretch of prompts and not in the next); o_k starts at 0 with sd ``offset_sd`` (the table's relative costs,
    trusted to within about a third) and moves by ``offset_step`` sd per round; a round's own noise has sd
    ``round_sd``. A round's innovation is clipped to within ``clip`` (a round that stalls moves the state by a
    bounded step); a depth's first rounds instead set its estimate (:meth:`anchor`). With per-depth running means
    (``cost_drift=False``), a depth not played for a while keeps the cost it
    had when last played, so a drift that raised the played depth's cost made the unplayed ones look cheaper: at
    B = 4 the budget went to plain decoding for some thirty rounds, where rounds of two candidates had given 1.5x its
    tokens per ms. Here a round of any depth moves d, so every depth's cost follows the drift, and the offsets,
    identified only by comparing depths, move only as far as the rounds at several depths show them to differ.
    Standard Kalman predict / update (e.g. Sarkka, Bayesian Filtering and Smoothing, 2013, Sec. 4.3); the state has
    ``depth_max + 1`` entries, so a round's update is a few hundred floating-point operations."""

    def __init__(self, depth_max: int, round_sd: float = 0.12, drift_sd: float = 0.03, offset_sd: float = 0.3,
                 offset_step: float = 0.005):
        n = depth_max + 1
        self.round_var, self.drift_var, self.step_var = round_sd ** 2, drift_sd ** 2, offset_step ** 2
        self.x = [0.0] * n  # d, o_1 .. o_depth_max
        self.P = [[(1.0 if i == 0 else offset_sd ** 2) if i == j else 0.0 for j in range(n)] for i in range(n)]

    def log_ratio(self, k: int) -> float:
        """The estimate of log(measured / table ms) of a round of depth k now: d + o_k."""
        return self.x[0] + (self.x[k] if k else 0.0)

    def anchor(self, k: int, log_ratio: float, var: float) -> None:
        """Set depth k's estimate d + o_k to ``log_ratio`` (with variance ``var``), every other depth's d + o_j left
        as it was (k = 0 moves d, and every o_j by the opposite amount): a depth's first rounds measure how far the
        table misjudges that depth, not a drift of every depth (:meth:`BatchBudget.observe`)."""
        x, P, n = self.x, self.P, len(self.x)
        if k:
            x[k] = log_ratio - x[0]
        else:
            shift, x[0] = log_ratio - x[0], log_ratio
            for j in range(1, n):
                x[j] -= shift
        for j in range(n):
            P[k][j] = P[j][k] = 0.0
        P[k][k] = var

    def observe(self, k: int, log_ratio: float, clip: float) -> None:
        """One round of depth k whose log(measured / table ms) was ``log_ratio``."""
        x, P, n = self.x, self.P, len(self.x)
        for i in range(n):  # predict: d and every o_k walk
            P[i][i] += self.drift_var if i == 0 else self.step_var
        idx = (0, k) if k else (0,)  # the observation reads d + o_k
        Ph = [sum(P[i][j] for j in idx) for i in range(n)]
        S = sum(Ph[i] for i in idx) + self.round_var
        innovation = min(max(log_ratio - sum(x[i] for i in idx), -clip), clip)
        gain = [v / S for v in Ph]
        for i in range(n):
            x[i] += gain[i] * innovation
            row = P[i]
            for j in range(n):
                row[j] -= gain[i] * Ph[j]


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
        scored rounds): no survivals are read below the cap, so neither :meth:`go_on` nor :meth:`depth` is asked."""
        return self.measure and not self.in_round and not self.score_last

    def go_threshold(self, B: int, k: int) -> float:
        """The live rows' summed survival sum_b S_bk at or above which the batch drafts candidate k + 1 (the one-step
        rule: a sum_b S_bk rho_k >= lambda (T_B(k + 1) - T_B(k))): +inf at or past the cap, -inf while the round
        measures its depth (:attr:`forced`). The values of one round are fixed before it drafts, so the rule is a
        comparison on the device (``policies/builtin.py``)."""
        if k >= self.cap:
            return math.inf
        if self.forced:  # measuring this depth's cost: the round must reach it
            return -math.inf
        need = self._lambda(B) * (self._round(B, k + 1) - self._round(B, k))
        scale = self.head_scale * self._next_ratio(k)
        if scale <= 0:
            return math.inf if need > 0 else -math.inf
        return need / scale

    def go_on(self, k: int, survival: torch.Tensor) -> bool:
        """Whether the batch drafts candidate k + 1, given the live rows' survivals S_bk ``[B]`` (0 for rows
        that cannot draft further): :meth:`go_threshold`."""
        return float(survival.double().sum()) >= self.go_threshold(survival.shape[0], k)

    def depth_costs(self, B: int, k: int) -> list[float]:
        """lambda_k verify_B(d + 1) for d = 0 .. k (what verifying d slots per row costs, in expected tokens, after k
        were drafted): :meth:`depth` keeps the d that maximises a sum_b sum_{j<=d} S_bj minus it."""
        lam = self._lambda(B) * self.calibration(k)
        return [lam * v for v in self.batch.verify_row(B, k + 1, self.width)]

    def depth(self, survivals: torch.Tensor) -> int:
        """The depth d in 0..k to verify, given survivals ``[B, k]`` (S_bj, 0 beyond a row's own candidates)."""
        B, k = survivals.shape
        gain = [0.0, *itertools.accumulate(survivals.double().sum(0).tolist())]  # a few floats: lists beat tensors
        a = self.head_scale
        values = [a * g - c for g, c in zip(gain, self.depth_costs(B, k))]
        return max(range(k + 1), key=lambda d: (values[d], d))

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
