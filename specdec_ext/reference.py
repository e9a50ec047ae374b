"""Pure-PyTorch reference of every specdec_ext op.

This module is the tests' oracle and the fallback used when the compiled extension
``specdec_ext._C`` is not available. It is written for clarity, one row at a time, and follows
the kernels' conventions exactly:

* uniforms lie in (0, 1]; slot ``i < n_b`` of row ``b`` is candidate ``i``'s acceptance draw and
  slot ``n_b`` draws the final (residual or bonus) token;
* Philox4x32-10 (``philox_uniforms``) yields the same uniforms as ``csrc/kernels/common.h``;
* masses are float32, sums and prefix sums are float64, the inverse CDF picks the first index
  whose prefix sum reaches ``u * Z``.

Formulas: acceptance test and residual distribution from Leviathan et al. 2023 (Alg. 1,
Thm. 1) / Chen et al. 2023 (Alg. 2); stopping rule from SpecDec++ (Huang et al. 2024, Sec. 3.2).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import checks, errors

_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_MASK = 0xFFFFFFFF


def _mulhilo(m: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) 32-bit halves of m * c for c < 2**32, in int64 without overflow."""
    p_lo = m * (c & 0xFFFF)
    p_hi = m * (c >> 16)
    t = p_lo + ((p_hi & 0xFFFF) << 16)
    return t & _MASK, (t >> 32) + (p_hi >> 16)


