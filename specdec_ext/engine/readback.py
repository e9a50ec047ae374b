"""A round's one read-back: what a launched round leaves for the host (:class:`Launched`), its copy staged to the host
without a wait so the next round may be launched first (:class:`Staging`; overlapped rounds, ``engine/scheduler.py``),
and its reading into a :class:`~specdec_ext.engine.steps.RoundOutput` (:func:`read`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from .. import errors
from ..transfer import PinnedRing
from .steps import RoundOutput, unpack


@dataclass
class Launched:
    """A round :meth:`StepRunner.launch` enqueued and :meth:`StepRunner.read` has not read: ``out`` ``[P, W]`` int64
    the emitted tokens, ``acc`` ``[P]`` int64 the accepted counts and ``packed`` the read-back (both None for a plain
    step), device tensors that the next replay of the same graphs overwrites; ``B`` live rows of a bucket of ``P``;
    the stop rule's ``asked`` tensors; ``on_device``, whether the GPU decided the draft steps; host clocks ``t0``
    (the round's start) and ``t1`` (its verification's); ``counted``, the forwards run (``RoundOutput.counted``);
    ``staged``, the read-back's host copy and the event after its copy (:meth:`Staging.stage`), or None."""

    out: torch.Tensor
    acc: Optional[torch.Tensor]
    packed: Optional[torch.Tensor]
    drafted: object  # round._Drafted: the draft phase (its steps and the verified width)
    B: int
    P: int
    asked: list
    on_device: bool
    t0: float
    t1: float
    counted: list
    staged: Optional[tuple] = None

    def host(self) -> torch.Tensor:
        """The read-back on the host: the staged copy once its copy has run, else the device tensor (read by
        ``tolist``, which waits for the device)."""
        if self.staged is None:
            return self.packed if self.drafted.steps else self.out
        buf, event = self.staged
        if event is not None:
            event.synchronize()
        return buf


class Staging:
    """Host copies of read-backs, made at launch so a later replay may rewrite the graphs' outputs: a clone on a CPU,
    else a pinned buffer per shape in rotation (``transfer.PinnedRing``), filled without a wait."""

    def __init__(self):
        self._rings: dict = {}  # (shape, dtype, device) -> PinnedRing

    def stage(self, src: torch.Tensor) -> tuple:
        """``src`` copied to the host in stream order: ``(host tensor, the event after its copy or None)``
        (:attr:`Launched.staged`)."""
        if src.device.type != "cuda":
            return src.clone(), None
        key = (tuple(src.shape), src.dtype, src.device)
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = PinnedRing(tuple(src.shape), src.dtype, src.device)
        buf = ring.take()
        buf.copy_(src, non_blocking=True)
        return buf, ring.used()


def read(launched: Launched) -> RoundOutput:
    """A launched round's one read-back (``StepRunner.launch``), unpacked (:func:`~specdec_ext.engine.steps.unpack`)
    into its output; where the device decided how many draft steps ran, their count is the most candidates a row
    drafted (and counted among the round's draft forwards).

    Raises ValueError when the verification reports an invalid row (a NaN or +Inf logit, or a fully masked row)."""
    r = launched
    counted, drafted, B = list(r.counted), r.drafted, r.B
    if not drafted.steps:  # a plain step: one token per row, the whole read-back
        toks = r.host()[:B, 0].tolist()
        return RoundOutput([[t] for t in toks], [0] * B, [0] * B, 0, 0, [], 0.0,
                           (time.perf_counter() - r.t1) * 1e3, tuple(counted))
    W = drafted.verified + 1
    rows, asked = unpack(r.host(), B, W, r.asked)
    t2 = time.perf_counter()
    accepted = [row[W] for row in rows]
    counts = [row[W + 1] for row in rows]
    steps = drafted.steps
    if r.on_device:  # the draft steps the GPU ran
        steps = max(counts)
        counted[0] += steps
    if min(accepted) < 0:
        raise ValueError(f"verification: {errors.message(min(accepted), True)}")
    emitted = [rows[b][: accepted[b] + 1] for b in range(B)]
    return RoundOutput(emitted, counts, accepted, steps, drafted.verified, asked, (r.t1 - r.t0) * 1e3,
                       (t2 - r.t1) * 1e3, tuple(counted))
