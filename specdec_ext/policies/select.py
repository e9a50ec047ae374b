"""``threshold="auto"``'s choice of stop rule, round by round, by measured goodput.

The per-row SpecDec++ stop rules are all of one form: stop after candidate k once the head's survival
S_k = prod_{j<=k} p_hat_j falls below a threshold t_k (a fixed stop threshold h is t_k = 1 - h, SpecDec++ Sec. 3.2;
the goodput rule's t_k = lambda * marginal_ms(k) / c, :class:`~specdec_ext.policies.goodput.GoodputRule`). Which one
serves best depends on how well the head is calibrated on the prompts at hand and on what a draft step costs against
a verification on the machine at hand, so :class:`StopSelector` measures instead of trusting either: each rule is an
arm of a bandit whose reward is goodput, tokens emitted per ms of measured round time, and Thompson sampling
(Thompson 1933; Agrawal and Goyal 2012) picks the arm of each round. BanditSpec (Hou et al. 2025, arXiv 2505.15141)
chooses a speculative configuration per round the same way; here the arms share their rounds:

- **Counterfactual rounds.** The round reads back each row's survivals S_1 .. S_d of the candidates it drafted, so
  for any arm the candidate length it would have chosen, K_a = the first k with S_k < t_k (or the played length d), is
  known whenever K_a <= d, and with it the tokens it would have emitted, min(accepted, K_a) + 1: the acceptance of
  candidate i does not depend on how many follow it (greedy: the target's argmax; sampling: the same candidate and
  uniform). An arm is updated from a round only where the played arm's thresholds lie at or below its own at every
  depth the round could reach (it always stops no later), so that whether it learns from a round does not depend on
  how the round went: its samples stay unbiased. A deep arm played teaches every shallower one.
- **Measured time.** A round's cost is fitted online, ms = c0 + c1 * draft steps + c2 * verified tokens, by
  discounted ridge regression on each round's measured wall time (the host's work between rounds included), from a
  prior of the profiled :class:`~specdec_ext.policies.goodput.CostModel`; every arm's rounds are priced by the same
  fit, so the comparison is paired. Eager forwards, CUDA graphs, compiled forwards, a CPU or a GPU: the fit is what
  the rounds cost where they run.
- **Forgetting.** Every sum decays by ``discount`` per round (a window of about 1 / (1 - discount) rounds), so the
  choice follows the prompts as they change.

An arm's goodput estimate is the ratio of its discounted sums, r = sum(tokens) / sum(modelled ms), with the variance of
a ratio estimator (the delta method: the residuals tokens - r * ms over the effective number of rounds); each round
draws r from N(r_hat, var) per arm and plays the largest draw. An arm with fewer than ``min_rounds`` effective rounds
is played first (the deepest of those first, which teaches the rest). Only the candidate length changes: every arm's
rounds are verified by the same lossless rejection sampling.
"""

from __future__ import annotations

import math
import random
from collections import deque
from typing import Optional, Sequence, Union

DEFAULT_THRESHOLDS = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # the fixed-h arms of threshold="auto"
GOODPUT = "goodput"  # the name of the goodput rule's arm


def first_stop(survivals: Sequence[float], drafted: int, lo: int, thresholds: Union[float, Sequence[float]]) -> int:
    """The candidate length a rule with ``thresholds`` (one for every depth, or ``t[k - 1]`` per depth k) chooses in a
    round that drafted ``drafted`` candidates with survivals ``survivals[k - 1]`` after candidate k: the first
    k >= ``lo`` with S_k < t_k, else ``drafted`` (the round's own length: the rule stops no later where the played one
    dominates)."""
    if isinstance(thresholds, (int, float)):
        for k in range(lo, drafted + 1):
            if survivals[k - 1] < thresholds:
                return k
        return drafted
    for k in range(lo, drafted + 1):
        if survivals[k - 1] < thresholds[k - 1]:
            return k
    return drafted