def _philox(slot: torch.Tensor, row: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 uniforms in (0, 1], float32, elementwise over int64 tensors (broadcast) of counter slot, row,
    and 64-bit seed and offset (as unsigned values in int64, or Python ints below 2**64).

    Counter = (slot, row, offset_lo, offset_hi), key = (seed_lo, seed_hi); the first output word's
    top 24 bits give ``(x + 1) / 2**24``.
    """
    c0, c1 = torch.broadcast_tensors(slot, row)
    c0, c1 = c0.clone(), c1.clone()
    c2, c3 = offset & _MASK, (offset >> 32) & _MASK
    k0, k1 = seed & _MASK, (seed >> 32) & _MASK
    for _ in range(10):
        lo0, hi0 = _mulhilo(_M0, c0)
        lo1, hi1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return ((c0 >> 8) + 1).to(torch.float32) * (1.0 / 16777216.0)


def philox_uniforms(seed: int, offset: int, batch: int, slots: int) -> torch.Tensor:
    """Uniforms in (0, 1] from Philox4x32-10, float32 ``[batch, slots]``, equal to the kernels' draws from one
    (seed, offset): uniform ``[b, j]`` is counter (slot j, row b)."""
    seed &= (1 << 64) - 1
    offset &= (1 << 64) - 1
    rows = torch.arange(batch, dtype=torch.int64).view(-1, 1)
    cols = torch.arange(slots, dtype=torch.int64).view(1, -1)
    wide = lambda v: torch.tensor(v - (1 << 64) if v >= 1 << 63 else v, dtype=torch.int64)  # noqa: E731
    return _philox(cols, rows, wide(seed), wide(offset)).expand(batch, slots).contiguous()


def advance_rows(last, prev, room, seed_offsets, emitted, accepted, rows: int) -> None:
    """Reference of ``ops.advance_rows``, in place: for rows b < ``rows``, with a = ``accepted[b]`` clamped to
    0 .. W - 1 (0 without ``accepted``), ``prev[b]`` = ``emitted[b, a - 1]`` (the old ``last[b]`` where a = 0),
    ``room[b]`` -= a + 1, ``seed_offsets[b, 1]`` += 1, ``last[b]`` = ``emitted[b, a]``."""
    checks.advance_shapes(last, prev, room, seed_offsets, emitted, accepted, rows)
    W = emitted.shape[1]
    for b in range(rows):
        a = 0 if accepted is None else min(max(int(accepted[b]), 0), W - 1)
        if prev is not None:
            prev[b] = emitted[b, a - 1] if a > 0 else last[b]
        if room is not None:
            room[b] -= a + 1
        if seed_offsets is not None:
            seed_offsets[b, 1] += 1
        last[b] = emitted[b, a]


def philox_row_uniforms(seed_offsets: torch.Tensor, slots: int, first_slot: int = 0) -> torch.Tensor:
    """Reference of ``ops.philox_uniforms``: ``[B, slots]`` float32, uniform ``[b, j]`` from row b's own stream,
    counter (slot ``first_slot + j``, row 0) under (seed, offset) = ``seed_offsets[b]`` (``[B, 2]`` int64)."""
    B = checks.philox_shapes(seed_offsets, slots, first_slot)
    so = seed_offsets.detach().cpu()
    cols = torch.arange(first_slot, first_slot + slots, dtype=torch.int64).view(1, -1)
    out = _philox(cols, torch.zeros(1, 1, dtype=torch.int64), so[:, :1], so[:, 1:])
    return out.expand(B, slots).contiguous().to(seed_offsets.device)


def _uniforms(uniforms, philox_seed_offset, batch: int, slots: int) -> torch.Tensor:
    if uniforms is not None:
        return uniforms.detach().to("cpu", torch.float32).reshape(batch, slots)
    so = philox_seed_offset.detach().cpu().tolist()
    return philox_uniforms(int(so[0]), int(so[1]), batch, slots)


def inverse_cdf(mass: torch.Tensor, u: float) -> int:
    """First index whose float64 prefix sum of ``mass`` (float32, >= 0) reaches ``u * sum(mass)``.

    Falls back to the last index with positive mass when rounding leaves the threshold unreached;
    returns -1 if every mass is zero.
    """
    cum = torch.cumsum(mass.double(), 0)
    threshold = float(u) * mass.double().sum().item()
    idx = int(torch.searchsorted(cum, torch.tensor([threshold], dtype=torch.float64)).item())
    if idx < mass.numel() and mass[idx] > 0:
        return idx
    nz = torch.nonzero(mass > 0)
    return int(nz[-1].item()) if nz.numel() else -1


def _raise(op: str, code: int, logits: bool = False):
    raise ValueError(f"{op}: {errors.message(code, logits)}")


def _tolerance(t: torch.Tensor) -> float:
    return errors.SUM_TOLERANCE[str(t.dtype).replace("torch.", "")]


def _check_value(x: torch.Tensor, code: int, op: str) -> None:
    """A probability read at one token: finite and >= 0."""
    if not bool(torch.isfinite(x).all()) or bool((x < 0).any()):
        _raise(op, code)


def _check_prob_row(x: torch.Tensor, bad: int, sum_code: int, op: str, tol: float) -> None:
    """A probability row read in full: finite, >= 0, summing to 1 within ``tol`` (0: kZeroMass)."""
    xf = x.float()
    if not bool(torch.isfinite(xf).all()) or bool((xf < 0).any()):
        _raise(op, bad)
    s = xf.double().sum().item()
    if s == 0.0:
        _raise(op, _ZERO)
    if abs(s - 1.0) > tol:
        _raise(op, sum_code)


_C = {name: code for name, code, _, _ in errors.ERRORS}
_DRAFT, _TARGET, _TOKEN, _UNIFORM, _ZERO = _C["kInvalidDraft"], _C["kInvalidTarget"], _C["kInvalidTokenId"], \
    _C["kInvalidUniform"], _C["kZeroMass"]
_NUM, _DSUM, _TSUM, _DMASK, _TMASK, _TEMP = _C["kInvalidNumDraft"], _C["kDraftSum"], _C["kTargetSum"], \
    _C["kMaskedDraft"], _C["kMaskedTarget"], _C["kInvalidTemperature"]


def residual_or_target(p: torch.Tensor, q: torch.Tensor, u: float, op: str = "residual_sample", tol: float = 1e-3) -> int:
    """Sample from norm(max(0, p - q)) by inverse CDF; from p when the residual mass Z is 0."""
    _check_prob_row(p, _TARGET, _TSUM, op, tol)
    _check_prob_row(q, _DRAFT, _DSUM, op, tol)
    p, q = p.float(), q.float()
    residual = (p - q).clamp_min(0.0)
    mass = residual if residual.double().sum().item() > 0 else p
    j = inverse_cdf(mass, u)
    if j < 0:
        _raise(op, _ZERO)
    return j


def _check_u(u: float, op: str) -> float:
    if not 0.0 < u <= 1.0:
        _raise(op, _UNIFORM)
    return u


def _accept(u: float, q: torch.Tensor, p: torch.Tensor) -> bool:
    """The kernels' acceptance test (kernels/common.h): p > 0 and u * q <= p, in float32."""
    return bool(p > 0) and bool(torch.tensor(u, dtype=torch.float32) * q <= p)


def _row_buffers(num_draft_tokens, B: int, K: int):
    """Per-row candidate counts ``[B]`` (K where ``num_draft_tokens`` is None), and the outputs of a chain
    verification: token ids ``[B, K+1]`` filled with -1 and accepted counts ``[B]``."""
    n_all = num_draft_tokens.detach().cpu().long() if num_draft_tokens is not None else torch.full((B,), K)
    return n_all, torch.full((B, K + 1), -1, dtype=torch.int64), torch.zeros(B, dtype=torch.int64)


def _row_count(n_all: torch.Tensor, b: int, K: int, op: str, logits: bool) -> int:
    """Row b's number of candidates, checked to lie in [0, K]."""
    n = int(n_all[b])
    if not 0 <= n <= K:
        raise ValueError(f"{op}: {errors.message(_NUM, logits)} = [0, {K}], got {n} in row {b}")
    return n


def chain_verify(draft_token_ids, draft_probs, target_probs, num_draft_tokens=None, uniforms=None,
                 philox_seed_offset=None, validate=False):
    """Reference of ``specdec_ext.ops.chain_verify`` (same arguments, same outputs, same checks)."""
    op = "chain_verify"
    B, K, V = checks.verify_shapes(draft_token_ids, draft_probs, target_probs, num_draft_tokens, None, uniforms,
                                   philox_seed_offset, logits=False)
    u_all = _uniforms(uniforms, philox_seed_offset, B, K + 1)
    ids = draft_token_ids.detach().cpu().long()
    dp, tp = draft_probs.detach().cpu(), target_probs.detach().cpu()
    tol = _tolerance(target_probs)
    n_all, out, num_acc = _row_buffers(num_draft_tokens, B, K)
    for b in range(B):
        n = _row_count(n_all, b, K, op, logits=False)
        if validate:
            for i in range(n + 1):
                _check_prob_row(tp[b, i], _TARGET, _TSUM, op, tol)
                if i < n:
                    _check_prob_row(dp[b, i], _DRAFT, _DSUM, op, tol)
        accepted = 0
        while accepted < n:
            tok = int(ids[b, accepted])
            if not 0 <= tok < V:
                _raise(op, _TOKEN)
            q, p = dp[b, accepted, tok].float(), tp[b, accepted, tok].float()
            _check_value(q, _DRAFT, op)
            _check_value(p, _TARGET, op)
            u = _check_u(float(u_all[b, accepted]), op)
            if not _accept(u, q, p):
                break
            out[b, accepted] = tok
            accepted += 1
        u = _check_u(float(u_all[b, n]), op)
        if accepted < n:
            extra = residual_or_target(tp[b, accepted], dp[b, accepted], u, op, tol)
        else:
            _check_prob_row(tp[b, n], _TARGET, _TSUM, op, tol)
            extra = inverse_cdf(tp[b, n].float(), u)
        out[b, accepted] = extra
        num_acc[b] = accepted
    dev = target_probs.device
    return out.to(dev), num_acc.to(dev)


def _softmax_row(x: torch.Tensor, temperature: float, bad: int, masked: int, op: str) -> torch.Tensor:
    """softmax(x / T) as the kernels compute it: exp((x - max) * (1 / T)) in float32, float64 normaliser.
    -inf entries are masked tokens; NaN and +inf are invalid; a row that is -inf everywhere is refused."""
    x = x.float()
    if bool(torch.isnan(x).any()) or bool((x == float("inf")).any()):
        _raise(op, bad, logits=True)
    m = x.max()
    if not bool(m > -3.4028234663852886e38):
        _raise(op, masked, logits=True)
    inv_t = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32)
    e = torch.exp(((x - m) * inv_t).clamp_max(0.0))
    inv_sum = torch.tensor(1.0 / e.double().sum().item(), dtype=torch.float32)
    return e * inv_sum


