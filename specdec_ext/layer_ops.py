"""Typed wrappers of the model-layer ops, with fake (meta) kernels: attention of a few queries over a KV cache
(``decode_attention``, ``cache_attention``), matrix products over weights packed in panels (``packed_linear``), their
unpacking (``unpack_linear_weight``, ``packed_rows``: a few rows) and a whole decoder layer in one call
(``decoder_layer``; ``decoder_layers``: a stack of them). Kernels in
``csrc/cpu/attention_cpu.cpp``, ``csrc/cpu/layer_cpu.cpp``, ``csrc/cpu/unpack_cpu.cpp`` and ``csrc/cuda/``; schemas in
``csrc/ops.cpp``; without the compiled extension every wrapper falls back to ``specdec_ext.reference``.
``specdec_ext.ops`` re-exports them beside the sampling ops.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import checks, reference
from ._library import HAS_EXTENSION


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of a few queries per row over a KV cache (a decode step, or a verification pass over K + 1
    positions): ``softmax(q k^T * scale, masked) v``, reading the cache where it lies and skipping the columns
    no query may see (left padding, holes of rejected candidates). Scaled dot-product attention (Vaswani et
    al. 2017, Eq. 1), float32 accumulation, grouped-query attention by sharing each key/value head among
    ``Hq / Hkv`` query heads.

    A CPU kernel only: on this project's CPUs torch's fused attention takes 4-6x as long for one query per
    row in bfloat16 (``bench/bench_ops.py --attention``); on GPUs the flash kernels behind
    ``scaled_dot_product_attention`` serve decoding well. ``engine.attention`` registers it with transformers
    as ``attn_implementation="specdec_decode"``.

    Args:
        query: ``[B, Hq, n, D]`` float32/bfloat16/float16, any strides.
        key, value: ``[B, Hkv, C, D]`` in query's dtype, any strides (e.g. views of a cache with spare room);
            ``Hq`` a multiple of ``Hkv``.
        mask: ``[B or 1, Hq or 1, n, C]`` bool, true where query i may see column c (causality included).
        scale: multiplies ``q . k`` (usually ``D ** -0.5``).

    Returns:
        ``[B, n, Hq, D]`` in query's dtype (the layout attention layers reshape to ``[B, n, Hq * D]``). A query
        that sees no column gets zeros; NaN in q, k or v propagates to the queries that see it.

    Raises:
        ValueError: shapes (naming the argument), a non-finite scale, or a device other than the CPU.
        TypeError: dtypes (key/value not query's dtype, a mask that is not bool).
    """
    if not HAS_EXTENSION:
        return reference.decode_attention(query, key, value, mask, scale)
    if query.device.type != "cpu" and not checks._is_fake(query):
        raise ValueError(f"decode_attention has a CPU kernel only (query is on {query.device}); on GPUs use "
                         "cache_attention (a static cache's rows) or torch.nn.functional.scaled_dot_product_attention")
    return torch.ops.specdec_ext.decode_attention(query, key, value, mask, scale)


