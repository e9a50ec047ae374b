"""A transformers KV cache whose layers append in place instead of concatenating.

transformers' ``DynamicLayer.update`` appends a forward's keys and values with ``torch.cat``: every forward copies the
whole cache of every layer. At batch size 1 that copy is small; in a batch it is not: on the bundled pair at B = 64
(bf16 target, 2-core CPU, a cache of about 380 columns) the torch profiler put ``aten::cat`` at about half of a target
forward's CPU time over 4 tokens (under the profiler, which inflates it). End to end (HumanEval, greedy, continuous
batching, the two caches alternating per stream; ``git show 4214d06:docs/results/kv_cache.json``, by that tree's
``bench/kv_cache.py``) appending in place ran plain decoding 1.06x / 1.00x / 1.16x and fixed K = 3 1.01x / 1.04x /
1.03x as fast at B = 4 / 16 / 64.

:class:`GrowingLayer` keeps each layer's keys and values in a buffer with spare columns, writes a forward's new
columns into it, and exposes ``keys`` / ``values`` as views of the filled prefix, so a forward copies only its
own new columns; the buffer is copied only when it grows (by a quarter of its width at least, so a long
generation copies it a logarithmic number of times). Crops and the runner's front crops leave views into the
buffer, where appends go on. A row selection that only drops rows (finished requests leaving:
:func:`compaction`, :func:`take_rows`) moves the few rows that take their places within the buffer; any other
copies the kept rows with their spare columns (one copy, as transformers' layer makes). The runner's front padding
goes into the buffer's spare columns before the view where it has them (:meth:`GrowingLayer.pad_front`), and a
runner's first requests into buffers with spare columns (:meth:`GrowingLayer.place_rows`); anything else that
replaces ``keys`` / ``values`` is copied into a new buffer at the next append. Each operation leaves the same keys and values as :class:`~transformers.DynamicLayer`
(``tests/test_kv_cache.py``).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer



def take_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[index]`` along dim 0 (``index`` ``[n]`` int64, on any device; it is read on the host, so a CPU index spares
    a GPU cache a device sync per call). Where ``index`` only drops rows, every entry j being j or a row >= n (what
    :func:`compaction` gives), the rows are taken in place: the rows >= n that are kept are copied into the places
    j < n they take, and the result is a view of ``t``'s first n rows (``t`` is changed). Removing finished
    requests from a batch so copies only the rows that move, not the whole KV cache: at B = 64 on a 2-core CPU
    (bundled pair, fp32 target, a cache of about 400 columns) one such copy of the target's cache took about
    200 ms, and a fixed K = 1's requests, finishing at staggered rounds, removed rows 18 times in 128 requests
    (3.7 s of 25.7 s). Otherwise a copy (``index_select``)."""
    rows = index.tolist()
    n = len(rows)
    moved = [j for j, i in enumerate(rows) if i != j]
    if n > t.shape[0] or any(rows[j] < n or rows[j] >= t.shape[0] for j in moved):
        return t.index_select(0, index.to(t.device))
    if moved:  # the sources (rows >= n) are never destinations, so the order of the copies does not matter
        with torch.inference_mode(t.is_inference()):  # a buffer made by a forward under inference mode
            copy_rows(t, moved, t, [rows[j] for j in moved])
    return t[:n]


def copy_rows(dst: torch.Tensor, dst_rows, src: torch.Tensor, src_rows=None) -> None:
    """``dst[dst_rows] = src[src_rows]`` along dim 0, in place (``src_rows`` None: ``src``'s rows in order). The rows
    are int64 tensors or lists; a source row must not be a destination row written before it is read. On a CPU one
    ``copy_`` per row: an advanced-index assignment gathers the source rows into a temporary and scatters them
    through the generic indexing kernel, which on a 2-core CPU (a target cache ``[64, 8, 420, 64]`` bf16, 300
    columns of each row written) took 0.28 ms for 4 rows and 6.9 ms for 64 where row copies took 0.04 and 1.1 ms,
    and continuous batching writes every admitted row into every layer's keys and values. On other devices one
    indexed assignment (a loop would launch a kernel per row)."""
    if dst.device.type != "cpu":
        dst_idx = torch.as_tensor(dst_rows, dtype=torch.int64).to(dst.device)
        dst[dst_idx] = src if src_rows is None else src[torch.as_tensor(src_rows, dtype=torch.int64).to(src.device)]
        return
    d = dst_rows.tolist() if isinstance(dst_rows, torch.Tensor) else list(dst_rows)
    s = (range(len(d)) if src_rows is None
         else src_rows.tolist() if isinstance(src_rows, torch.Tensor) else list(src_rows))
    if len(s) != len(d):
        raise ValueError(f"copy_rows: {len(d)} destination rows but {len(s)} source rows")
    for i, j in zip(d, s):
        dst[i].copy_(src[j])


def compaction(n_rows: int, leaving) -> list[int]:
    """The rows that stay when rows ``leaving`` (positions in ``[0, n_rows)``) leave a batch, in the order that
    moves the fewest: each leaving row's place below the new size is taken by the last staying rows
    (a swap-remove), every other row keeps its place; :func:`take_rows` then copies only the rows that move."""
    gone = set(leaving)
    n = n_rows - len(gone)
    keep = list(range(n))
    holes = [j for j in range(n) if j in gone]
    movers = [j for j in range(n, n_rows) if j not in gone]
    for h, m in zip(holes, movers):
        keep[h] = m
    return keep