def _greedy_row(x: torch.Tensor, op: str) -> int:
    x = x.float()
    if bool(torch.isnan(x).any()) or bool((x == float("inf")).any()):
        _raise(op, _TARGET, logits=True)
    if not bool(x.max() > -3.4028234663852886e38):
        _raise(op, _TMASK, logits=True)
    return int(torch.argmax(x))


def chain_verify_logits(draft_token_ids, draft_logits, target_logits, temperature, num_draft_tokens=None,
                        uniforms=None, philox_seed_offset=None, validate=False):
    """Reference of ``specdec_ext.ops.chain_verify_logits``; temperature 0 rows verify greedily."""
    op = "chain_verify_logits"
    B, K, V = checks.verify_shapes(draft_token_ids, draft_logits, target_logits, num_draft_tokens, temperature,
                                   uniforms, philox_seed_offset, logits=True)
    u_all = _uniforms(uniforms, philox_seed_offset, B, K + 1)
    ids = draft_token_ids.detach().cpu().long()
    dl, tl = draft_logits.detach().cpu(), target_logits.detach().cpu()
    temps = temperature.detach().cpu().float()
    n_all, out, num_acc = _row_buffers(num_draft_tokens, B, K)
    for b in range(B):
        n, t = _row_count(n_all, b, K, op, logits=True), float(temps[b])
        if not (t >= 0.0 and t == t and t != float("inf")):
            raise ValueError(f"{op}: temperature must be finite and >= 0 (0 means greedy), got {t} in row {b}")
        if t != 0.0 and bool(torch.tensor(t, dtype=torch.float32) < torch.tensor(errors.MIN_TEMPERATURE, dtype=torch.float32)):
            raise ValueError(f"{op}: {errors.message(_TEMP, True)}, got {t} in row {b}")
        if validate:
            for i in range(n + 1):
                _softmax_row(tl[b, i], t or 1.0, _TARGET, _TMASK, op)
                if i < n and t != 0.0:
                    _softmax_row(dl[b, i], t, _DRAFT, _DMASK, op)
        accepted, extra = 0, -1
        if t == 0.0:
            while True:
                best = _greedy_row(tl[b, accepted], op)
                if accepted == n:
                    extra = best
                    break
                tok = int(ids[b, accepted])
                if not 0 <= tok < V:
                    _raise(op, _TOKEN, True)
                if tok != best:
                    extra = best
                    break
                out[b, accepted] = best
                accepted += 1
        else:
            while accepted < n:
                tok = int(ids[b, accepted])
                if not 0 <= tok < V:
                    _raise(op, _TOKEN, True)
                p = _softmax_row(tl[b, accepted], t, _TARGET, _TMASK, op)
                q = _softmax_row(dl[b, accepted], t, _DRAFT, _DMASK, op)
                u = _check_u(float(u_all[b, accepted]), op)
                if not _accept(u, q[tok], p[tok]):
                    u_final = _check_u(float(u_all[b, n]), op)
                    residual = (p - q).clamp_min(0.0)
                    extra = inverse_cdf(residual if residual.double().sum().item() > 0 else p, u_final)
                    break
                out[b, accepted] = tok
                accepted += 1
            if accepted == n:
                u_final = _check_u(float(u_all[b, n]), op)
                extra = inverse_cdf(_softmax_row(tl[b, n], t, _TARGET, _TMASK, op), u_final)
        out[b, accepted] = extra
        num_acc[b] = accepted
    dev = target_logits.device
    return out.to(dev), num_acc.to(dev)


