"""Modules over weights held only as the fused CPU op reads them (``ops.pack_linear_weight``'s panels, int8 rows or
GGUF-style blocks): what a model quantized by ``engine.weights.quantize`` keeps in place of its float matrices.

A one-token step reads each weight once; holding a float copy beside the packed one only costs memory (SmolLM2-135M:
the packed target is 92 MiB, its bfloat16 linear weights another 212 MB and its embedding 57 MB). So the quantized
model's ``nn.Linear`` projections become :class:`PackedLinear` and, where the output layer in 8-bit blocks is tied
to the input embedding (a GGUF file's Q8_0 ``token_embd``), the embedding becomes :class:`PackedEmbedding`, reading
its rows from the output layer's blocks. Both compute the same function as the lean model's fused op, so
transformers' own forward of the model (``model(ids)``, ``generate``) stays available and agrees with it.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import ops


class PackedLinear(torch.nn.Module):
    """``y = x W^T + b`` for a weight held packed (``ops.pack_linear_weight``; ``ops.packed_linear`` multiplies it):
    a quantized model's projection or output layer. The packed tensor is a buffer (int8 / uint8: ``.to(dtype)``
    keeps it), possibly a view of the panels of several projections concatenated (a layer's Q, K, V), which the lean
    model's fused op reads as one.

    Args:
        packed: ``[ceil(N / 16), ...]`` int8 or uint8, a layout of ``ops.pack_linear_weight``.
        in_features, out_features: K and N.
        bias: ``[N]`` float, or None.

    ``forward(x)``: x ``[..., K]`` float32 or bfloat16 -> ``[..., N]`` in x's dtype (CPU only)."""

    def __init__(self, packed: torch.Tensor, in_features: int, out_features: int,
                 bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.register_buffer("packed", packed, persistent=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return ops.packed_linear(x, self.packed, self.out_features, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the float32 weight ``[*ids.shape, K]`` (``ops.packed_rows``)."""
        return ops.packed_rows(self.packed, ids, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"packed={self.packed.dtype} {list(self.packed.shape)}")


class PackedEmbedding(torch.nn.Module):
    """An input embedding read from packed blocks: those of the output layer it is tied to (a GGUF file's Q8_0
    ``token_embd``), row ``i`` of the weight they stand for, in ``dtype`` (the model's float dtype: a zero-size float
    buffer follows ``.to(dtype)``).

    Args:
        packed: the tied output layer's ``PackedLinear.packed``.
        num_embeddings, embedding_dim: its N and K.
        dtype: the rows' float dtype.

    ``forward(ids)``: ids int64 ``[...]`` in ``[0, N)`` -> ``[..., K]`` in ``dtype``."""

    def __init__(self, packed: torch.Tensor, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("like", torch.zeros(0, dtype=dtype, device=packed.device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.like.dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # one op, no host read: it replays in recorded steps
        return ops.packed_rows(self.packed, ids, self.num_embeddings, self.like.dtype)

    def shared(self, dtype: torch.dtype) -> "PackedEmbedding":
        """This embedding in ``dtype``, reading the same blocks (a draft's, which shares its target's)."""
        return PackedEmbedding(self.packed, self.num_embeddings, self.embedding_dim, dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}, packed={list(self.packed.shape)}"
