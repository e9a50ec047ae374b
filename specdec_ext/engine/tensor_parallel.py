"""A tensor-parallel target under ``torchrun``: what the engine needs to stay correct across ranks.

The target is loaded with transformers' tensor parallelism (``DistributedConfig(tp_plan="auto")``:
attention heads and MLP columns split over the ranks, DTensor weights, one all-reduce after each
row-parallel projection, logits gathered over the vocabulary), so every rank gets the same full logits.
The draft and the acceptance head are replicated: every rank drafts the same candidates.

Every rank makes the accept/reject decisions itself, from the same logits and the same per-row
``torch.Generator`` seeds (no collective per round). That is exact when the ranks see bitwise-equal
target logits (an all-reduce gives every rank the same sum) and draft probabilities (same weights, same
kernels). What could differ between ranks is measured, not computed: the profiled cost table of
``threshold="auto"`` is measured by all ranks together and rank 0's table is used everywhere
(:func:`from_rank0`). At the end of each ``generate()`` call, :func:`check_same_output` compares a hash
of every rank's output and raises if they differ, instead of writing a silently wrong answer.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch


def tp_size(model) -> int:
    """The model's tensor-parallel degree: 1 for a model on one device."""
    return int(getattr(model, "tp_size", None) or 1) if model is not None else 1


def distributed() -> bool:
    """True inside an initialised ``torch.distributed`` process group with more than one rank."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 outside ``torch.distributed``; ``$RANK`` before the group is initialised)."""
    if distributed():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", 0))


def is_main_process() -> bool:
    """True on rank 0 (the rank that prints and writes outputs), and outside ``torch.distributed``."""
    return rank() == 0


def launched_world_size() -> int:
    """``$WORLD_SIZE`` as set by ``torchrun`` (1 when not launched by it)."""
    return int(os.environ.get("WORLD_SIZE", 1))


def end_process_group() -> None:
    """Destroy the default ``torch.distributed`` process group if one is initialised (no-op otherwise).

    Call it before a ``torchrun`` rank exits: a gloo group left to the interpreter's teardown can abort the
    process ("terminate called without an active exception", SIGABRT) while its worker threads still hold
    tensors. The CLI calls it at the end of every command."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (a picklable object; identity outside ``torch.distributed``)."""
    if not distributed():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _digest(t: torch.Tensor) -> torch.Tensor:
    h = hashlib.sha1(t.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    h.update(str(list(t.shape)).encode())
    return torch.tensor(list(h.digest()[:8]), dtype=torch.int64)


def check_same_output(sequences: torch.Tensor) -> None:
    """Raise RuntimeError if the ranks' ``sequences`` (``[B, L]`` int64) differ (no-op outside ``torch.distributed``).

    One all-gather of an 8-byte hash per ``generate()`` call."""
    if not distributed():
        return
    mine = _digest(sequences)
    world = torch.distributed.get_world_size()
    backend = torch.distributed.get_backend()
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    gathered = [torch.empty_like(mine, device=dev) for _ in range(world)]
    torch.distributed.all_gather(gathered, mine.to(dev))
    if any(not torch.equal(g.cpu(), gathered[0].cpu()) for g in gathered):
        raise RuntimeError("tensor-parallel ranks produced different outputs (their target logits or draft "
                           "probabilities differ bitwise): the result is not trusted; rerun with the same thread count "
                           "and kernels on every rank")