class _Arm:
    """One stop rule's discounted sums: rounds (w and w^2), tokens, their squares, the round's features
    x = (1, draft steps, verified tokens), tokens * x and x x^T (upper triangle), as of round ``at``."""

    __slots__ = ("name", "h", "at", "w", "w2", "y", "yy", "x", "yx", "xx")

    def __init__(self, name: str, h: Optional[float]):
        self.name, self.h = name, h
        self.at = 0
        self.w = self.w2 = self.y = self.yy = 0.0
        self.x = [0.0, 0.0, 0.0]
        self.yx = [0.0, 0.0, 0.0]
        self.xx = [0.0] * 6  # (0,0) (0,1) (0,2) (1,1) (1,2) (2,2)

    def add(self, now: int, g: float, tokens: float, steps: float, verified: float) -> None:
        if self.w:
            f = g ** (now - self.at)
            if f != 1.0:
                f2 = f * f
                self.w, self.w2, self.y, self.yy = self.w * f, self.w2 * f2, self.y * f, self.yy * f
                self.x = [v * f for v in self.x]
                self.yx = [v * f for v in self.yx]
                self.xx = [v * f for v in self.xx]
        self.at = now
        self.w += 1.0
        self.w2 += 1.0
        self.y += tokens
        self.yy += tokens * tokens
        x, yx, xx = self.x, self.yx, self.xx
        x[0] += 1.0
        x[1] += steps
        x[2] += verified
        yx[0] += tokens
        yx[1] += tokens * steps
        yx[2] += tokens * verified
        xx[0] += 1.0
        xx[1] += steps
        xx[2] += verified
        xx[3] += steps * steps
        xx[4] += steps * verified
        xx[5] += verified * verified

    @property
    def rounds(self) -> float:
        """The effective number of rounds, (sum w)^2 / sum w^2."""
        return self.w * self.w / self.w2 if self.w2 else 0.0

    def estimate(self, c: Sequence[float]) -> tuple:
        """(goodput in tokens/ms, its variance) under the cost fit ``c``."""
        ms = c[0] * self.x[0] + c[1] * self.x[1] + c[2] * self.x[2]
        if self.w <= 0.0 or ms <= 0.0:
            return 0.0, math.inf
        r = self.y / ms
        xx = self.xx
        cxxc = (c[0] * c[0] * xx[0] + c[1] * c[1] * xx[3] + c[2] * c[2] * xx[5]
                + 2.0 * (c[0] * c[1] * xx[1] + c[0] * c[2] * xx[2] + c[1] * c[2] * xx[4]))
        cyx = c[0] * self.yx[0] + c[1] * self.yx[1] + c[2] * self.yx[2]
        resid = max(self.yy - 2.0 * r * cyx + r * r * cxxc, 0.0)  # sum w (tokens - r ms)^2
        return r, resid / self.w * self.w2 / (ms * ms)


class RoundTime:
    """A round's wall time, ms = c0 + c1 * draft steps + c2 * verified tokens, fitted by discounted ridge regression
    (weight ``discount`` per round) toward the prior ``c`` (``prior_weight``: a quarter of a round's worth per
    coefficient, enough to split what the rounds cannot tell apart, e.g. draft steps from verified tokens where the two
    are always equal) on the rounds' measured times."""

    def __init__(self, prior: Sequence[float], discount: float = 0.995, prior_weight: float = 0.25):
        self.prior = [float(v) for v in prior]
        self.discount, self.prior_weight = discount, prior_weight
        self.reset()

    def reset(self) -> None:
        self.a = [0.0] * 6  # sum w x x^T, upper triangle as _Arm.xx
        self.b = [0.0, 0.0, 0.0]  # sum w x ms
        self.c = list(self.prior)
        self.rounds = 0

    def add(self, steps: float, verified: float, ms: float) -> None:
        g = self.discount
        a, b = self.a, self.b
        for i in range(6):
            a[i] *= g
        b[0] = b[0] * g + ms
        b[1] = b[1] * g + ms * steps
        b[2] = b[2] * g + ms * verified
        a[0] += 1.0
        a[1] += steps
        a[2] += verified
        a[3] += steps * steps
        a[4] += steps * verified
        a[5] += verified * verified
        self.rounds += 1
        lam, p = self.prior_weight, self.prior
        m = [[a[0] + lam, a[1], a[2]], [a[1], a[3] + lam, a[4]], [a[2], a[4], a[5] + lam]]
        rhs = [b[0] + lam * p[0], b[1] + lam * p[1], b[2] + lam * p[2]]
        c = _solve3(m, rhs)
        if c is not None:
            self.c = c

    def ms(self, steps: float, verified: float) -> float:
        c = self.c
        return c[0] + c[1] * steps + c[2] * verified