def chain_verify_greedy(draft_token_ids, target_logits, num_draft_tokens=None):
    """Reference of ``specdec_ext.ops.chain_verify_greedy``."""
    op = "chain_verify_greedy"
    B, K, V = checks.greedy_shapes(draft_token_ids, target_logits, num_draft_tokens)
    ids, tl = draft_token_ids.detach().cpu().long(), target_logits.detach().cpu()
    n_all, out, num_acc = _row_buffers(num_draft_tokens, B, K)
    for b in range(B):
        n = _row_count(n_all, b, K, op, logits=True)
        accepted = 0
        while True:
            best = _greedy_row(tl[b, accepted], op)
            if accepted == n:
                break
            tok = int(ids[b, accepted])
            if not 0 <= tok < V:
                _raise(op, _TOKEN, True)
            if tok != best:
                break
            out[b, accepted] = best
            accepted += 1
        out[b, accepted] = best
        num_acc[b] = accepted
    dev = target_logits.device
    return out.to(dev), num_acc.to(dev)


def residual_sample(target_probs, draft_probs, uniforms=None, philox_seed_offset=None):
    """Reference of ``specdec_ext.ops.residual_sample``: one draw per row from norm(max(0, p - q))."""
    B, _ = checks.residual_shapes(target_probs, draft_probs, uniforms, philox_seed_offset)
    u_all = _uniforms(uniforms, philox_seed_offset, B, 1)
    tp, dp = target_probs.detach().cpu(), draft_probs.detach().cpu()
    tol = _tolerance(target_probs)
    out = torch.tensor([residual_or_target(tp[b], dp[b], _check_u(float(u_all[b, 0]), "residual_sample"),
                                           "residual_sample", tol) for b in range(B)], dtype=torch.int64)
    return out.to(target_probs.device)


