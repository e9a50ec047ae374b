"""Argument checks shared by the fake (meta) kernels and the pure-PyTorch reference.

They mirror the C++ checks in ``csrc/ops_common.h``: every error names the argument and what was
expected, as ``ValueError`` (shapes, values) or ``TypeError`` (dtypes). Value checks that need the
data (NaN/Inf, id range) happen inside the kernels, on the rows they read.
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _float(t: torch.Tensor, name: str, op: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16, got {t.dtype}")


def _index(t: torch.Tensor, name: str, op: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{op}: {name} must be int32 or int64, got {t.dtype}")


def _same_device(t: torch.Tensor, ref: torch.Tensor, name: str, ref_name: str, op: str) -> None:
    if t.device != ref.device:
        raise ValueError(f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")


def _int64_vector(t: torch.Tensor, name: str, n: int, dim: str, ref: torch.Tensor, ref_name: str, op: str,
                  meaning: str = "") -> None:
    """``t`` must be an int64 ``[n]`` tensor (its one dimension called ``dim`` in the message) on ``ref``'s device."""
    if t.dtype != torch.int64:
        raise TypeError(f"{op}: {name} must be int64{meaning}, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{op}: {name} must be [{dim}] = [{n}], got {list(t.shape)}")
    _same_device(t, ref, name, ref_name, op)


def _random(uniforms, seed_offset, shape: tuple, ref: torch.Tensor, op: str) -> None:
    if (uniforms is None) == (seed_offset is None):
        raise ValueError(f"{op}: pass exactly one of uniforms or philox_seed_offset")
    if uniforms is not None:
        if uniforms.dtype != torch.float32:
            raise TypeError(f"{op}: uniforms must be float32, got {uniforms.dtype}")
        if tuple(uniforms.shape) != shape:
            raise ValueError(f"{op}: uniforms must have shape {list(shape)}, got {list(uniforms.shape)}")
        _same_device(uniforms, ref, "uniforms", "the probabilities", op)
    else:
        if seed_offset.dtype != torch.int64:
            raise TypeError(f"{op}: philox_seed_offset must be int64, got {seed_offset.dtype}")
        if tuple(seed_offset.shape) != (2,):
            raise ValueError(f"{op}: philox_seed_offset must have shape [2], got {list(seed_offset.shape)}")
        _same_device(seed_offset, ref, "philox_seed_offset", "the probabilities", op)


def _candidates(draft_token_ids, op: str) -> tuple[int, int]:
    """``draft_token_ids`` must be ``[B, K]`` int32/int64 with K >= 1; returns (B, K)."""
    _index(draft_token_ids, "draft_token_ids", op)
    if draft_token_ids.dim() != 2:
        raise ValueError(f"{op}: draft_token_ids must be [B, K], got shape {list(draft_token_ids.shape)}")
    B, K = draft_token_ids.shape
    if K < 1:
        raise ValueError(f"{op}: the candidate length K (draft_token_ids.shape[1]) must be >= 1, got 0")
    return B, K