def _solve3(m: list, rhs: list) -> Optional[list]:
    """The solution of a symmetric positive definite 3 x 3 system (Cramer's rule), or None when singular."""
    (a, b, c), (_, e, f), (_, _, i) = m
    d = a * (e * i - f * f) - b * (b * i - f * c) + c * (b * f - e * c)
    if not d or not math.isfinite(d):
        return None
    x0 = (rhs[0] * (e * i - f * f) - b * (rhs[1] * i - f * rhs[2]) + c * (rhs[1] * f - e * rhs[2])) / d
    x1 = (a * (rhs[1] * i - f * rhs[2]) - rhs[0] * (b * i - f * c) + c * (b * rhs[2] - rhs[1] * c)) / d
    x2 = (a * (e * rhs[2] - rhs[1] * f) - b * (b * rhs[2] - rhs[1] * c) + rhs[0] * (b * f - e * c)) / d
    return [x0, x1, x2]


class StopSelector:
    """The bandit over ``threshold="auto"``'s stop rules (module docstring): an arm per fixed stop threshold h in
    ``thresholds`` and, with ``goodput_arm``, the goodput rule's arm (:data:`GOODPUT`).

    Per round, :meth:`choose` returns the arm to play (an index into :attr:`arms`, whose ``h`` is None for the goodput
    arm), and :meth:`observe` takes what the round did: the played and every arm's thresholds per row, each row's
    survivals and drafted and accepted counts, and the round's measured time. Kept across a generator's calls (what
    it learned carries from prompt to prompt) until :meth:`reset`.

    Args:
        thresholds: the stop thresholds h of the fixed arms, each in [0, 1].
        goodput_arm: also an arm for the goodput rule.
        prior: the cost fit's prior (c0, c1, c2) in ms (:class:`RoundTime`; :meth:`prior_from` makes it from a
            profiled :class:`~specdec_ext.policies.goodput.CostModel`).
        discount: the arms' forgetting per round.
        min_rounds: effective rounds an arm needs before its estimate decides.
        seed: the draws' seed (the choice is reproducible for equal rounds and times).

    Raises ValueError for no arm, a threshold outside [0, 1], a discount outside (0, 1] or ``min_rounds`` < 1."""

    def __init__(self, thresholds: Sequence[float] = DEFAULT_THRESHOLDS, goodput_arm: bool = True,
                 prior: Sequence[float] = (10.0, 1.0, 0.0), discount: float = 0.997, min_rounds: float = 3.0,
                 seed: int = 0):
        hs = [float(h) for h in thresholds]
        if any(not 0.0 <= h <= 1.0 for h in hs):
            raise ValueError(f"StopSelector: thresholds must lie in [0, 1], got {list(thresholds)!r}")
        if not hs and not goodput_arm:
            raise ValueError("StopSelector: no arm (give thresholds or goodput_arm=True)")
        if not 0.0 < discount <= 1.0:
            raise ValueError(f"StopSelector: discount must lie in (0, 1], got {discount!r}")
        if not min_rounds >= 1.0:
            raise ValueError(f"StopSelector: min_rounds must be >= 1, got {min_rounds!r}")
        self.thresholds, self.goodput_arm = tuple(sorted(set(hs))), bool(goodput_arm)
        self.discount, self.min_rounds, self.seed = discount, min_rounds, seed
        self.time = RoundTime(prior)
        self.reset()

    @staticmethod
    def prior_from(costs) -> tuple:
        """(c0, c1, c2) in ms from a profiled CostModel: a plain step, a draft step with its per-candidate work, and
        a verified token (the verification's mean slope over its first four tokens)."""
        slope = max(0.0, (costs.verify(5) - costs.verify(1)) / 4.0)
        return (costs.plain_ms(), costs.draft_ms + costs.step_ms, slope)

    def reset(self) -> None:
        """Forget every round: arms, cost fit and the record of choices."""
        self.arms = [_Arm(f"h={h:g}", h) for h in self.thresholds] + ([_Arm(GOODPUT, None)] if self.goodput_arm else [])
        self.time.reset()
        self.rng = random.Random(self.seed)
        self.now = 0
        self.played: Optional[int] = None
        self.history: deque = deque(maxlen=1 << 16)  # the arm played in each round, the latest rounds

    def configure(self, prior: Sequence[float]) -> None:
        """A new prior for the cost fit (the pair's profile); the fit restarts only where nothing was measured yet."""
        self.time.prior = [float(v) for v in prior]
        if not self.time.rounds:
            self.time.c = list(self.time.prior)

    def choose(self, depth_order: Sequence[int]) -> int:
        """The arm to play this round: the first of ``depth_order`` (arm indices, the deepest first) whose effective
        rounds are below ``min_rounds``, else the largest of the arms' goodput draws (Thompson sampling)."""
        for a in depth_order:
            if self.arms[a].rounds < self.min_rounds:
                self.played = a
                return a
        c, best, pick = self.time.c, -math.inf, 0
        for i, arm in enumerate(self.arms):
            r, var = arm.estimate(c)
            draw = r + math.sqrt(var) * self.rng.gauss(0.0, 1.0) if var < math.inf else math.inf
            if draw > best:
                best, pick = draw, i
        self.played = pick
        return pick

    def observe(self, played: int, thresholds: Sequence[Sequence], bounds: Sequence[Sequence[tuple]], lo: int,
                survivals: Sequence[Sequence[float]], drafted: Sequence[int], accepted: Sequence[int],
                steps_of, verified_of, ms: float, played_steps: int, played_verified: int) -> None:
        """One round. ``thresholds[a][b]``: arm a's thresholds for row b (a number, or one per depth); ``bounds[a][b]``:
        their (least, greatest) over the depths row b could reach; ``lo``: the first depth a rule may stop at;
        ``survivals[b]``: row b's S_k after each candidate it drafted; ``drafted`` / ``accepted``: per row;
        ``steps_of(depth)`` / ``verified_of(depth)``: the draft steps and verified tokens of a round whose deepest row
        drafted ``depth`` (how the round's reads of its stop flags turn depth into work); ``ms``: the round's measured
        time (0: not measured, e.g. a call's first round or a tensor-parallel target); ``played_steps`` /
        ``played_verified``: what the played round ran."""
        self.now += 1
        self.history.append(played)
        if ms > 0.0:
            self.time.add(played_steps, played_verified, ms)
        top = [bp[1] for bp in bounds[played]]  # the played arm's greatest threshold per row
        g, now = self.discount, self.now
        for a, arm in enumerate(self.arms):
            if a != played and any(hi > ba[0] for hi, ba in zip(top, bounds[a])):
                continue  # not dominated: this arm could have drafted deeper than the round did
            tokens, depth = 0, 0
            for b, d in enumerate(drafted):
                k = first_stop(survivals[b], d, lo, thresholds[a][b]) if d and a != played else d
                tokens += min(accepted[b], k) + 1
                depth = max(depth, k)
            if a == played:
                arm.add(now, g, tokens, played_steps, played_verified)
            else:
                arm.add(now, g, tokens, steps_of(depth), verified_of(depth))

    def estimates(self) -> list:
        """Per arm: (name, goodput in tokens/ms, its standard deviation, effective rounds), under the current cost
        fit."""
        out = []
        for arm in self.arms:
            r, var = arm.estimate(self.time.c)
            out.append((arm.name, r, math.sqrt(var) if var < math.inf else math.inf, arm.rounds))
        return out

    def shares(self, last: Optional[int] = None) -> dict:
        """The share of the latest ``last`` rounds (all kept ones by default) each arm was played in, by name."""
        played = list(self.history)[-last:] if last else list(self.history)
        n = max(1, len(played))
        return {arm.name: played.count(i) / n for i, arm in enumerate(self.arms) if played.count(i)}
