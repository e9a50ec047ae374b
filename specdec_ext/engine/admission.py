"""When continuous batching lets queued requests into the batch: at once, grouped by a measured rule, or at once from
requests prefilled ahead.

An admission (the target prefilling the new requests and their rows joining the batch) costs a fixed part
(forward calls, kernel launches, the rows' bookkeeping) plus a part per prompt token. Where the fixed part
dominates, as on a GPU running a small model (bundled pair on an H100 in bf16: a prefill call took 11-13 ms
for one request or sixteen), admitting each round's few finished rows pays the fixed part again and again:
speculative requests finish at staggered rounds, so at B = 16 fixed K made 34-38 prefill calls per 128
requests where plain decoding's, finishing in lockstep, made 12, and the prompts' reads took 26-29% of the time against
9% (``1bd1639:docs/results/bench-batch-cuda-h100-2026-11-24.md``). Waiting instead leaves slots idle, which costs a
share of every round where a round's cost does not shrink with its rows.

:class:`AdmissionRule` with ``grouped=True`` decides as in the ski-rental problem: it adds up the throughput the
idle slots lost, round by round, and admits once that loss reaches the fixed cost of one admission, so waiting
never costs more than the admission it saves (a 2-competitive rule that needs no forecast of when rows will
finish; vLLM's scheduler delay factor is a fixed-ratio cousin of it). Both terms are measured, not assumed:

- an admission's ms is fitted as ``fixed + per_token * prompt tokens`` by least squares over this generator's
  admissions (:meth:`AdmissionRule.observe`);
- a round with ``f`` of ``B`` slots idle lost ``round_ms * flat * f / B``, where ``flat`` = fixed / (fixed +
  per_token * mean prompt tokens) is the share of one request's prefill that does not grow with its tokens:
  near 1 where forwards are launch-bound (a GPU), near 0 where they are compute-bound (a CPU, where a round with
  fewer rows is cheaper, so an idle slot costs little; on a 2-core AMD EPYC in fp32 the fit's fixed part came
  out 0, and grouped admission admitted exactly as eager did).

Until the fit has three admissions of at least two sizes, and whenever no row is live or every queued request fits
the free slots, it admits at once, as ``grouped=False`` (eager, the default of ``generate_continuous``) always does.

Measured on the H100 (``python bench/budget_paired.py --device cuda --batch-size 64 --arms
plain@eager,plain@grouped,K2@eager,K2@grouped,auto@eager,auto@grouped --passes 3 --rows-per-stream 2``, 128
HumanEval requests of 48 tokens, greedy; ``1bd1639:docs/results/admission_cuda_b64.json``): over the three passes fixed
K = 2 made 10 admissions instead of 45, its prompts' reads fell from 1.99 to 1.14 s, and it ran 1.08x faster
grouped (3416 against 3171 tokens/s; per pass 1.14, 1.17, 0.92x); plain decoding, already in lockstep, made 3 either way
(0.95x; per pass 0.88, 0.85, 1.15x: noise); the budget (``threshold="auto"``) ran 0.88x grouped (per pass 0.92,
1.01, 0.73x): with fewer rows live it drafted deeper (2.17 candidates per row and round against 0.60) and decoded
slower. Hence opt-in.

``admission="ahead"`` (``SpeculativeGenerator.generate_continuous``) attacks the same cost from the other side:
requests join as eagerly as ``"eager"``, but whenever no prefilled request is left the target prefills the queue's
next ``batch_size`` requests in one go, and each admission takes its rows from that runner
(``TimedRunner.replace_rows(..., rows=...)``), so the prefills are as large as plain decoding's lockstep refills
whatever the rounds at which rows finish. It holds up to ``batch_size`` more rows of KV cache. On a CPU, where a
forward's cost does grow with its rows, the fixed part is smaller but the small prefills still cost more per token:
on the bundled pair in bf16 (2-core Intel Xeon with AMX, 128 HumanEval requests of 48 tokens at B = 16) a prefill
took about 100 us per prompt token in groups of 16 and 110-290 us in the groups of 1-4 that fixed K = 1's staggered
rows made. Paired runs (``bench/budget_paired.py``, 128 requests of 48 tokens, greedy, arms alternating stream by
stream; ``1bd1639:docs/results/budget_paired_b*_bf16_ahead*.json``), ahead over eager: fixed K = 1 1.137x at B = 16 (1006.8
against 885.2 tokens/s, prefills 5.8 s against 8.5 s; level with plain decoding, 0.985x), 1.048x at B = 64; K = 2
1.009x at B = 4; the budget (``threshold="auto"``) 1.022x at B = 4, 0.944x at B = 16 (where eager's budget took only
plain steps and ahead's drafted 0.35 candidates per row and round) and 1.117x at B = 64 (0.993x plain decoding).
Prefilling every queued row of B = 64 ahead made prefills of 64 requests, slower per token than the groups of about 5
that eager admission made there (K = 1 0.933x, the budget 0.846x): hence groups of at most 16 (the generator's
``AHEAD_ROWS``). So ``"ahead"`` is the default (:data:`DEFAULT_ADMISSION`).
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
