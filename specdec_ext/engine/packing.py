"""Packed verification: the target scores only the rows' own draft slots, with no padding.

A batch's verification forward over ``[B, D + 1]`` tokens pads every row to the deepest row's D: with per-row
depths d_b (rows whose policy stopped drafting at different steps), the padding costs as much as
real tokens in the target's linear layers, which are most of a batched forward's time on a CPU. A packed forward
feeds the N = sum_b (d_b + 1) real tokens as one sequence ``[1, N]`` with each token's own position id, so the
linear layers see N rows instead of B (D + 1); only attention, which mixes tokens, needs to know each token's row:

* :class:`PackedRows` maps packed token t to (row ``rows[t]``, slot ``slots[t]``) of the padded ``[B, width]``
  layout (slot i is the cache column ``C0 + i`` of the forward's new columns);
* while :func:`packed` is active, :class:`~specdec_ext.engine.kv_cache.GrowingLayer` writes each packed token's
  key and value into its row at its column (the padded slots are zero and masked: holes), and the
  ``specdec_decode`` attention (:mod:`~specdec_ext.engine.attention`) spreads the packed queries into the padded
  layout, attends as usual (the mask ``[B, 1, width, C]`` comes from the runner) and gathers the outputs back.

Everything else in a decoder layer (norms, rotary embeddings by position id, MLPs) acts token by token, so the
packed forward computes, for each real token, the function the padded one computes (``tests/test_packing.py``:
the same logits and cache). The runner uses it only for model types known to mix tokens in attention alone
(:data:`PACKABLE_MODEL_TYPES`), with the ``specdec_decode`` attention and the in-place cache
(:meth:`~specdec_ext.engine.runner.CausalLMRunner.packs`), and the engine packs a verification only when enough of
its slots are holes to pay for the spreading and gathering (:func:`worth_packing`).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

# decoder families whose layers mix tokens only in attention (checked against the padded forward in the tests for
# llama and qwen2); others are verified padded
PACKABLE_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})


@dataclass(frozen=True)
class PackedRows:
    """Where the N packed tokens of a forward sit in the padded ``[batch, width]`` layout.

    rows, slots: ``[N]`` int64 (the packed token's row, and its index among the row's new columns), on the
    model's device; every row's tokens come first-to-last in packed order.
    """

    rows: torch.Tensor
    slots: torch.Tensor
    batch: int
    width: int

    @classmethod
    def from_valid(cls, valid: torch.Tensor) -> "PackedRows":
        """The packing of the True entries of ``valid`` ``[B, n]`` bool, row-major."""
        rows, slots = valid.nonzero(as_tuple=True)
        return cls(rows, slots, int(valid.shape[0]), int(valid.shape[1]))

    def spread(self, packed: torch.Tensor, dim: int) -> torch.Tensor:
        """``packed`` with its size-N dimension ``dim`` (after a leading dimension of 1) spread to ``[B, width]``,
        zeros at the padded slots: ``[1, ..., N, ...]`` -> ``[B, ..., width, ...]`` (dims moved back as they were)."""
        x = packed.squeeze(0).movedim(dim - 1, 0)  # [N, ...]
        out = x.new_zeros((self.batch, self.width, *x.shape[1:]))
        out[self.rows, self.slots] = x
        return out.movedim(1, dim)

    def gather(self, padded: torch.Tensor, dim: int) -> torch.Tensor:
        """The inverse of :meth:`spread`: ``[B, ..., width, ...]`` (``width`` at ``dim``) -> ``[1, ..., N, ...]``."""
        x = padded.movedim(dim, 1)[self.rows, self.slots]  # [N, ...]
        return x.movedim(0, dim - 1).unsqueeze(0)


_CURRENT: contextvars.ContextVar[Optional[PackedRows]] = contextvars.ContextVar("specdec_packed_rows", default=None)


def current() -> Optional[PackedRows]:
    """The packing of the forward running now (None: an ordinary forward)."""
    return _CURRENT.get()


@contextlib.contextmanager
def packed(plan: PackedRows) -> Iterator[PackedRows]:
    """Run a forward whose ``[1, N]`` input is packed as ``plan`` says (module docstring)."""
    token = _CURRENT.set(plan)
    try:
        yield plan
    finally:
        _CURRENT.reset(token)


# A packed forward pays for itself only when enough of the padded layout is holes: spreading the queries into the
# padded layout and gathering them back costs a few percent of the forward in every layer, and the linear layers
# save only the holes' share. One target forward of the bundled pair, cache of 256 columns, medians of 15
# (``1bd1639:bench/packed_verify.py``, 2-core AMD EPYC, fp32 target, AVX2; ``1bd1639:docs/results/packed_verify_fp32.json``): with
# every row real the packed forward took 0.97-1.05x the padded one at B = 16 and 64; with one row of 16 or 64 a hole
# (31/32 .. 190/192 real: a fixed K's round in which a request is one token from its end) 1.02-1.07x; with a quarter
# to a third of the slots holes 0.85-1.02x (0.85-0.92x at B = 64; at B = 16 the gain is within the noise). In bf16
# on an AVX512-BF16 EPYC (``1bd1639:docs/results/packed_verify.json``): every row real 1.01-1.04x, a quarter holes
# 0.97-0.98x, a third 0.82-0.93x.
PACK_MAX_REAL_SHARE = 0.85


def worth_packing(real: int, padded: int) -> bool:
    """Whether a forward of ``real`` real tokens in a padded layout of ``padded`` slots (rows times the deepest
    row's tokens) should run packed: at most :data:`PACK_MAX_REAL_SHARE` of the slots real (measured above);
    otherwise the holes are masked, which costs the linear layers their share and attention nothing."""
    return 0 < real <= PACK_MAX_REAL_SHARE * padded
