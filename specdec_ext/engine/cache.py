"""The static KV cache of the lean models: a slot per row, per-row lengths on the device, roll-back by subtraction.

Per layer, keys and values ``[S, kv_heads, max_len + 1, head_dim]`` are allocated once for S slots. Slot s holds
a request's tokens in columns 0 .. lengths[s] - 1, positions equal to columns: no padding inside the cache and no
holes. A forward of n tokens writes them at lengths[s] .. lengths[s] + n - 1 and advances the lengths; roll-back
subtracts from them, and the next forward overwrites what was dropped (a query at position p reads columns 0 .. p
only, all written by then). A round computes every live row to the round's depth, so a row with less room writes
a few positions past what it will keep; those past ``max_len`` all go to the last column, a scratch column that no
real query reads (one past every real position). The live rows of a batch are the slots 0 .. B - 1: a finished row's slot takes the
last live row's cache (:meth:`StaticCache.move`), so a round computes no dead rows. The engine keeps each slot's
length on the host as well (it learns every accepted count from the round's one read-back), and reads nothing back
from here.
"""

from __future__ import annotations

from typing import Sequence

import torch

# column counts are rounded up to a multiple of this, so that compiled or captured steps meet few shapes
COLUMN_BLOCK = 256


MEMORY_BUDGET_ENV = "SPECDEC_MEMORY_BUDGET"  # bytes new KV caches may take on a CPU (default: MemAvailable)


def cache_bytes(layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of a :class:`StaticCache` of these sizes: keys and values of every layer, the scratch column included."""
    return 2 * layers * slots * kv_heads * (max_len + 1) * head_dim * torch.empty(0, dtype=dtype).element_size()


def free_bytes(device: torch.device):
    """``(bytes, source)`` a new allocation may take on ``device``: CUDA's free memory (``torch.cuda.mem_get_info``);
    on a CPU the budget in ``SPECDEC_MEMORY_BUDGET`` (bytes), else the kernel's MemAvailable; ``(None, ...)`` where
    neither is known."""
    import os

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free on {device}"
    budget = os.environ.get(MEMORY_BUDGET_ENV)
    if budget:
        try:
            return int(budget), MEMORY_BUDGET_ENV
        except ValueError:
            raise ValueError(f"{MEMORY_BUDGET_ENV} must be a number of bytes, got {budget!r}") from None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    return None, "unknown"


def check_fits(needed: dict) -> None:
    """Refuse, before anything is allocated, KV caches that the devices cannot hold: ``needed`` maps a device to the
    bytes its new caches take.

    Raises ValueError naming the bytes needed and the bytes available."""
    for device, n in needed.items():
        free, source = free_bytes(device)
        if free is not None and n > free:
            raise ValueError(f"the KV caches need {n:,} bytes on {device} but {free:,} are available ({source}): "
                             "serve fewer rows at once (batch_size) or shorter requests (max_new_tokens)")


def columns_for(need: int, limit: int) -> int:
    """``need`` columns rounded up to a multiple of :data:`COLUMN_BLOCK`, at most ``limit`` (the models' positions).

    Raises ValueError where ``need`` exceeds ``limit``."""
    if need > limit:
        raise ValueError(f"max_len: a request needs {need} cache columns (prompt, new tokens and a round's candidates), "
                         f"beyond the models' {limit} positions")
    return min(-(-need // COLUMN_BLOCK) * COLUMN_BLOCK, limit)


class StaticCache:
    """A model's KV cache for ``slots`` rows of ``max_len`` columns (module docstring). ``k`` and ``v``: one
    ``[slots, kv_heads, max_len + 1, head_dim]`` tensor per layer (the last column: scratch), in the model's dtype;
    ``lengths``: ``[slots]`` int64, the columns each slot holds.

    Raises ValueError for fewer than one slot or column."""

    def __init__(self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        if slots < 1 or max_len < 1:
            raise ValueError(f"StaticCache needs slots >= 1 and max_len >= 1, got {slots} and {max_len}")
        shape = (slots, kv_heads, max_len + 1, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.lengths = torch.zeros(slots, dtype=torch.int64, device=device)

    @property
    def slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        """The columns a row can hold (the scratch column aside)."""
        return self.k[0].shape[2] - 1

    def rollback(self, n_remove: torch.Tensor, rows: int) -> None:
        """Drop the last ``n_remove[b]`` columns of slot b < ``rows`` (``[rows]`` int64 on the cache's device), in
        place: they are overwritten later."""
        self.lengths[:rows].sub_(n_remove)

    def resized(self, slots: int, max_len: int, keep: int) -> "StaticCache":
        """A cache of ``slots`` rows and ``max_len`` columns holding the first ``keep`` slots of this one (their
        columns up to ``min(max_len, self.max_len)``) and their lengths; other slots empty."""
        k0 = self.k[0]
        out = StaticCache(len(self.k), slots, k0.shape[1], max_len, k0.shape[3], k0.dtype, k0.device)
        cols, rows = min(max_len, self.max_len), min(keep, slots, self.slots)
        for mine, theirs in ((out.k, self.k), (out.v, self.v)):
            for a, b in zip(mine, theirs):
                a[:rows, :, :cols] = b[:rows, :, :cols]
        out.lengths[:rows] = self.lengths[:rows]
        return out

    def move(self, src: Sequence[int], dst: Sequence[int], columns: Sequence[int]) -> None:
        """Slot ``dst[i]`` takes slot ``src[i]``'s first ``columns[i]`` columns and length (rows that finished take
        the last live rows' places). The moves must not chain (no slot both read and written)."""
        for s, d, c in zip(src, dst, columns):
            for buf in (self.k, self.v):
                for t in buf:
                    t[d, :, :c] = t[s, :, :c]
        if len(src):
            self.lengths[list(dst)] = self.lengths[list(src)]

    def take(self, dst: Sequence[int], other: "StaticCache", src: Sequence[int], columns: Sequence[int]) -> None:
        """Slot ``dst[i]`` takes slot ``src[i]`` of ``other`` (a cache of the same model): its first ``columns[i]``
        columns and its length (requests prefilled ahead join the batch)."""
        for d, s, c in zip(dst, src, columns):
            for mine, theirs in ((self.k, other.k), (self.v, other.v)):
                for a, b in zip(mine, theirs):
                    a[d, :, :c] = b[s, :, :c]
        if len(dst):
            self.lengths[list(dst)] = other.lengths[list(src)].to(self.lengths.device)