def verify_shapes(draft_token_ids, draft, target, num_draft_tokens, temperature, uniforms, seed_offset,
                  logits: bool) -> tuple[int, int, int]:
    """Check chain_verify / chain_verify_logits arguments; return (B, K, V)."""
    op = "chain_verify_logits" if logits else "chain_verify"
    dname, tname = ("draft_logits", "target_logits") if logits else ("draft_probs", "target_probs")
    B, K = _candidates(draft_token_ids, op)
    _float(draft, dname, op)
    _float(target, tname, op)
    if target.dtype != draft.dtype:
        raise TypeError(f"{op}: {tname} has dtype {target.dtype} but {dname} has {draft.dtype}")
    if draft.dim() != 3 or draft.shape[0] != B or draft.shape[1] != K:
        raise ValueError(f"{op}: {dname} must be [B, K, V] = [{B}, {K}, V], got {list(draft.shape)}")
    V = draft.shape[2]
    if V < 1:
        raise ValueError(f"{op}: vocabulary size V must be >= 1")
    if target.dim() != 3 or target.shape[0] != B or target.shape[1] != K + 1:
        raise ValueError(f"{op}: {tname} must be [B, K+1, V] = [{B}, {K + 1}, V], got {list(target.shape)}")
    if target.shape[2] != V:
        raise ValueError(f"{op}: vocabulary mismatch: {dname} has V = {V} but {tname} has V = {target.shape[2]}")
    _same_device(draft_token_ids, target, "draft_token_ids", tname, op)
    _same_device(draft, target, dname, tname, op)
    if num_draft_tokens is not None:
        _index(num_draft_tokens, "num_draft_tokens", op)
        if tuple(num_draft_tokens.shape) != (B,):
            raise ValueError(f"{op}: num_draft_tokens must be [B] = [{B}], got {list(num_draft_tokens.shape)}")
        _same_device(num_draft_tokens, target, "num_draft_tokens", tname, op)
        if num_draft_tokens.device.type == "cpu" and B > 0 and not _is_fake(num_draft_tokens):
            if int(num_draft_tokens.min()) < 0 or int(num_draft_tokens.max()) > K:
                raise ValueError(f"{op}: num_draft_tokens must lie in [0, K] = [0, {K}]")
    if logits:
        if temperature is None:
            raise ValueError(f"{op}: temperature [B] is required")
        if temperature.dtype != torch.float32:
            raise TypeError(f"{op}: temperature must be float32, got {temperature.dtype}")
        if tuple(temperature.shape) != (B,):
            raise ValueError(f"{op}: temperature must be [B] = [{B}], got {list(temperature.shape)}")
        _same_device(temperature, target, "temperature", tname, op)
        if temperature.device.type == "cpu" and B > 0 and not _is_fake(temperature):
            if not bool(torch.isfinite(temperature).all()) or float(temperature.min()) < 0:
                raise ValueError(f"{op}: temperature must be finite and >= 0 (0 means greedy)")
    _random(uniforms, seed_offset, (B, K + 1), target, op)
    return B, K, V


def residual_shapes(target, draft, uniforms, seed_offset) -> tuple[int, int]:
    op = "residual_sample"
    _float(target, "target_probs", op)
    _float(draft, "draft_probs", op)
    if draft.dtype != target.dtype:
        raise TypeError(f"{op}: draft_probs has dtype {draft.dtype} but target_probs has {target.dtype}")
    if target.dim() != 2:
        raise ValueError(f"{op}: target_probs must be [B, V], got {list(target.shape)}")
    B, V = target.shape
    if draft.dim() != 2 or draft.shape[0] != B:
        raise ValueError(f"{op}: draft_probs must be [B, V] = [{B}, V], got {list(draft.shape)}")
    if draft.shape[1] != V:
        raise ValueError(f"{op}: vocabulary mismatch: target_probs has V = {V} but draft_probs has V = {draft.shape[1]}")
    if V < 1:
        raise ValueError(f"{op}: vocabulary size V must be >= 1")
    _same_device(draft, target, "draft_probs", "target_probs", op)
    _random(uniforms, seed_offset, (B,), target, op)
    return B, V