def cache_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Attention of a few queries per row over a static KV cache, each row read up to its live length only:
    :func:`decode_attention` where query i of row b sits at position ``starts[b] + i`` and sees the columns
    ``0 .. min(starts[b] + i, C - 1)`` (causal, as a decode step or a verification of K + 1 positions sees its row;
    no mask to build or read). On a GPU a flash-decoding kernel (``csrc/cuda/attention.cu``): the columns in chunks of
    128, one block per (row, key/value head, chunk) reading its keys and values once for every query of the query
    heads that share them (grouped-query attention), chunks past a row's length ending at once, the chunks' partial
    softmaxes merged by a second kernel; float32 accumulation. On a CPU the masked :func:`decode_attention` kernel.

    Args:
        query: ``[B, Hq, n, D]`` float32/bfloat16/float16, 1 <= D <= 256.
        key, value: ``[B, Hkv, C, D]`` in query's dtype (e.g. views of a cache's first B slots), ``Hq`` a multiple
            of ``Hkv``.
        starts: ``[B]`` int64 on query's device: each row's first query's position (its cache length before the
            forward that wrote the queries' keys); a position below 0 sees no column.
        scale: multiplies ``q . k``.

    Returns:
        ``[B, n, Hq, D]`` in query's dtype; a query that sees no column gets zeros.

    Raises:
        ValueError: shapes (naming the argument), D > 256, a non-finite scale. TypeError: dtypes.
    """
    if not HAS_EXTENSION:
        return reference.cache_attention(query, key, value, starts, scale)
    return torch.ops.specdec_ext.cache_attention(query, key, value, starts, scale)


PANEL = 16  # output features per panel of a packed weight (one 64-byte line of float32)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 weight-only quantization with one scale per output feature (row): ``scale = max |W[n, :]| /
    127`` and ``q = round(W / scale)`` in [-127, 127] (a row of zeros: scale 0, q 0), so ``W ~ q * scale`` to half a
    step (``scale / 2``) per weight. Requantizing ``q * scale`` gives the same ``q``.

    Args:
        weight: ``[N, K]`` floating point.

    Returns:
        ``(q, scale)``: ``[N, K]`` int8 and ``[N]`` float32."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    q = torch.where(scale[:, None] > 0, w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None], 0.0)
    return q.round().clamp(-127, 127).to(torch.int8), scale


BLOCK = 32  # weights per block of block quantization (GGUF's Q4_1 and Q8_0), along K
BLOCK_BYTES = {4: 320, 8: 544}  # a panel's block by bits: its 16 lines of nibbles or 32 lines of int8, 16 float16 d (m)


def quantize_blocks(weight: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Weight-only quantization with a float16 scale per block of 32 weights along each row, as GGUF stores it and
    llama.cpp's reference quantizers compute it.

    * ``bits=4`` (Q4_1): per block ``d = (max - min) / 15`` and ``q = min(15, floor((w - min) / d + 0.5))`` in
      float32, ``d`` and ``min`` then stored as float16, so ``W ~ d16 * q + m16``.
    * ``bits=8`` (Q8_0): per block ``d = max |w| / 127`` and ``q = round(w / d)`` in [-127, 127], ``d`` stored as
      float16, so ``W ~ d16 * q``.

    Weights that are already such values (a GGUF tensor of that type, dequantized) give back their q, d (and m)
    wherever the float16 rounding of ``d`` recovers the stored one (the block's extreme weights sit at the ends of q's
    range).

    Args:
        weight: ``[N, K]`` floating point, K a multiple of 32. bits: 4 or 8.

    Returns:
        ``(q, d, m)``: q ``[N, K]`` (uint8 in [0, 15], or int8), ``[N, K / 32]`` float16 scales, and float16 minima
        (None for ``bits=8``).

    Raises:
        ValueError: ``weight`` not ``[N, K]`` with K a multiple of 32, or ``bits`` not 4 or 8."""
    if bits not in BLOCK_BYTES:
        raise ValueError(f"quantize_blocks: bits must be 4 or 8, got {bits!r}")
    if weight.dim() != 2 or weight.shape[1] % BLOCK or min(weight.shape) < 1:
        raise ValueError(f"quantize_blocks: weight must be [N, K] with K a multiple of {BLOCK}, got "
                         f"{list(weight.shape)}")
    N, K = weight.shape
    w = weight.detach().float().view(N, K // BLOCK, BLOCK)
    tiny = torch.finfo(torch.float32).tiny
    if bits == 8:
        d = w.abs().amax(-1) / 127.0
        inv = torch.where(d > 0, 1.0 / d.clamp_min(tiny), 0.0)
        q = (w * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
        return q.view(N, K), d.half(), None
    lo, hi = w.amin(-1), w.amax(-1)
    d = (hi - lo) / 15.0
    inv = torch.where(d > 0, 1.0 / d.clamp_min(tiny), 0.0)
    q = torch.floor((w - lo[..., None]) * inv[..., None] + 0.5).clamp(0, 15).to(torch.uint8)
    return q.view(N, K), d.half(), lo.half()


def dequantize_blocks(q: torch.Tensor, d: torch.Tensor, m: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float32 weights ``d * q (+ m)`` that :func:`quantize_blocks`'s ``(q, d, m)`` stand for, ``[N, K]``."""
    N, K = q.shape
    w = d.float()[..., None] * q.view(N, K // BLOCK, BLOCK).float()
    return (w if m is None else w + m.float()[..., None]).view(N, K)


def _block_panels(weight: torch.Tensor, bits: int, int8_activations: bool = False) -> torch.Tensor:
    """``weight`` ``[N, K]`` quantized in blocks (:func:`quantize_blocks`) as panels ``[ceil(N / 16), K / 32,
    BLOCK_BYTES[bits]]`` (see :func:`pack_linear_weight`), uint8 for 4 bits, int8 for 8; ``int8_activations``: in
    chunks of 64 bytes, ``[ceil(N / 16), K / 32, 5, 64]`` / ``[..., 17, 32]``."""
    N, K = weight.shape
    if K % BLOCK:
        raise ValueError(f"pack_linear_weight: blocks need in_features a multiple of {BLOCK}, got {K}")
    q, d, m = quantize_blocks(weight, bits)
    pad, nb = -N % PANEL, K // BLOCK
    q = torch.nn.functional.pad(q, (0, 0, 0, pad)).view(-1, PANEL, nb, BLOCK)
    P = q.shape[0]
    if int8_activations:  # byte 4 l + i of chunk c: row l's input 4 c + i (4-bit: and 16 + 4 c + i, high nibble)
        if bits == 4:
            q = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)  # [P, 16 rows, nb, 16]
        lines = q.reshape(P, PANEL, nb, -1, 4).permute(0, 2, 3, 1, 4).reshape(P, nb, -1).view(torch.uint8)
    else:
        if bits == 4:
            q = q.view(P, PANEL, nb, BLOCK // 2, 2)
            q = q[..., 0] | (q[..., 1] << 4)  # [P, 16 rows, nb, 16 lines]
        lines = q.permute(0, 2, 3, 1).reshape(P, nb, -1).view(torch.uint8)  # [P, nb, lines x 16 rows]

    def per_block(t):  # [N, nb] float16 -> [P, nb, 32] bytes: the panel's 16 values of each block
        t = torch.nn.functional.pad(t, (0, 0, 0, pad)).view(P, PANEL, nb).transpose(1, 2).contiguous()
        return t.view(torch.uint8)

    parts = [lines, per_block(d)] + ([per_block(m)] if m is not None else [])
    out = torch.cat(parts, dim=2).contiguous()
    if int8_activations:
        out = out.view(P, nb, -1, 64 if bits == 4 else 32)
    return out if bits == 4 else out.view(torch.int8)


def pack_linear_weight(weight: torch.Tensor, dtype: Optional[torch.dtype] = None, blocks: bool = False,
                       int8_activations: bool = False) -> torch.Tensor:
    """``weight`` ``[N, K]`` (a linear layer's, out x in) as :func:`packed_linear` reads it: panels of 16 output
    features, ``[ceil(N / 16), K, 16]`` (row ``p * 16 + l`` at ``[p, :, l]``; rows past N zero), in ``dtype``
    (float32 or bfloat16; None: the weight's where it is one of them, else float32). A copy, as large as ``weight``.

    ``dtype=torch.int8``: weight-only quantization (:func:`quantize_rows`, a scale per output feature), panels
    ``[ceil(N / 16), K + 4, 16]`` int8: each panel's K lines of 16 int8 weights, then its 16 float32 scales as 64
    bytes (read in the same stream). A quarter of the float32 weight's bytes (plus 4 bytes a row).

    ``dtype=torch.uint8``: 4-bit blocks (:func:`quantize_blocks`, GGUF's Q4_1), panels ``[ceil(N / 16), K / 32,
    320]`` uint8: per panel and block of 32 inputs, 16 lines of 16 bytes (byte l of line j: row l's weights 2j in the
    low nibble and 2j + 1 in the high one), then the block's 16 float16 scales and its 16 float16 minima. 5 bits a
    weight (K a multiple of 32). ``dtype=torch.int8, blocks=True``: 8-bit blocks (GGUF's Q8_0), ``[ceil(N / 16), K /
    32, 544]`` int8: per block 32 lines of 16 int8, then 16 float16 scales; 8.5 bits a weight.

    ``int8_activations=True`` (with blocks): the same blocks for W4A8 / W8A8 products, which quantize each row of x
    to int8 blocks of 32 before multiplying (:func:`packed_linear`): per block, chunks of 64 bytes whose byte ``4 l
    + i`` holds row l's input ``4 c + i`` of chunk c (4-bit: in the low nibble, input ``16 + 4 c + i`` in the high
    one), then the scales (and minima) as above: uint8 ``[ceil(N / 16), K / 32, 5, 64]`` or int8 ``[ceil(N / 16), K /
    32, 17, 32]``, as many bytes.

    Raises:
        ValueError: ``weight`` not 2-D or empty. TypeError: not a floating-point tensor, another ``dtype``, or
            ``int8_activations`` without blocks."""
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(f"pack_linear_weight: weight must be a floating-point tensor, got "
                        f"{getattr(weight, 'dtype', type(weight).__name__)}")
    if weight.dim() != 2 or min(weight.shape) < 1:
        raise ValueError(f"pack_linear_weight: weight must be [N, K] with N, K >= 1, got {list(weight.shape)}")
    if dtype is None:
        dtype = weight.dtype if weight.dtype in checks.LAYER_DTYPES else torch.float32
    if dtype not in (*checks.LAYER_DTYPES, torch.int8, torch.uint8):
        raise TypeError(f"pack_linear_weight: dtype must be torch.float32, torch.bfloat16, torch.int8 or torch.uint8, "
                        f"got {dtype}")
    N, K = weight.shape
    if blocks and dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"pack_linear_weight: blocks=True needs dtype torch.int8 (Q8_0) or torch.uint8 (Q4_1), got "
                        f"{dtype}")
    if int8_activations and not (dtype == torch.uint8 or blocks):
        raise TypeError(f"pack_linear_weight: int8_activations=True needs blocks (dtype torch.uint8, or torch.int8 "
                        f"with blocks=True), got dtype {dtype}")
    if dtype == torch.uint8 or blocks:
        return _block_panels(weight, 4 if dtype == torch.uint8 else 8, int8_activations)
    if dtype == torch.int8:
        q, scale = quantize_rows(weight)
        panels = _panels(q, N, K)  # [P, K, 16]
        scales = torch.nn.functional.pad(scale, (0, -N % PANEL)).view(-1, PANEL).view(torch.int8).view(-1, 4, PANEL)
        return torch.cat([panels, scales], dim=1).contiguous()
    return _panels(weight.detach().to(dtype), N, K)


def _panels(w: torch.Tensor, N: int, K: int) -> torch.Tensor:  # [N, K] -> [ceil(N / 16), K, 16], rows past N zero
    padded = torch.nn.functional.pad(w, (0, 0, 0, -N % PANEL))
    return padded.view(-1, PANEL, K).transpose(1, 2).contiguous()


def packed_linear(x: torch.Tensor, weight: torch.Tensor, out_features: int,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x W^T + bias`` for a weight packed by :func:`pack_linear_weight`: the matrix-vector products of a decode step
    or a verification (a few rows), reading the weight once at the rate the CPU streams memory
    (``csrc/cpu/layer_cpu.cpp``). Each output sums its K products in float32, in one chain in k order, so a row's
    result does not depend on how many rows are multiplied with it. A CPU kernel only.

    Args:
        x: ``[..., K]`` float32 or bfloat16.
        weight: ``[ceil(N / 16), K, 16]`` in x's dtype, or int8 ``[ceil(N / 16), K + 4, 16]`` (each output's sum
            times its scale), or blocks of 32 inputs (:func:`pack_linear_weight` of ``W`` ``[N, K]``). Blocks for
            int8 activations (W4A8 / W8A8, as llama.cpp multiplies Q4_1 / Q8_0 weights): each row's block of 32
            inputs is ``a * r`` with ``a = max |x| / 127`` (float32) and ``r = round-half-even(x * 127 / max |x|)``
            (int8), and its outputs ``sum_b (d_b a_b) sum_k q_k r_k (+ m_b sum_k x_k)``, the integer sums exact
            (AVX-512 VNNI where the CPU has it).
        out_features: N.
        bias: ``[N]`` in x's dtype, or None.

    Returns:
        ``[..., N]`` in x's dtype.

    Raises:
        ValueError: shapes (naming the argument), a device other than the CPU. TypeError: dtypes.
    """
    if not HAS_EXTENSION:
        return reference.packed_linear(x, weight, bias, out_features)
    if x.device.type != "cpu" and not checks._is_fake(x):
        raise ValueError(f"packed_linear has a CPU kernel only (x is on {x.device})")
    return torch.ops.specdec_ext.packed_linear(x, weight, bias, out_features)


def unpack_linear_weight(weight: torch.Tensor, out_features: int, dtype: torch.dtype = torch.float32,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float weight ``W`` ``[N, K]`` that a packing of :func:`pack_linear_weight` stands for, in ``dtype``: for a
    quantized packing (int8 rows, 4-bit or 8-bit blocks, either layout) each value ``q * scale`` or ``d * q (+ m)``
    computed in float32 (exact), then rounded to ``dtype``; float panels are only rearranged. A quantized model's
    prefill multiplies a layer's weights so, unpacked just before its products (``engine/model.py``).

    Args:
        weight: a packing of ``W`` ``[N, K]``.
        out_features: N.
        dtype: torch.float32 or torch.bfloat16.
        out: ``[K, N]`` contiguous in ``dtype``, written (a buffer used again saves the page faults of a fresh one,
            most of the time a new one takes), or None.

    Returns:
        ``[N, K]`` in ``dtype``: the transpose of a contiguous ``[K, N]`` tensor (``out`` where given; ``x @ W.T``
        reads it row-major: the CPU kernel writes each packed line of 16 outputs as contiguous values), or for float
        panels their view.

    Raises:
        ValueError: shapes (naming the argument), a device other than the CPU. TypeError: dtypes."""
    K, N = checks.unpack_shapes(weight, out_features, dtype, floats=True)
    if weight.dtype in checks.LAYER_DTYPES:  # float panels [P, K, 16]: a rearrangement
        w = weight.permute(0, 2, 1).reshape(-1, K)[:N]
        if out is None:
            return w.to(dtype)
        checks.unpack_out(out, K, N, dtype)
        return out.copy_(w.t()).t()
    if out is None:
        out = torch.empty(K, N, dtype=dtype, device=weight.device)
    checks.unpack_out(out, K, N, dtype)
    if not HAS_EXTENSION:
        return out.copy_(reference.unpack_linear_weight(weight, out_features).t()).t()
    if weight.device.type != "cpu" and not checks._is_fake(weight):
        raise ValueError(f"unpack_linear_weight has a CPU kernel only (weight is on {weight.device})")
    torch.ops.specdec_ext.unpack_linear_weight(weight, out_features, out)
    return out.t()


def packed_rows(weight: torch.Tensor, ids: torch.Tensor, out_features: int,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``ids`` of the float weight ``W`` ``[N, K]`` that a packing of :func:`pack_linear_weight` stands for:
    :func:`unpack_linear_weight`'s values (computed in float32, rounded to ``dtype``), reading only the panels that
    hold them (a quantized packing: each id's panel unpacked alone by the CPU kernel, a few us for K = 576). An
    input embedding tied to a quantized output layer (a GGUF file's Q8_0 ``token_embd``) reads its rows so, in one
    call and without a float copy of the matrix.

    Args:
        weight: a packing of ``W`` ``[N, K]`` (any layout of :func:`pack_linear_weight`).
        ids: int64 ``[...]``, each in ``[0, N)``.
        out_features: N.
        dtype: torch.float32 or torch.bfloat16.

    Returns:
        ``[*ids.shape, K]`` in ``dtype``.

    Raises:
        ValueError: an id out of range, shapes (naming the argument), a device other than the CPU.
        TypeError: dtypes."""
    if not HAS_EXTENSION or weight.dtype in checks.LAYER_DTYPES:  # float panels: a gather of torch ops
        return reference.packed_rows(weight, ids, out_features, dtype)
    if weight.device.type != "cpu" and not checks._is_fake(weight):
        raise ValueError(f"packed_rows has a CPU kernel only (weight is on {weight.device})")
    return torch.ops.specdec_ext.packed_rows(weight, ids, out_features, dtype)


def decoder_layer(x: torch.Tensor, input_norm: torch.Tensor, qkv: torch.Tensor, qkv_bias: Optional[torch.Tensor],
                  q_norm: Optional[torch.Tensor], k_norm: Optional[torch.Tensor], o: torch.Tensor,
                  post_norm: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, lengths: torch.Tensor, slots: Optional[torch.Tensor], cos: torch.Tensor,
                  sin: torch.Tensor, heads: int, eps: float) -> torch.Tensor:
    """One Llama / Qwen2 / Qwen3 decoder layer for a few tokens per row over a static KV cache, in one call
    (``csrc/cpu/layer_cpu.cpp``): ``h = x + attention(RoPE(rms(x) Wqkv + b)) Wo``, then ``h + W_down(SiLU(rms(h)
    W_gate) * rms(h) W_up)``, writing the tokens' keys and values into the cache. RMS norm (Zhang and Sennrich 2019,
    Eq. 4), RoPE with rotate_half (Su et al. 2021, Eq. 34, as transformers' Llama), grouped-query attention over the
    columns up to each token's position (the ``decode_attention`` kernel), SwiGLU MLP (Shazeer 2020, Eq. 6). What
    ``engine.model.LeanModel`` computes with ~50 torch ops a layer; a CPU kernel only. The arithmetic is float32; a
    bfloat16 layer rounds the cache's keys and values, the queries and attention output and its output to bfloat16.

    Args:
        x: ``[B, n, H]`` float32 or bfloat16: B rows of n tokens (every other floating tensor in x's dtype).
        input_norm, post_norm: ``[H]``; q_norm, k_norm: ``[D]`` (Qwen3) or both None.
        qkv, o, gate_up, down: the layer's weights packed by :func:`pack_linear_weight`: Wq, Wk, Wv concatenated
            (``[(Hq + 2 Hkv) D, H]``), ``Wo`` ``[H, Hq D]``, Wgate and Wup concatenated (``[2 I, H]``), ``Wdown``
            ``[H, I]``; every N a multiple of 16; all four in x's dtype or all four int8 panels.
            qkv_bias: ``[(Hq + 2 Hkv) D]`` (Qwen2) or None.
        key_cache, value_cache: ``[S, Hkv, C, D]``, contiguous, written in place: the tokens of row b at
            columns ``min(lengths[slot] + i, C - 1)`` of its slot (the last column: the cache's scratch one).
        lengths: ``[S]`` int64, each slot's filled columns before the call (not advanced: the caller does).
        slots: ``[B]`` int64 (row b's slot) or None (row b in slot b).
        cos, sin: ``[T, D]`` RoPE tables by position (position p reads row ``min(p, T - 1)``).
        heads: Hq, a multiple of Hkv. eps: the RMS norms'.

    Returns:
        ``[B, n, H]`` in x's dtype, the layer's output.

    Raises:
        ValueError: shapes (naming the argument), a slot or length out of range, a device other than the CPU.
        TypeError: dtypes.
    """
    args = (x, input_norm, qkv, qkv_bias, q_norm, k_norm, o, post_norm, gate_up, down, key_cache, value_cache, lengths,
            slots, cos, sin, int(heads), float(eps))
    if not HAS_EXTENSION:
        return reference.decoder_layer(*args)
    if x.device.type != "cpu" and not checks._is_fake(x):
        raise ValueError(f"decoder_layer has a CPU kernel only (x is on {x.device})")
    return torch.ops.specdec_ext.decoder_layer(*args)


def decoder_layers(x: torch.Tensor, input_norm: Sequence[torch.Tensor], qkv: Sequence[torch.Tensor],
                   qkv_bias: Sequence[Optional[torch.Tensor]], q_norm: Sequence[Optional[torch.Tensor]],
                   k_norm: Sequence[Optional[torch.Tensor]], o: Sequence[torch.Tensor],
                   post_norm: Sequence[torch.Tensor], gate_up: Sequence[torch.Tensor], down: Sequence[torch.Tensor],
                   key_cache: Sequence[torch.Tensor], value_cache: Sequence[torch.Tensor], lengths: torch.Tensor,
                   slots: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, heads: int,
                   eps: float) -> torch.Tensor:
    """A stack of L decoder layers in one call: :func:`decoder_layer` of layer 0 on ``x``, of layer 1 on its output,
    and so on; bitwise the same as those L calls, with one dispatch instead of L (each ~25 us from Python on a
    2-core Xeon: a sixth of SmolLM2-135M's one-token step). What ``engine.model.LeanModel`` runs for a step.

    Args:
        x: ``[B, n, H]`` float32 or bfloat16, the first layer's input.
        input_norm, qkv, o, post_norm, gate_up, down, key_cache, value_cache: L tensors each, entry l layer l's
            argument of :func:`decoder_layer` (the caches written in place).
        qkv_bias, q_norm, k_norm: L entries each, a tensor or None (as :func:`decoder_layer` takes them).
        lengths, slots, cos, sin, heads, eps: shared by every layer, as :func:`decoder_layer` takes them (lengths
            not advanced: the caller does, once).

    Returns:
        ``[B, n, H]`` in x's dtype, the last layer's output.

    Raises:
        ValueError: a list empty or of another length than ``input_norm``; what :func:`decoder_layer` raises for a
            layer's arguments.
        TypeError: dtypes.
    """
    lists = (input_norm, qkv, qkv_bias, q_norm, k_norm, o, post_norm, gate_up, down, key_cache, value_cache)
    checks.decoder_layers_lists(*lists)
    args = (x, *(list(t) for t in lists), lengths, slots, cos, sin, int(heads), float(eps))
    if not HAS_EXTENSION:
        return reference.decoder_layers(*args)
    if x.device.type != "cpu" and not checks._is_fake(x):
        raise ValueError(f"decoder_layers has a CPU kernel only (x is on {x.device})")
    return torch.ops.specdec_ext.decoder_layers(*args)


if HAS_EXTENSION:

    @torch.library.register_fake("specdec_ext::decode_attention")
    def _decode_attention_fake(query, key, value, mask, scale):
        return query.new_empty(checks.attention_shapes(query, key, value, mask))

    @torch.library.register_fake("specdec_ext::cache_attention")
    def _cache_attention_fake(query, key, value, starts, scale):
        B, n, Hq, D = checks.cache_attention_shapes(query, key, value, starts)
        return query.new_empty(B, n, Hq, D)

    @torch.library.register_fake("specdec_ext::packed_linear")
    def _packed_linear_fake(x, weight, bias, out_features):
        return x.new_empty(checks.packed_linear_shapes(x, weight, bias, out_features))

    @torch.library.register_fake("specdec_ext::unpack_linear_weight")
    def _unpack_linear_weight_fake(weight, out_features, out):
        K, N = checks.unpack_shapes(weight, out_features, out.dtype)
        checks.unpack_out(out, K, N, out.dtype)

    @torch.library.register_fake("specdec_ext::packed_rows")
    def _packed_rows_fake(weight, ids, out_features, dtype):
        K, _ = checks.unpack_shapes(weight, out_features, dtype, op="packed_rows")
        checks.packed_row_ids(ids, out_features)
        return ids.new_empty((*ids.shape, K), dtype=dtype)

    @torch.library.register_fake("specdec_ext::decoder_layer")
    def _decoder_layer_fake(*args):
        return args[0].new_empty(checks.decoder_layer_shapes(*args))

    @torch.library.register_fake("specdec_ext::decoder_layers")
    def _decoder_layers_fake(x, *args):
        lists, shared = args[:11], args[11:]
        checks.decoder_layers_lists(*lists)
        for layer in zip(*lists):
            checks.decoder_layer_shapes(x, *layer, *shared)
        return x.new_empty(x.shape)