def specdecpp_stop(cum_accept: torch.Tensor, candidate_length: int, k_min: int, k_max: int,
                   threshold: float, stop_below: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SpecDec++ stopping rule (Sec. 3.2, Eq. 4): stop iff K >= K_max, or K >= K_min and 1 - prod p_hat > h
    (or prod p_hat < ``stop_below`` of the row, where given), where K = ``candidate_length`` is the round's candidate
    length if drafting stopped now."""
    if candidate_length >= k_max:
        return torch.ones_like(cum_accept, dtype=torch.bool)
    if candidate_length < k_min:
        return torch.zeros_like(cum_accept, dtype=torch.bool)
    stop = (1.0 - cum_accept) > threshold
    return stop if stop_below is None else stop | (cum_accept < stop_below)


def acceptance_head_forward(hidden, features, feature_weight, feature_bias, block_weight, block_bias, out_weight,
                            out_bias) -> torch.Tensor:
    """Acceptance logit (float32, ``[B]``): x_0 = hidden + W_f features + b_f (either part may be None),
    L residual blocks x <- x + SiLU(W_l x + b_l), then w_out . x + b_out."""
    B = (hidden if hidden is not None else features).shape[0]
    x = torch.zeros(B, out_weight.shape[0], dtype=torch.float32, device=out_weight.device)
    if hidden is not None:
        x = x + hidden.float()
    if features is not None:
        x = x + features @ feature_weight.T + feature_bias
    for w, b in zip(block_weight, block_bias):
        x = x + torch.nn.functional.silu(x @ w.T + b)
    return x @ out_weight + out_bias.reshape(())


def acceptance_head_step(hidden, features, feature_weight, feature_bias, block_weight, block_bias, out_weight,
                         out_bias, cum_accept, candidate_length, k_min, k_max, threshold, stop_below=None):
    """Reference of ``specdec_ext.ops.acceptance_head_step``; updates ``cum_accept`` in place."""
    checks.head_shapes(hidden, features, feature_weight, feature_bias, block_weight, block_bias, out_weight, out_bias,
                       cum_accept, candidate_length, k_min, k_max, threshold, stop_below)
    logit = acceptance_head_forward(hidden, features, feature_weight, feature_bias, block_weight, block_bias,
                                    out_weight, out_bias)
    p = torch.sigmoid(logit)
    cum_accept.mul_(p)
    bad = ~(torch.isfinite(logit) & torch.isfinite(cum_accept))
    if bool(bad.any()):
        raise ValueError(f"acceptance_head_step: row {int(bad.nonzero()[0])} gives a NaN or Inf acceptance probability "
                         "or running product (hidden, features or cum_accept hold a NaN or Inf); a NaN would silently "
                         "disable the stop rule")
    return p, specdecpp_stop(cum_accept, candidate_length, k_min, k_max, threshold, stop_below)


def confidence_features(dist, tokens, logits):
    """Reference of ``specdec_ext.ops.confidence_features``: ``[B, 3]`` float32 (q(y), q_(1) - q_(2), H(q) in
    nats) with q = softmax(dist) (``logits``) or q = dist; raises ValueError as the kernels do."""
    op = "confidence_features"
    name = "draft_logits" if logits else "draft_probs"
    checks.confidence_shapes(dist, tokens, logits)
    x = dist.detach().cpu().float()
    toks = tokens.detach().cpu().long()
    B, V = x.shape
    if bool(((toks < 0) | (toks >= V)).any()):
        _raise(op, _TOKEN, logits)
    if logits:
        if bool(torch.isnan(x).any()) or bool((x == float("inf")).any()):
            _raise(op, _DRAFT, True)
        if not bool((x.max(-1).values > -3.4028234663852886e38).all()):
            _raise(op, _DMASK, True)
        q = torch.softmax(x.double(), -1)
    else:
        if not bool(torch.isfinite(x).all()) or bool((x < 0).any()):
            _raise(op, _DRAFT, False)
        q = x.double()
    top = q.topk(min(2, V), -1).values
    second = top[:, 1] if V > 1 else torch.zeros(B, dtype=torch.float64)
    ent = -(q * torch.log(q.clamp_min(1e-300))).where(q > 0, torch.zeros_like(q)).sum(-1)
    out = torch.stack([q.gather(-1, toks.view(-1, 1)).squeeze(-1), top[:, 0] - second, ent], -1).float()
    return out.to(dist.device)


def argmax_tokens(logits):
    """Reference of ``ops.argmax_tokens``: ``torch.argmax(logits, -1)`` (the first index of each row's maximum,
    NaN counting as the maximum), after the op's checks."""
    checks.argmax_shapes(logits)
    return torch.argmax(logits, -1)


def cache_attention(query, key, value, starts, scale):
    """Reference of ``ops.cache_attention``: :func:`decode_attention` with query i of row b seeing the columns
    c <= starts[b] + i."""
    checks.cache_attention_shapes(query, key, value, starts)
    n, C = query.shape[2], key.shape[2]
    pos = starts.view(-1, 1) + torch.arange(n, device=starts.device)  # [B, n]
    mask = (torch.arange(C, device=starts.device).view(1, 1, C) <= pos.unsqueeze(2)).unsqueeze(1)
    return decode_attention(query, key, value, mask, scale)


def decode_attention(query, key, value, mask, scale):
    """Reference of ``ops.decode_attention``: softmax(q k^T * scale, masked) v in float32, per query head with
    the key/value head it shares (grouped-query attention); a query that sees no column gets zeros."""
    checks.attention_shapes(query, key, value, mask)
    if not math.isfinite(scale):
        raise ValueError(f"decode_attention: scale must be finite, got {scale}")
    group = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    scores = (query.float() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    seen = mask.expand_as(scores).any(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1) * seen
    return (weights @ v).transpose(1, 2).to(query.dtype).contiguous()


def unpack_linear_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``W`` ``[N, K]`` from its panels ``[ceil(N / 16), K, 16]`` (``ops.pack_linear_weight``'s inverse); from int8
    panels ``[ceil(N / 16), K + 4, 16]``, the float32 weights they stand for: each int8 times its row's scale; from
    4-bit blocks ``[ceil(N / 16), K / 32, 320]`` uint8, ``d * q + m`` per block; from 8-bit blocks ``[ceil(N / 16), K
    / 32, 544]`` int8, ``d * q``."""
    if checks._blocks(packed):
        q, d, m = block_parts(packed, out_features)
        w = d[..., None] * q.view(out_features, -1, 32).float()
        return (w if m is None else w + m[..., None]).reshape(out_features, -1)
    if packed.dtype == torch.int8:
        P, K4, L = packed.shape
        scales = packed[:, K4 - 4:].contiguous().view(torch.float32).reshape(P * L, 1)  # [P, 4, 16] bytes: 16 floats
        q = packed[:, :K4 - 4].permute(0, 2, 1).reshape(P * L, K4 - 4)
        return (q.float() * scales)[:out_features]
    P, K, L = packed.shape
    return packed.permute(0, 2, 1).reshape(P * L, K)[:out_features]


def packed_rows(packed: torch.Tensor, ids: torch.Tensor, out_features: int, dtype=torch.float32) -> torch.Tensor:
    """Reference of ``ops.packed_rows``: rows ``ids`` of :func:`unpack_linear_weight`'s ``W`` in ``dtype``."""
    K, _ = checks.unpack_shapes(packed, out_features, dtype, floats=True, op="packed_rows")
    checks.packed_row_ids(ids, out_features)
    flat = ids.reshape(-1)
    picked = torch.arange(flat.numel(), device=flat.device) * 16 + flat % 16  # each id's row among its panel's
    rows = unpack_linear_weight(packed[flat // 16], flat.numel() * 16)[picked] if flat.numel() else torch.zeros(0, K)
    return rows.float().to(dtype).view(*ids.shape, K)


def block_parts(packed: torch.Tensor, out_features: int):
    """``(q, d, m)`` of a weight packed in blocks (``ops.pack_linear_weight``, any of its block layouts): q ``[N, K]``
    (uint8 in [0, 15] or int8), d ``[N, K / 32]`` and m (4-bit; None for 8-bit) as float32."""
    P, nb = packed.shape[:2]
    raw = packed.reshape(P, nb, -1).view(torch.uint8)
    bits, a8 = checks._blocks(packed), packed.dim() == 4
    n = 256 if bits == 4 else 512  # bytes of q per block
    body = raw[:, :, :n]
    if a8:  # chunks of 64 bytes: byte 4 l + i of chunk c holds row l's input 4 c + i
        q = body.reshape(P, nb, -1, 16, 4).permute(0, 1, 3, 2, 4).reshape(P, nb, 16, -1)  # [P, block, row, byte]
        if bits == 4:
            q = torch.cat([q & 15, q >> 4], dim=3)  # inputs 0..15 in the low nibbles, 16..31 in the high ones
    else:  # lines of 16 bytes: line j holds every row's input j (4-bit: inputs 2 j, 2 j + 1)
        q = body.reshape(P, nb, -1, 16).transpose(2, 3)  # [P, block, row, line]
        if bits == 4:
            q = torch.stack([q & 15, q >> 4], dim=3).transpose(3, 4).reshape(P, nb, 16, 32)
    q = q.permute(0, 2, 1, 3).reshape(P * 16, nb * 32)[:out_features]
    if bits == 8:
        q = q.view(torch.int8)

    def per_row(t):  # [P, block, 32 bytes] float16 -> [N, block] float32
        return t.contiguous().view(torch.float16).float().permute(0, 2, 1).reshape(P * 16, nb)[:out_features]

    d = per_row(raw[:, :, n:n + 32])
    return q, d, per_row(raw[:, :, n + 32:n + 64]) if bits == 4 else None


def quantize_activations(x: torch.Tensor):
    """Each row's blocks of 32 inputs as int8 (the kernel's int8 activations): ``(r, a)`` with ``x ~ a * r``: r
    ``[..., K]`` float32 holding integers in [-127, 127], ``a = max |x| / 127`` ``[..., K / 32]`` float32."""
    blocks = x.float().view(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1)
    finite = (amax > 0) & torch.isfinite(amax)
    # a tensor divided by a tensor: ``127.0 / amax`` would multiply by amax's reciprocal, another rounding
    inv = torch.where(finite, torch.full_like(amax, 127.0) / torch.where(finite, amax, torch.ones_like(amax)), 0.0)
    r = torch.round(blocks * inv[..., None])
    return torch.where(finite[..., None], r, torch.zeros_like(r)).view(x.shape), amax / 127.0


def packed_linear(x, weight, bias, out_features):
    """Reference of ``ops.packed_linear``: ``x W^T + bias`` with ``W`` unpacked, computed in float32, in x's dtype;
    for blocks packed for int8 activations, with x's blocks quantized (:func:`quantize_activations`) and the sums
    taken in float64."""
    checks.packed_linear_shapes(x, weight, bias, out_features)
    return _linear(x.float(), weight, None if bias is None else bias.float(), out_features).to(x.dtype)


def _linear(x, weight, bias, out_features):  # float32 x [..., K] times a packed weight of any dtype
    if checks._blocks(weight) and weight.dim() == 4:  # int8 activations
        q, d, m = block_parts(weight, out_features)
        r, a = quantize_activations(x)
        lead, K = x.shape[:-1], x.shape[-1]
        s = torch.einsum("rbk,nbk->rnb", r.reshape(-1, K // 32, 32).double(),
                         q.view(out_features, K // 32, 32).double())  # exact integer sums
        y = ((d.double() * a.reshape(-1, 1, K // 32).double()) * s).sum(-1)
        if m is not None:
            y = y + x.reshape(-1, K // 32, 32).double().sum(-1) @ m.double().T
        y = y.float().view(*lead, out_features)
    else:
        y = x @ unpack_linear_weight(weight, out_features).float().T
    return y if bias is None else y + bias


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x, cos, sin):  # RoPE with rotate_half (transformers' Llama): x [..., D], cos/sin broadcast to it
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def decoder_layer(x, input_norm, qkv, qkv_bias, q_norm, k_norm, o, post_norm, gate_up, down, key_cache, value_cache,
                  lengths, slots, cos, sin, heads, eps):
    """Reference of ``ops.decoder_layer``, in torch ops computing in float32: row b (in slot ``slots[b]``, or b) holds
    tokens at positions ``lengths[slot] + i``; their keys and values go to column ``min(position, C - 1)`` of the slot
    (the last column is the cache's scratch one), RoPE reads row ``min(position, T - 1)`` of ``cos`` / ``sin``, and
    query i sees the columns up to its own (``cache_attention``). A bfloat16 layer rounds to bfloat16 where the kernel
    stores: the cache, the queries and the attention output, the layer's output."""
    B, n, H = checks.decoder_layer_shapes(x, input_norm, qkv, qkv_bias, q_norm, k_norm, o, post_norm, gate_up, down,
                                          key_cache, value_cache, lengths, slots, cos, sin, heads, eps)
    dt = x.dtype
    f = (lambda t: None if t is None else t.float())
    S, hk, C, D = key_cache.shape
    inter = checks.packed_in_features(down)
    rows = slots if slots is not None else torch.arange(B, device=x.device)
    starts = lengths[rows]  # [B]
    pos = starts.view(B, 1) + torch.arange(n, device=x.device)  # [B, n]
    rot = pos.clamp_max(cos.shape[0] - 1)
    c, s = f(cos)[rot].unsqueeze(2), f(sin)[rot].unsqueeze(2)  # [B, n, 1, D]
    xf = x.float()
    y = _linear(_rms(xf, f(input_norm), eps), qkv, f(qkv_bias), (heads + 2 * hk) * D).view(B, n, heads + 2 * hk, D)
    q, k, v = y[:, :, :heads], y[:, :, heads: heads + hk], y[:, :, heads + hk:]
    if q_norm is not None:
        q, k = _rms(q, f(q_norm), eps), _rms(k, f(k_norm), eps)
    q, k = _rotate(q, c, s).to(dt), _rotate(k, c, s)
    col = pos.clamp_max(C - 1)
    for b in range(B):
        key_cache[rows[b], :, col[b]] = k[b].transpose(0, 1).to(dt)
        value_cache[rows[b], :, col[b]] = v[b].transpose(0, 1).to(dt)
    attn = cache_attention(q.transpose(1, 2), key_cache[rows], value_cache[rows], starts, D ** -0.5)  # [B, n, Hq, D]
    mid = xf + _linear(attn.float().reshape(B, n, heads * D), o, None, H)
    g, u = _linear(_rms(mid, f(post_norm), eps), gate_up, None, 2 * inter).chunk(2, dim=-1)
    return (mid + _linear(torch.nn.functional.silu(g) * u, down, None, H)).to(dt)


def decoder_layers(x, *args):
    """Reference of ``ops.decoder_layers`` (x, the 11 lists of ``checks.LAYER_LISTS``, then lengths, slots, cos, sin,
    heads, eps): :func:`decoder_layer` of each layer in turn, the output of one the input of the next."""
    checks.decoder_layers_lists(*args[:11])
    for layer in zip(*args[:11]):
        x = decoder_layer(x, *layer, *args[11:])
    return x
