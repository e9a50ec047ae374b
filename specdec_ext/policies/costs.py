"""What a speculative round costs where the pair runs, measured by ``engine.profile``: :class:`CostModel` at one
row (ms per draft step, per verification of n tokens, per round) and :class:`BatchCosts` by batch size (whole rounds
by depth, target forwards by tokens and cache width).

A round that drafts K candidates costs (in ms)

    T(K) = round_ms + K * (draft_ms + step_ms) + verify_ms(K + 1),

K draft forwards (the first feeds the tokens the draft has not seen, each later one a candidate), per-candidate work
outside the forward (sampling, the head, the policy), one target forward over the last committed token and the K
candidates, and per-round work (verification op, rollback).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence


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


class MeasuredRates:
    """Speculative rounds against plain steps as they ran: the rounds' emitted tokens per ms and a plain step's ms,
    each from its measured wall-clock cycle (``RoundResult.cycle_ms``), sums discounted by ``discount`` per entry.
    What ``threshold="auto"`` (``StopSelector.plain_pays``) and ``CopyOrDraft`` judge drafting by: a profile prices a
    verification and a round's bookkeeping as measured once, and errs by 5-10% against a plain step."""

    def __init__(self, discount: float = 0.995):
        self.discount = discount
        self.reset()

    def reset(self) -> None:
        self.played = [0.0, 0.0]  # the rounds' discounted tokens and ms
        self.plain = [0.0, 0.0]  # plain steps' discounted ms and count
        self.rounds = 0  # rounds added

    def add_round(self, tokens: float, ms: float) -> None:
        """A round that emitted ``tokens`` (over its rows) in ``ms`` (0: not measured, ignored)."""
        if ms > 0.0 and tokens > 0:
            g = self.discount
            self.played = [self.played[0] * g + tokens, self.played[1] * g + ms]
            self.rounds += 1

    def add_plain(self, ms: float) -> None:
        """A plain step of ``ms`` (0: not measured, ignored)."""
        if ms > 0.0:
            g = self.discount
            self.plain = [self.plain[0] * g + ms, self.plain[1] * g + 1.0]

    def plain_ms(self, prior: float) -> float:
        """A plain step's ms: the discounted mean of those measured, else ``prior`` (a profile's)."""
        return self.plain[0] / self.plain[1] if self.plain[1] > 0 else prior

    def slower_than_plain(self, prior: float) -> bool:
        """Whether the rounds measured emitted fewer tokens per ms than one token per :meth:`plain_ms` (False before
        any round was measured)."""
        return self.played[1] > 0.0 and self.played[0] / self.played[1] < 1.0 / max(self.plain_ms(prior), 1e-3)


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
