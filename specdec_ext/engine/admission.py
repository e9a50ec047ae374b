"""When continuous batching lets queued requests into the batch (``generate_continuous(admission=...)``).

An admission (the target prefilling new requests into free slots) costs a fixed part (forward calls, kernel
launches) plus a part per prompt token. ``"eager"`` admits after every round that freed a slot. ``"ahead"`` (the
default, :data:`DEFAULT_ADMISSION`) admits as eagerly, but the target prefills the queue's next requests (up to
``scheduler.AHEAD_ROWS``) in one go into a staging cache, so prefills stay as large as a lockstep refill's whatever the
rounds at which rows finish. ``"grouped"`` waits by :class:`AdmissionRule`: as in the ski-rental problem it adds up the
throughput the idle slots lost, round by round, and admits once that loss reaches the measured fixed cost of one
admission (``fixed + per_token * prompt tokens`` fitted by least squares over the generator's admissions; a round
with f of B slots idle lost ``round_ms * flat * f / B``, ``flat`` the share of a prefill that does not grow with its
tokens), so waiting never costs more than the admission it saves. Until the fit has three admissions of at least two
sizes, and whenever no row is live or every queued request fits the free slots, it admits at once. The paired runs
behind the default and behind keeping ``"grouped"`` opt-in are in ``docs/design.md`` (Admission).
"""

from __future__ import annotations

from typing import Optional

ADMISSION_MODES = ("eager", "grouped", "ahead")
DEFAULT_ADMISSION = "ahead"  # generate_continuous's, and the batch benchmark's (measured: the module docstring)


class AdmissionRule:
    """Decides, after each round of a continuous-batching call, whether the queued requests join now.

    Args:
        grouped: False: admit whenever a slot is free (eager); True: the measured ski-rental rule above.
        points: the generator's list of past admissions ``(rows, prompt tokens, ms)``, appended to by
            :meth:`observe` (shared across calls, so a call starts from what earlier calls measured).
    """

    MAX_POINTS = 256

    def __init__(self, grouped: bool, points: list):
        self.grouped = grouped
        self.points = points
        self.waited_ms = 0.0  # idle-slot loss since the last admission (ms of rounds)

    def observe(self, rows: int, tokens: int, ms: float) -> None:
        """An admission of ``rows`` requests with ``tokens`` prompt tokens in all took ``ms`` (prefill and the
        rows' joining); the wait starts again from zero."""
        self.points.append((rows, tokens, ms))
        del self.points[: -self.MAX_POINTS]
        self.waited_ms = 0.0

    def fit(self) -> Optional[tuple[float, float]]:
        """``(fixed ms, flat)`` from the admissions so far (least squares of ms on prompt tokens, both terms
        clamped at 0), or None while fewer than 3 admissions of at least two sizes were measured."""
        if len(self.points) < 3:
            return None
        xs = [t for _, t, _ in self.points]
        ys = [ms for _, _, ms in self.points]
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx <= 0:
            return None
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx)
        fixed = max(0.0, my - slope * mx)
        per_prompt = slope * sum(xs) / max(1, sum(r for r, _, _ in self.points))
        flat = fixed / (fixed + per_prompt) if fixed + per_prompt > 0 else 0.0
        return fixed, flat

    def ready(self, idle: int, queued: int, live: int, batch_size: int, round_ms: float) -> bool:
        """Whether to admit now. The round just run took ``round_ms`` with ``idle`` of ``batch_size`` slots
        empty (its loss is added to the wait); it left ``live`` rows running, so ``batch_size - live`` slots free
        for ``queued`` waiting requests."""
        if not self.grouped or live == 0 or batch_size - live >= queued:
            return True
        fit = self.fit()
        if fit is None:
            return True
        fixed, flat = fit
        self.waited_ms += round_ms * flat * idle / batch_size
        return self.waited_ms >= fixed


def check_admission(admission) -> str:
    """``admission`` checked: one of :data:`ADMISSION_MODES`. Raises ValueError naming the argument."""
    if admission not in ADMISSION_MODES:
        raise ValueError(f"admission must be one of {', '.join(map(repr, ADMISSION_MODES))}, got {admission!r}")
    return admission