def _spare_columns(columns: int) -> int:
    """The spare columns a new buffer for ``columns`` filled columns gets (at each end that has any): a quarter
    more, at least 64, so a cache that keeps growing is copied a logarithmic number of times."""
    return max(64, columns // 4)


def _buffer(t: torch.Tensor, rows: int, columns: int, zeros: bool = False) -> torch.Tensor:
    """A new buffer ``[rows, H, columns, D]`` of ``t``'s heads, head size, dtype and device (zeroed with ``zeros``)."""
    shape = (rows, t.shape[1], columns, t.shape[3])
    return t.new_zeros(shape) if zeros else t.new_empty(shape)


class GrowingLayer(DynamicLayer):
    """A :class:`~transformers.DynamicLayer` that appends into a preallocated buffer ``[B, H, capacity, D]``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._kbuf = self._vbuf = None

    def _offset(self, length: int):
        """The column of the buffers where ``keys`` / ``values`` start when they are views of the buffers' columns
        ``[offset, offset + old)`` with room up to ``length`` columns from ``offset``; None otherwise."""
        k, v, kb, vb = self.keys, self.values, self._kbuf, self._vbuf
        if kb is None or k.dim() != 4 or k.shape[:2] != kb.shape[:2] or v.shape[:2] != vb.shape[:2]:
            return None
        if k.stride() != kb.stride() or v.stride() != vb.stride() or k.dtype != kb.dtype or v.dtype != vb.dtype:
            return None
        column = kb.stride(2) * kb.element_size()
        dk, dv = k.data_ptr() - kb.data_ptr(), v.data_ptr() - vb.data_ptr()
        if dk < 0 or dk % column or dv != dk // column * vb.stride(2) * vb.element_size():
            return None
        offset = dk // column
        return offset if offset + length <= kb.shape[2] else None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        new = old + key_states.shape[-2]
        start = self._offset(new)
        if start is None:
            capacity, B = new + _spare_columns(new), key_states.shape[0]
            kb, vb = _buffer(key_states, B, capacity), _buffer(value_states, B, capacity)
            if old:
                kb[:, :, :old] = self.keys
                vb[:, :, :old] = self.values
            self._kbuf, self._vbuf, start = kb, vb, 0
        self._kbuf[:, :, start + old : start + new] = key_states
        self._vbuf[:, :, start + old : start + new] = value_states
        self.keys, self.values = self._kbuf[:, :, start : start + new], self._vbuf[:, :, start : start + new]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices``, with the buffers' spare columns: in place where the selection only drops rows
        (:func:`take_rows`), else one copy, as transformers' layer makes."""
        start = self._offset(self.keys.shape[-2]) if self.get_seq_length() > 0 else None
        if start is None:
            return super().batch_select_indices(indices)
        n = self.keys.shape[-2]
        self._kbuf, self._vbuf = take_rows(self._kbuf, indices), take_rows(self._vbuf, indices)
        self.keys, self.values = self._kbuf[:, :, start : start + n], self._vbuf[:, :, start : start + n]

    def pad_front(self, n: int) -> None:
        """``n`` columns of zeros before the keys and values (the runner's front padding, when a new request's prompt
        is wider than the cache): in place in the buffers' spare columns before the view where they are free (rows
        that left, and front crops, free them), else into new buffers with spare columns at both ends, one copy. A
        ``torch.cat`` padding copied the whole cache and the next append copied it again into a new buffer: at
        B = 64 on a 2-core CPU (fp32 target) about 200 ms each time, 9 times in 128 requests of fixed K = 1."""
        old = self.keys.shape[-2]
        start = self._offset(old)
        if start is None or start < n:
            spare, B = _spare_columns(old + n), self.keys.shape[0]
            kb, vb = _buffer(self.keys, B, spare + n + old + spare), _buffer(self.values, B, spare + n + old + spare)
            kb[:, :, spare + n : spare + n + old] = self.keys
            vb[:, :, spare + n : spare + n + old] = self.values
            self._kbuf, self._vbuf, start = kb, vb, spare + n
        self._kbuf[:, :, start - n : start] = 0
        self._vbuf[:, :, start - n : start] = 0
        self.keys = self._kbuf[:, :, start - n : start + old]
        self.values = self._vbuf[:, :, start - n : start + old]

    def place_rows(self, rows: int, index: torch.Tensor, width: int) -> None:
        """Make this layer's b rows rows ``index`` (``[b]`` int64) of a batch of ``rows`` rows, right-aligned in
        ``width`` columns, zeros elsewhere (a runner that had read nothing taking its first requests), in new
        buffers with spare columns after them, so that the next appends go in place."""
        n = self.keys.shape[-2]
        bufs = []
        for t in (self.keys, self.values):
            buf = _buffer(t, rows, width + _spare_columns(width), zeros=True)
            copy_rows(buf[:, :, width - n : width], index, t)
            bufs.append(buf)
        self._kbuf, self._vbuf = bufs
        self.keys, self.values = self._kbuf[:, :, :width], self._vbuf[:, :, :width]

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        super().reset()


class GrowingCache(DynamicCache):
    """A :class:`~transformers.DynamicCache` whose full-attention layers are :class:`GrowingLayer` (layers of other
    kinds, e.g. sliding-window layers built from a config, are left as transformers makes them)."""

    def __init__(self, config=None):
        super().__init__(config=config)
        self.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]
        if self.layer_class_to_replicate is DynamicLayer:
            self.layer_class_to_replicate = GrowingLayer