def head_shapes(hidden, features, feature_weight, feature_bias, block_weight, block_bias, out_weight, out_bias,
                cum_accept, candidate_length, k_min, k_max, threshold, stop_below=None):
    """Shape, dtype and device checks of ``acceptance_head_step``; returns (B, H)."""
    op = "acceptance_head_step"
    if hidden is None and features is None:
        raise ValueError(f"{op}: pass hidden [B, H], features [B, F], or both (the head reads nothing otherwise)")
    if out_weight.dim() != 1:
        raise ValueError(f"{op}: out_weight must be [H], got {list(out_weight.shape)}")
    H = out_weight.shape[0]
    ref, ref_name = (hidden, "hidden") if hidden is not None else (features, "features")
    if ref.dim() != 2:
        raise ValueError(f"{op}: {ref_name} must be [B, {'H' if hidden is not None else 'F'}], got {list(ref.shape)}")
    B = ref.shape[0]
    if hidden is not None:
        _float(hidden, "hidden", op)
        if hidden.shape[1] != H:
            raise ValueError(f"{op}: hidden must be [B, H] with H = {H} (the head's width, out_weight's length), got "
                             f"{list(hidden.shape)}: this head belongs to a draft with another hidden size")
    if features is not None:
        if features.dtype != torch.float32:
            raise TypeError(f"{op}: features must be float32, got {features.dtype}")
        if features.dim() != 2 or features.shape[0] != B:
            raise ValueError(f"{op}: features must be [B, F] with B = {B}, got {list(features.shape)}")
        F = features.shape[1]
        if feature_weight is None or feature_bias is None:
            raise ValueError(f"{op}: features need feature_weight [H, F] and feature_bias [H]")
        if tuple(feature_weight.shape) != (H, F):
            raise ValueError(f"{op}: feature_weight must be [H, F] = [{H}, {F}], got {list(feature_weight.shape)}")
        if tuple(feature_bias.shape) != (H,):
            raise ValueError(f"{op}: feature_bias must be [H] = [{H}], got {list(feature_bias.shape)}")
    elif feature_weight is not None or feature_bias is not None:
        raise ValueError(f"{op}: feature_weight / feature_bias given without features")
    if block_weight.dim() != 3 or tuple(block_weight.shape[1:]) != (H, H):
        raise ValueError(f"{op}: block_weight must be [L, H, H] with H = {H}, got {list(block_weight.shape)}")
    L = block_weight.shape[0]
    if tuple(block_bias.shape) != (L, H):
        raise ValueError(f"{op}: block_bias must be [L, H] = [{L}, {H}], got {list(block_bias.shape)}")
    if out_bias.numel() != 1:
        raise ValueError(f"{op}: out_bias must have one element, got {list(out_bias.shape)}")
    if tuple(cum_accept.shape) != (B,):
        raise ValueError(f"{op}: cum_accept must be [B] = [{B}], got {list(cum_accept.shape)}")
    weights = [block_weight, block_bias, out_weight, out_bias, cum_accept]
    weights += [t for t in (feature_weight, feature_bias) if t is not None]
    for t in weights:
        if t.dtype != torch.float32:
            raise TypeError(f"{op}: head weights and cum_accept must be float32, got {t.dtype}")
        _same_device(t, ref, "head weights and cum_accept", ref_name, op)
    if hidden is not None and features is not None:
        _same_device(features, hidden, "features", "hidden", op)
    if candidate_length < 1:
        raise ValueError(f"{op}: candidate_length (the round's candidate length K if drafting stopped now) must be "
                         f">= 1, got {candidate_length}")
    if not 1 <= k_min <= k_max:
        raise ValueError(f"{op}: need 1 <= k_min <= k_max, got k_min = {k_min}, k_max = {k_max}")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"{op}: stop threshold must lie in [0, 1], got {threshold}")
    if stop_below is not None:
        if stop_below.dtype != torch.float32:
            raise TypeError(f"{op}: stop_below must be float32, got {stop_below.dtype}")
        if tuple(stop_below.shape) != (B,):
            raise ValueError(f"{op}: stop_below must be [B] = [{B}], got {list(stop_below.shape)}")
        if stop_below.device != cum_accept.device:
            raise ValueError(f"{op}: stop_below must be on cum_accept's device ({cum_accept.device}), got "
                             f"{stop_below.device}")
    return B, H


