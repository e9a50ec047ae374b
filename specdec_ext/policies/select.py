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
  prior of the profiled :class:`~specdec_ext.policies.costs.CostModel`; every arm's rounds are priced by the same
  fit, so the comparison is paired. Eager forwards, CUDA graphs, compiled forwards, a CPU or a GPU: the fit is what
  the rounds cost where they run.
- **Forgetting.** Every sum decays by ``discount`` per round (a window of about 1 / (1 - discount) rounds), so the
  choice follows the prompts as they change.
- **Plain steps.** Where the rounds played, over at least :data:`PLAIN_AFTER` of them, emit fewer tokens per ms of
  their measured cycle than a plain step does (one token per plain step's measured cycle; before one ran, the
  profile's step), drafting does not pay on this machine: the policy runs plain steps, with an arm's round now and
  then to keep the estimates current (:meth:`StopSelector.plain_pays`). Both sides are measured the same way, wall
  time from one round's end to the next's; the arms' modelled goodputs are not used for it: the round-time fit prices
  arms against each other, and against a plain step it erred by 5-10% both ways (SmolLM2-135M, 2-core Xeon with AMX:
  1.08x a plain step's where SpecDec++ h = 0.7 ran 1.16x plain in bf16; 0.99x where the rounds ran 0.87x with the
  GGUF file's 4-bit blocks).

The shallowest arm (the smallest h) stops no later than any other, so every round shows it: it is the reference, and
each arm is judged on the rounds that showed both, by rho = (its tokens / its ms) / (the reference's tokens / ms) over
those rounds (discounted sums). Paired so, the rounds' own spread (easy and hard stretches of text, which move every
arm alike) cancels, and arms a few percent apart are told apart in tens of rounds rather than thousands. The variance
of log rho comes from the delta method on the four sums; each round draws log rho from N(estimate, variance) per arm
(the reference draws 0) and plays the largest draw. An arm with fewer than ``min_rounds`` effective rounds is played
first (the deepest of those first, which teaches the rest). Only the candidate length changes: every arm's rounds are
verified by the same lossless rejection sampling.
"""

from __future__ import annotations

import math
import random
from collections import deque
from typing import Optional, Sequence, Union

from .costs import MeasuredRates

# the fixed-h arms of threshold="auto". h = 0.9 is left out: on none of four prompt sets was it the best h (0.95-0.98x
# the best, paired), and a deep arm is learned only by playing it; the goodput rule's arm drafts deep where that pays
DEFAULT_THRESHOLDS = (0.4, 0.5, 0.6, 0.7, 0.8)
GOODPUT = "goodput"  # the name of the goodput rule's arm
PLAIN = "plain"  # the name of a plain step (no draft) in the record of rounds (StopSelector.plain_pays)
PLAIN_AFTER = 64  # measured rounds before plain steps may replace the arms' rounds


def first_stop(survivals: Sequence[float], drafted: int, lo: int,
               thresholds: Union[float, Sequence[float], tuple]) -> int:
    """The candidate length a rule with ``thresholds`` chooses in a round that drafted ``drafted`` candidates with
    survivals ``survivals[k - 1]`` after candidate k: the first k >= ``lo`` with S_k < t_k, else ``drafted`` (the
    round's own length: the rule stops no later where the played one dominates). ``thresholds``: one t for every
    depth, ``t[k - 1]`` per depth k, or ``(margins, rate)`` for t_k = margins[k - 1] * rate (the goodput rule's)."""
    if isinstance(thresholds, (int, float)):
        for k in range(lo, drafted + 1):
            if survivals[k - 1] < thresholds:
                return k
        return drafted
    if isinstance(thresholds, tuple):
        margins, rate = thresholds
        for k in range(lo, drafted + 1):
            if survivals[k - 1] < margins[k - 1] * rate:
                return k
        return drafted
    for k in range(lo, drafted + 1):
        if survivals[k - 1] < thresholds[k - 1]:
            return k
    return drafted


def threshold_at(thresholds: Union[float, Sequence[float], tuple], k: int) -> float:
    """t_k of ``thresholds`` in any of :func:`first_stop`'s forms."""
    if isinstance(thresholds, (int, float)):
        return thresholds
    if isinstance(thresholds, tuple):
        return thresholds[0][k - 1] * thresholds[1]
    return thresholds[k - 1]


class _Arm:
    """One stop rule's sums, paired with the reference arm's on the same rounds: per round v = (tokens, ms, the
    reference's tokens, its ms), ms the round's modelled time when observed; w, w^2, sum w v and sum w^2 v_i v_j
    (upper triangle), each round's weight w growing by 1 / discount per round (:class:`StopSelector`'s forgetting:
    every estimate is a ratio of these sums, so a common scale cancels)."""

    __slots__ = ("name", "h", "w", "w2", "s", "m")

    def __init__(self, name: str, h: Optional[float]):
        self.name, self.h = name, h
        self.w = self.w2 = 0.0
        self.s = [0.0] * 4
        self.m = [0.0] * 10  # (0,0) (0,1) (0,2) (0,3) (1,1) (1,2) (1,3) (2,2) (2,3) (3,3)

    def add(self, w: float, tokens: float, ms: float, ref_tokens: float, ref_ms: float) -> None:
        w2 = w * w
        self.w += w
        self.w2 += w2
        s, m = self.s, self.m
        s[0] += w * tokens
        s[1] += w * ms
        s[2] += w * ref_tokens
        s[3] += w * ref_ms
        m[0] += w2 * tokens * tokens
        m[1] += w2 * tokens * ms
        m[2] += w2 * tokens * ref_tokens
        m[3] += w2 * tokens * ref_ms
        m[4] += w2 * ms * ms
        m[5] += w2 * ms * ref_tokens
        m[6] += w2 * ms * ref_ms
        m[7] += w2 * ref_tokens * ref_tokens
        m[8] += w2 * ref_tokens * ref_ms
        m[9] += w2 * ref_ms * ref_ms

    def rescale(self, f: float) -> None:
        """Every sum times ``f`` (``f``^2 for the second moments): the weights brought back near 1."""
        f2 = f * f
        self.w, self.w2 = self.w * f, self.w2 * f2
        self.s = [v * f for v in self.s]
        self.m = [v * f2 for v in self.m]

    @property
    def rounds(self) -> float:
        """The effective number of rounds, (sum w)^2 / sum w^2."""
        return self.w * self.w / self.w2 if self.w2 else 0.0

    @property
    def goodput(self) -> float:
        """tokens / ms over the rounds it was observed in."""
        return self.s[0] / self.s[1] if self.s[1] > 0 else 0.0

    def relative(self) -> tuple:
        """(log of its goodput over the reference's on the same rounds, that log's variance): the delta method on
        the four sums, a = d log(rho) / d(sum w v_i) = (1/S0, -1/S1, -1/S2, 1/S3), var = a^T (sum w^2 v v^T) a (the
        centring term vanishes: a . mean = 0); the rounds' own spread, common to both arms, cancels."""
        s0, s1, s2, s3 = self.s
        if self.w <= 0.0 or s0 <= 0.0 or s1 <= 0.0 or s2 <= 0.0 or s3 <= 0.0:
            return 0.0, math.inf
        a0, a1, a2, a3 = 1.0 / s0, -1.0 / s1, -1.0 / s2, 1.0 / s3
        m = self.m
        var = (a0 * a0 * m[0] + a1 * a1 * m[4] + a2 * a2 * m[7] + a3 * a3 * m[9]
               + 2.0 * (a0 * (a1 * m[1] + a2 * m[2] + a3 * m[3]) + a1 * (a2 * m[5] + a3 * m[6]) + a2 * a3 * m[8]))
        return math.log(s0 * s3 / (s1 * s2)), max(var, 0.0)


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
        self.a = [0.0] * 6  # sum w x x^T, upper triangle: (0,0) (0,1) (0,2) (1,1) (1,2) (2,2)
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
            profiled :class:`~specdec_ext.policies.costs.CostModel`).
        discount: the arms' forgetting per round.
        min_rounds: effective rounds an arm needs before its estimate decides.
        hold: rounds an arm is played for between two draws (the draws' host work spread over them).
        every: the arms learn from one round in ``every`` (:meth:`credit`: a round chosen by its index, so the
            samples stay unbiased; the crediting's host work spread over the rounds); every round's time goes into
            the cost fit.
        seed: the draws' seed (the choice is reproducible for equal rounds and times).

    Raises ValueError for no arm, a threshold outside [0, 1], a discount outside (0, 1], ``min_rounds`` < 1, or
    ``hold`` or ``every`` below 1."""

    def __init__(self, thresholds: Sequence[float] = DEFAULT_THRESHOLDS, goodput_arm: bool = True,
                 prior: Sequence[float] = (10.0, 1.0, 0.0), discount: float = 0.997, min_rounds: float = 3.0,
                 hold: int = 4, every: int = 4, seed: int = 0):
        hs = [float(h) for h in thresholds]
        if any(not 0.0 <= h <= 1.0 for h in hs):
            raise ValueError(f"StopSelector: thresholds must lie in [0, 1], got {list(thresholds)!r}")
        if not hs and not goodput_arm:
            raise ValueError("StopSelector: no arm (give thresholds or goodput_arm=True)")
        if not 0.0 < discount <= 1.0:
            raise ValueError(f"StopSelector: discount must lie in (0, 1], got {discount!r}")
        if not min_rounds >= 1.0:
            raise ValueError(f"StopSelector: min_rounds must be >= 1, got {min_rounds!r}")
        for name, value in (("hold", hold), ("every", every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StopSelector: {name} must be an integer >= 1 (rounds), got {value!r}")
        self.thresholds, self.goodput_arm = tuple(sorted(set(hs))), bool(goodput_arm)
        self.discount, self.min_rounds, self.hold, self.every, self.seed = discount, min_rounds, hold, every, seed
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
        self.ref = 0  # the reference arm: the shallowest (the smallest h), which any other arm's round shows
        self.weight = 1.0  # this round's weight: 1 / discount per round since the last rescale (_Arm)
        self.time.reset()
        self.rng = random.Random(self.seed)
        self.now = 0
        self.played: Optional[int] = None
        self.history: deque = deque(maxlen=1 << 16)  # the arm played in each round, the latest rounds
        self.spent_s = 0.0  # the host's time choosing and crediting arms (the policy's share counted in too)
        self.measured_ms = 0.0  # the rounds' measured time (RoundResult.cycle_ms) over the rounds that had one
        self.rates = MeasuredRates(self.time.discount)  # the played rounds and plain steps as measured (plain_pays)

    def configure(self, prior: Sequence[float]) -> None:
        """A new prior for the cost fit (the pair's profile); the fit restarts only where nothing was measured yet."""
        self.time.prior = [float(v) for v in prior]
        if not self.time.rounds:
            self.time.c = list(self.time.prior)

    def choose(self, depth_order: Sequence[int]) -> int:
        """The arm to play this round: the first of ``depth_order`` (arm indices, the deepest first) whose effective
        rounds are below ``min_rounds``, else the largest of the arms' draws of their goodput relative to the
        reference arm's (Thompson sampling on the paired log-ratio; the reference arm draws 0), drawn anew every
        ``hold`` rounds."""
        if self.played is not None and self.now % self.hold and self.arms[self.played].rounds >= self.min_rounds:
            return self.played
        for a in depth_order:
            if self.arms[a].rounds < self.min_rounds:
                self.played = a
                return a
        best, pick = -math.inf, self.ref
        for i, arm in enumerate(self.arms):
            if i == self.ref:
                draw = 0.0
            else:
                mean, var = arm.relative()
                draw = mean + math.sqrt(var) * self.rng.gauss(0.0, 1.0) if var < math.inf else math.inf
            if draw > best:
                best, pick = draw, i
        self.played = pick
        return pick

    def observe(self, played: int, thresholds: Sequence[Sequence], bounds: Sequence[Sequence[tuple]], lo: int,
                survivals: Sequence[Sequence[float]], drafted: Sequence[int], accepted: Sequence[int],
                steps_of, verified_of, ms: float, played_steps: int, played_verified: int) -> None:
        """One round (:meth:`tick`, then :meth:`credit` where due). ``thresholds[a][b]``: arm a's thresholds for row b
        (any form :func:`first_stop` takes); ``bounds[a][b]``: their (least, greatest) over the depths row b could
        reach; ``lo``: the first depth a rule may stop at; ``survivals[b]``: row b's S_k after each candidate it
        drafted; ``drafted`` / ``accepted``: per row; ``steps_of(depth)`` / ``verified_of(depth)``: the draft steps and
        verified tokens of a round whose deepest row drafted ``depth`` (how the round's reads of its stop flags turn
        depth into work); ``ms``: the round's measured time (0: not measured, e.g. a call's first round or a
        tensor-parallel target); ``played_steps`` / ``played_verified``: what the played round ran."""
        if self.tick(played, ms, played_steps, played_verified):
            self.credit(played, thresholds, bounds, lo, survivals, drafted, accepted, steps_of, verified_of,
                        played_steps, played_verified)

    def tick(self, played: int, ms: float, steps: int, verified: int, tokens: int = 0) -> bool:
        """Every round: its arm into the record, its measured time (0: none) into the cost fit and, with the
        ``tokens`` it emitted (over its rows), into the rounds' measured goodput (:meth:`plain_pays`), the weights one
        round on; returns whether the arms learn from this round (one in ``every``: :meth:`credit`)."""
        self.now += 1
        self.history.append(played)
        if ms > 0.0:
            self.time.add(steps, verified, ms)
            self.measured_ms += ms
            self.rates.add_round(tokens, ms)
        self.weight /= self.discount
        if self.weight > 1e30:  # every arm's sums brought back near 1 (a common scale cancels in every ratio)
            for arm in self.arms:
                arm.rescale(1.0 / self.weight)
            self.weight = 1.0
        return self.now % self.every == 0

    def credit(self, played: int, thresholds: Sequence[Sequence], bounds: Sequence[Sequence[tuple]], lo: int,
               survivals: Sequence[Sequence[float]], drafted: Sequence[int], accepted: Sequence[int], steps_of,
               verified_of, played_steps: int, played_verified: int) -> None:
        """The arms' part of :meth:`observe`: every arm the played one dominates credited with the round's
        counterfactual tokens and modelled time, paired with the reference's."""
        top = [bp[1] for bp in bounds[played]]  # the played arm's greatest threshold per row
        fit = self.time
        seen = {}
        for a in range(len(self.arms)):
            if a != played and any(hi > ba[0] for hi, ba in zip(top, bounds[a])):
                continue  # not dominated: this arm could have drafted deeper than the round did
            tokens, depth = 0, 0
            for b, d in enumerate(drafted):
                k = first_stop(survivals[b], d, lo, thresholds[a][b]) if d and a != played else d
                tokens += min(accepted[b], k) + 1
                depth = max(depth, k)
            took = fit.ms(played_steps, played_verified) if a == played else fit.ms(steps_of(depth), verified_of(depth))
            seen[a] = (tokens, max(took, 1e-3))
        ref = seen.get(self.ref)
        if ref is None:  # the reference could have drafted deeper than the round: no paired sample
            return
        w = self.weight
        for a, (tokens, took) in seen.items():
            self.arms[a].add(w, tokens, took, ref[0], ref[1])

    def estimates(self) -> list:
        """Per arm: (name, goodput in tokens/ms over the rounds it was observed in, its goodput over the reference
        arm's on those rounds, that ratio's standard deviation (delta method), effective rounds)."""
        out = []
        for arm in self.arms:
            mean, var = arm.relative()
            out.append((arm.name, arm.goodput, math.exp(mean), math.exp(mean) * math.sqrt(var) if var < math.inf
                        else math.inf, arm.rounds))
        return out

    def cost(self) -> tuple:
        """The selection's own cost: (µs per round, its share of the rounds' measured time)."""
        rounds = max(1, self.now)
        share = self.spent_s * 1e3 / self.measured_ms if self.measured_ms > 0 else 0.0
        return self.spent_s * 1e6 / rounds, share

    def plain_pays(self) -> bool:
        """Whether a plain step gives more tokens per ms than the rounds played (module docstring): after at least
        :data:`PLAIN_AFTER` rounds, every arm observed in ``min_rounds`` of them, the played rounds' measured tokens
        per ms (discounted) below one token per :meth:`plain_ms`. For one row a round (tokens counted over the
        rows)."""
        return (self.now >= PLAIN_AFTER and all(arm.rounds >= self.min_rounds for arm in self.arms)
                and self.rates.slower_than_plain(self.time.prior[0]))

    def plain_ms(self) -> float:
        """A plain step's ms: the discounted mean of those measured, else the prior's (the profile's plain step)."""
        return self.rates.plain_ms(self.time.prior[0])

    def played_plain(self, ms: float) -> None:
        """A plain step into the record of rounds (:meth:`shares` names it :data:`PLAIN`) and its measured ``ms``
        (0: not measured) into :meth:`plain_ms`."""
        self.history.append(len(self.arms))
        self.rates.add_plain(ms)

    def names(self) -> list:
        """The arms' names, then :data:`PLAIN`: what the record's entries index."""
        return [arm.name for arm in self.arms] + [PLAIN]

    def shares(self, last: Optional[int] = None) -> dict:
        """The share of the latest ``last`` rounds (all kept ones by default) each arm was played in, by name (plain
        steps as :data:`PLAIN`)."""
        played = list(self.history)[-last:] if last else list(self.history)
        n = max(1, len(played))
        return {name: played.count(i) / n for i, name in enumerate(self.names()) if played.count(i)}