def greedy_shapes(draft_token_ids, target_logits, num_draft_tokens):
    """Shape, dtype and device checks of ``chain_verify_greedy``; returns (B, K, V)."""
    op = "chain_verify_greedy"
    B, K = _candidates(draft_token_ids, op)
    _float(target_logits, "target_logits", op)
    if target_logits.dim() != 3 or tuple(target_logits.shape[:2]) != (B, K + 1) or target_logits.shape[2] < 1:
        raise ValueError(f"{op}: target_logits must be [B, K+1, V] = [{B}, {K + 1}, V], got {list(target_logits.shape)}")
    _same_device(draft_token_ids, target_logits, "draft_token_ids", "target_logits", op)
    if num_draft_tokens is not None:
        _index(num_draft_tokens, "num_draft_tokens", op)
        if tuple(num_draft_tokens.shape) != (B,):
            raise ValueError(f"{op}: num_draft_tokens must be [B] = [{B}], got {list(num_draft_tokens.shape)}")
        _same_device(num_draft_tokens, target_logits, "num_draft_tokens", "target_logits", op)
    return B, K, target_logits.shape[2]


def confidence_shapes(dist, tokens, logits):
    """Shape, dtype and device checks of ``confidence_features``; returns (B, V)."""
    op = "confidence_features"
    name = "draft_logits" if logits else "draft_probs"
    _float(dist, name, op)
    if dist.dim() != 2 or dist.shape[1] < 1:
        raise ValueError(f"{op}: {name} must be [B, V] with V >= 1, got {list(dist.shape)}")
    _index(tokens, "tokens", op)
    if tokens.dim() != 1 or tokens.shape[0] != dist.shape[0]:
        raise ValueError(f"{op}: tokens must be [B] = [{dist.shape[0]}], got {list(tokens.shape)}")
    _same_device(tokens, dist, "tokens", name, op)
    return tuple(dist.shape)


def argmax_shapes(logits) -> tuple:
    """Shape and dtype checks of ``argmax_tokens``; returns the output's shape (``logits.shape[:-1]``)."""
    _float(logits, "logits", "argmax_tokens")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"argmax_tokens: logits must be [..., V] with V >= 1 (the vocabulary last), got shape "
                         f"{list(logits.shape)}")
    return tuple(logits.shape[:-1])


def attention_shapes(query, key, value, mask, op: str = "decode_attention") -> tuple[int, int, int, int]:
    """Shape, dtype and device checks of ``decode_attention`` (of query, key and value alone for ``mask`` None, named
    ``op``); returns (B, n, Hq, D), the output's shape."""
    _float(query, "query", op)
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"{op}: key and value must have query's dtype {query.dtype}, got {key.dtype} and {value.dtype}")
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"{op}: mask must be bool (true where a query sees a column), got {mask.dtype}")
    if query.dim() != 4 or query.shape[2] < 1 or query.shape[3] < 1:
        raise ValueError(f"{op}: query must be [B, Hq, n, D] with n, D >= 1, got {list(query.shape)}")
    B, Hq, n, D = query.shape
    if key.dim() != 4 or key.shape[0] != B or key.shape[1] < 1 or key.shape[2] < 1 or key.shape[3] != D:
        raise ValueError(f"{op}: key must be [B, Hkv, C, D] = [{B}, Hkv, C, {D}] with Hkv, C >= 1, got {list(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"{op}: value must have key's shape {list(key.shape)}, got {list(value.shape)}")
    Hkv, C = key.shape[1], key.shape[2]
    if Hq % Hkv:
        raise ValueError(f"{op}: query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if mask is not None and (mask.dim() != 4 or mask.shape[0] not in (B, 1) or mask.shape[1] not in (Hq, 1)
                             or tuple(mask.shape[2:]) != (n, C)):
        raise ValueError(f"{op}: mask must be [B or 1, Hq or 1, n, C] = [{B}, {Hq}, {n}, {C}], got {list(mask.shape)}")
    for t, name in ((key, "key"), (value, "value"), (mask, "mask")):
        if t is not None:
            _same_device(t, query, name, "query", op)
    return B, n, Hq, D


def cache_attention_shapes(query, key, value, starts) -> tuple[int, int, int, int]:
    """Checks of ``cache_attention`` (``decode_attention``'s, with ``starts`` in place of a mask, D <= 256); returns
    (B, n, Hq, D), the output's shape."""
    op = "cache_attention"
    B = attention_shapes(query, key, value, None, op)[0]
    if query.shape[3] > 256:
        raise ValueError(f"{op}: query must be [B, Hq, n, D] with n >= 1 and 1 <= D <= 256, got {list(query.shape)}")
    _int64_vector(starts, "starts", B, "B", query, "query", op, " (positions)")
    return B, query.shape[2], query.shape[1], query.shape[3]


def _is_fake(t: torch.Tensor) -> bool:
    return t.device.type == "meta" or type(t).__name__ == "FakeTensor"


def advance_shapes(last, prev, room, seed_offsets, emitted, accepted, rows: int) -> None:
    """Checks of ``advance_rows`` (the kernel's, with the same messages)."""
    op = "advance_rows"
    if not isinstance(emitted, torch.Tensor) or emitted.dtype != torch.int64:
        raise TypeError(f"{op}: emitted must be int64, got {getattr(emitted, 'dtype', type(emitted).__name__)}")
    if emitted.dim() != 2 or emitted.shape[1] < 1:
        raise ValueError(f"{op}: emitted must be [B, W] with W >= 1, got shape {list(emitted.shape)}")
    if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= emitted.shape[0]:
        raise ValueError(f"{op}: rows must be in 0 .. {emitted.shape[0]} (emitted's rows), got {rows!r}")
    for name, t, dim, written in (("last", last, 1, True), ("prev", prev, 1, True), ("room", room, 1, True),
                                  ("seed_offsets", seed_offsets, 2, True), ("accepted", accepted, 1, False)):
        if t is None and name != "last":
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
            raise TypeError(f"{op}: {name} must be int64, got {getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() != dim or t.shape[0] < rows or (dim == 2 and t.shape[1] != 2):
            want = "[B]" if dim == 1 else "[B, 2]"
            raise ValueError(f"{op}: {name} must be {want} with B >= rows ({rows}), got shape {list(t.shape)}")
        if written and not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (it is written in place)")
        if t.device != emitted.device:
            raise ValueError(f"{op}: {name} is on {t.device} but emitted is on {emitted.device}")


def philox_shapes(seed_offsets, slots: int, first_slot: int) -> int:
    """Checks of ``philox_uniforms``; returns B."""
    op = "philox_uniforms"
    if not isinstance(seed_offsets, torch.Tensor):
        raise TypeError(f"{op}: seed_offsets must be a torch.Tensor, got {type(seed_offsets).__name__}")
    if seed_offsets.dtype != torch.int64:
        raise TypeError(f"{op}: seed_offsets must be int64, got {seed_offsets.dtype}")
    if seed_offsets.dim() != 2 or seed_offsets.shape[1] != 2:
        raise ValueError(f"{op}: seed_offsets must be [B, 2] (a seed and an offset per row), got shape "
                         f"{list(seed_offsets.shape)}")
    if not (isinstance(slots, int) and isinstance(first_slot, int) and slots >= 0 and first_slot >= 0
            and first_slot + slots <= 2**32):
        raise ValueError(f"{op}: slots and first_slot must be >= 0 with first_slot + slots <= 2**32 (Philox counter "
                         f"slots), got {slots} and {first_slot}")
    return seed_offsets.shape[0]


LAYER_DTYPES = (torch.float32, torch.bfloat16)  # of packed_linear and decoder_layer


def _like(t, shape: tuple, name: str, op: str, ref) -> None:
    """``t`` a tensor of ``ref``'s dtype and ``shape`` (-1: any size) on ``ref``'s device, contiguous (the kernels'
    messages)."""
    if not isinstance(t, torch.Tensor) or t.dtype != ref.dtype:
        raise TypeError(f"{op}: {name} must have x's dtype {ref.dtype}, got {getattr(t, 'dtype', type(t).__name__)}")
    if t.dim() != len(shape) or any(s >= 0 and t.shape[d] != s for d, s in enumerate(shape)):
        raise ValueError(f"{op}: {name} must be {list(shape)} (-1: any), got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous")
    _same_device(t, ref, name, "x", op)


def _packed(w, out_features: int, in_features: int, name: str, op: str, x) -> None:
    """``w`` a weight packed by ``ops.pack_linear_weight``: ``[ceil(N / 16), K, 16]`` in x's dtype, int8 panels
    ``[ceil(N / 16), K + 4, 16]`` or blocks ``[ceil(N / 16), K / 32, 320]`` (4-bit) / ``544`` (8-bit), for int8
    activations ``[ceil(N / 16), K / 32, 5, 64]`` / ``[..., 17, 32]`` (the kernels' messages)."""
    blocks = _blocks(w)
    if blocks:
        a8 = w.dim() == 4
        shape = [-(-out_features // 16), in_features // 32]
        shape += ([5, 64] if blocks == 4 else [17, 32]) if a8 else [320 if blocks == 4 else 544]
        if in_features % 32 or list(w.shape) != shape:
            raise ValueError(f"{op}: {name} ({blocks}-bit blocks{' for int8 activations' if a8 else ''}) must be "
                             f"{shape} (in features a multiple of 32), got {list(w.shape)}")
        if not w.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
        _same_device(w, x, name, "x", op)
        return
    if isinstance(w, torch.Tensor) and w.dtype == torch.int8:
        shape = [-(-out_features // 16), in_features + 4, 16]
        if list(w.shape) != shape:
            raise ValueError(f"{op}: {name} (int8 panels) must be {shape}, got {list(w.shape)}")
        if not w.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
        _same_device(w, x, name, "x", op)
        return
    _like(w, (-(-out_features // 16), in_features, 16), name, op, x)


def packed_in_features(w) -> int:
    """A packed weight's in_features K (``[P, K, 16]``, int8 ``[P, K + 4, 16]``, 4-bit blocks ``[P, K / 32,
    320]``, 8-bit blocks ``[P, K / 32, 544]``, blocks for int8 activations ``[P, K / 32, ...]``)."""
    if _blocks(w):
        return w.shape[1] * 32
    return w.shape[1] - (4 if w.dtype == torch.int8 else 0)


def _blocks(w) -> int:
    """4 or 8 for a weight packed in blocks (uint8 ``[P, K / 32, 320]``, int8 ``[P, K / 32, 544]``; for int8
    activations, uint8 / int8 of 4 dimensions), else 0."""
    if not isinstance(w, torch.Tensor):
        return 0
    if w.dtype == torch.uint8:
        return 4
    return 8 if w.dtype == torch.int8 and (w.dim() == 4 or (w.dim() == 3 and w.shape[2] == 544)) else 0


def packed_linear_shapes(x, weight, bias, out_features: int) -> tuple:
    """Checks of ``packed_linear`` (the kernel's, with the same messages); returns the output's shape."""
    op = "packed_linear"
    if not isinstance(x, torch.Tensor) or x.dtype not in LAYER_DTYPES:
        raise TypeError(f"{op}: x must be float32 or bfloat16, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{op}: x must be [..., K] with K >= 1, got {list(x.shape)}")
    if out_features < 1:
        raise ValueError(f"{op}: out_features must be >= 1, got {out_features}")
    _packed(weight, out_features, x.shape[-1], "weight", op, x)
    if bias is not None:
        _like(bias, (out_features,), "bias", op, x)
    return (*x.shape[:-1], out_features)


def unpack_shapes(weight, out_features: int, dtype, floats: bool = False, op: str = "unpack_linear_weight") -> tuple:
    """Checks of ``unpack_linear_weight`` (or ``op``: ``packed_rows``, which takes the same arguments), the kernel's,
    with the same messages (``floats``: float panels allowed, which the wrapper rearranges without the kernel);
    returns W^T's shape ``(K, N)``."""
    allowed = (torch.int8, torch.uint8, *(LAYER_DTYPES if floats else ()))
    if not isinstance(weight, torch.Tensor) or weight.dtype not in allowed:
        raise TypeError(f"{op}: weight must be a quantized packing (int8 panels, uint8 or int8 blocks)"
                        f"{' or float panels' if floats else ''}, got {getattr(weight, 'dtype', type(weight).__name__)}")
    if dtype not in LAYER_DTYPES:
        raise TypeError(f"{op}: dtype must be float32 or bfloat16, got {dtype}")
    if out_features < 1:
        raise ValueError(f"{op}: out_features must be >= 1, got {out_features}")
    if weight.dim() < 3:
        raise ValueError(f"{op}: weight must be a packing [P, ...], got {list(weight.shape)}")
    K = packed_in_features(weight)
    _packed(weight, out_features, K, "weight", op, weight)
    return K, out_features


def packed_row_ids(ids, out_features: int) -> None:
    """Checks of ``packed_rows``' ids (the kernel's, with the same messages): int64, each in ``[0, out_features)``
    (their values read where they can be: off the meta device)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64:
        raise TypeError(f"packed_rows: ids must be int64, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if not _is_fake(ids) and ids.numel():
        bad = ids.reshape(-1)[(ids.reshape(-1) < 0) | (ids.reshape(-1) >= out_features)]
        if bad.numel():
            raise ValueError(f"packed_rows: ids must be in [0, {out_features}) (the weight's rows), got {int(bad[0])}")


def unpack_out(out, K: int, N: int, dtype) -> None:
    """Checks of ``unpack_linear_weight``'s ``out`` (the kernel's, with the same message)."""
    if not isinstance(out, torch.Tensor) or out.dtype != dtype:
        raise TypeError(f"unpack_linear_weight: out must be {dtype}, got {getattr(out, 'dtype', type(out).__name__)}")
    if out.dim() != 2 or tuple(out.shape) != (K, N) or not out.is_contiguous():
        raise ValueError(f"unpack_linear_weight: out must be [{K}, {N}] (W^T), contiguous, got {list(out.shape)}")


LAYER_LISTS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "post_norm", "gate_up", "down", "key_cache",
               "value_cache")


def decoder_layers_lists(*lists) -> int:
    """Checks of ``decoder_layers``' per-layer lists (in :data:`LAYER_LISTS` order, the kernel's messages): each a
    list or tuple, ``input_norm`` not empty, all of its length; returns that length, the layer count L."""
    op = "decoder_layers"
    for name, entries in zip(LAYER_LISTS, lists):
        if not isinstance(entries, (list, tuple)):
            raise TypeError(f"{op}: {name} must be a list with an entry per layer, got {type(entries).__name__}")
    L = len(lists[0])
    if L < 1:
        raise ValueError(f"{op}: input_norm must hold a tensor per layer (at least one), got none")
    for name, entries in zip(LAYER_LISTS[1:], lists[1:]):
        if len(entries) != L:
            raise ValueError(f"{op}: {name} must hold {L} entries (one per layer, as input_norm), got {len(entries)}")
    return L


def decoder_layer_shapes(x, input_norm, qkv, qkv_bias, q_norm, k_norm, o, post_norm, gate_up, down, key_cache,
                         value_cache, lengths, slots, cos, sin, heads: int, eps: float) -> tuple:
    """Checks of ``decoder_layer`` (the kernel's, with the same messages; the slots' and lengths' values are
    checked where they can be read: off the meta device); returns the output's shape, x's."""
    op = "decoder_layer"
    if not isinstance(x, torch.Tensor) or x.dtype not in LAYER_DTYPES:
        raise TypeError(f"{op}: x must be float32 or bfloat16, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() != 3 or min(x.shape) < 1:
        raise ValueError(f"{op}: x must be [B, n, H] with B, n, H >= 1, got {list(x.shape)}")
    B, n, H = x.shape
    if key_cache.dim() != 4 or min(key_cache.shape) < 1 or key_cache.shape[3] < 2 or key_cache.shape[3] % 2:
        raise ValueError(f"{op}: key_cache must be [S, Hkv, C, D] with D even, got {list(key_cache.shape)}")
    S, Hkv, C, D = key_cache.shape
    if heads < 1 or heads % Hkv:
        raise ValueError(f"{op}: heads must be a multiple of key_cache's {Hkv} key/value heads, got {heads}")
    if not (down.dim() == 3 or (down.dim() == 4 and _blocks(down))) or packed_in_features(down) < 1:
        raise ValueError(f"{op}: down must be packed [H / 16, I, 16] (int8: [H / 16, I + 4, 16]; 4-bit: [H / 16, "
                         f"I / 32, 320]), got {list(down.shape)}")
    kinds = [(_blocks(w), getattr(w, "dtype", None) == torch.int8, getattr(w, "dim", lambda: 0)()) for w in
             (qkv, o, gate_up, down)]
    if len(set(kinds)) > 1:
        raise TypeError(f"{op}: qkv, o, gate_up and down must all be int8 panels, all blocks of one kind or all in "
                        f"x's dtype, got "
                        f"{', '.join(str(getattr(w, 'dtype', None)) for w in (qkv, o, gate_up, down))}")
    inter, width = packed_in_features(down), (heads + 2 * Hkv) * D
    if H % 16 or width % 16 or (2 * inter) % 16:
        raise ValueError(f"{op}: every product's out features must be a multiple of 16 (H = {H}, QKV = {width}, "
                         f"2 I = {2 * inter})")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{op}: eps must be finite and >= 0, got {eps}")
    _like(x, (B, n, H), "x", op, x)
    _like(input_norm, (H,), "input_norm", op, x)
    _like(post_norm, (H,), "post_norm", op, x)
    for name, w, out_f, in_f in (("qkv", qkv, width, H), ("o", o, H, heads * D), ("gate_up", gate_up, 2 * inter, H),
                                 ("down", down, H, inter)):
        _packed(w, out_f, in_f, name, op, x)
    if qkv_bias is not None:
        _like(qkv_bias, (width,), "qkv_bias", op, x)
    if (q_norm is None) != (k_norm is None):
        raise ValueError(f"{op}: pass both q_norm and k_norm or neither")
    if q_norm is not None:
        _like(q_norm, (D,), "q_norm", op, x)
        _like(k_norm, (D,), "k_norm", op, x)
    _like(key_cache, (S, Hkv, C, D), "key_cache", op, x)
    _like(value_cache, (S, Hkv, C, D), "value_cache", op, x)
    _like(cos, (-1, D), "cos", op, x)
    _like(sin, (cos.shape[0], D), "sin", op, x)
    if cos.shape[0] < 1:
        raise ValueError(f"{op}: cos must have a row per position, got {list(cos.shape)}")
    _int64_vector(lengths, "lengths", S, "S", x, "x", op)
    if slots is not None:
        _int64_vector(slots, "slots", B, "B", x, "x", op)
    elif B > S:
        raise ValueError(f"{op}: x has {B} rows but the cache {S} slots")
    if not _is_fake(x):
        rows = slots.tolist() if slots is not None else list(range(B))
        for b, s in enumerate(rows):
            if not 0 <= s < S:
                raise ValueError(f"{op}: slots[{b}] = {s} is not a slot of the cache's {S}")
            if int(lengths[s]) < 0:
                raise ValueError(f"{op}: lengths[{s}] = {int(lengths[s])} is negative")
    return B, n, H
