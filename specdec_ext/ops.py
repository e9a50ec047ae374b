"""Typed wrappers of the fused speculative-sampling ops, with fake (meta) kernels; the model-layer ops (attention over
a KV cache, packed linear, decoder layer) are in ``layer_ops`` and re-exported here.

The ops are registered by the C++ extension as ``torch.ops.specdec_ext.*`` (schemas in
``csrc/ops.cpp``) with CPU kernels and, in a CUDA build, CUDA kernels. The fake kernels below
let them trace under ``torch.compile`` and be captured in CUDA graphs. Without the compiled
extension, every wrapper falls back to ``specdec_ext.reference`` (same results, slower).

Randomness, for every sampling op, comes from exactly one of:

* ``uniforms``: explicit float32 draws in (0, 1] (tests, replay). Slot ``i < n_b`` of row ``b`` is
  the acceptance draw of candidate ``i``; slot ``n_b`` draws the final (residual or bonus) token.
* ``philox_seed_offset``: an int64 ``[2]`` tensor (seed, offset) on the op's device; the kernel
  draws Philox4x32-10 uniforms from it (same numbers on CPU and CUDA). Passing a device tensor that
  you update between replays makes the op capturable in a CUDA graph.
* ``generator`` (default: the device's default generator): draws ``philox_seed_offset`` with
  ``torch.randint`` on the generator's device, which is capture-safe for CUDA generators.

Method (lossless speculative sampling; Leviathan et al. 2023, Alg. 1 and Thm. 1; Chen et al. 2023,
Alg. 2): candidate ``x_i ~ q_i`` is accepted iff ``u_i * q_i(x_i) <= p_i(x_i)``, i.e. with
probability ``min(1, p_i/q_i)``. At the first rejection the output token is drawn from the
residual distribution ``norm(max(0, p_i - q_i))`` (from ``p_i`` if the residual mass Z is 0);
if all candidates are accepted a bonus token is drawn from ``p_{n_b}``. The emitted tokens then
follow the target distribution exactly.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import checks, errors, reference
from ._library import HAS_EXTENSION, library_path
from .layer_ops import (  # noqa: F401 (re-exported: the model-layer ops live in layer_ops)
    BLOCK, PANEL, cache_attention, decode_attention, decoder_layer, decoder_layers, dequantize_blocks,
    pack_linear_weight, packed_linear, packed_rows, quantize_blocks, quantize_rows, unpack_linear_weight)



__all__ = [
    "HAS_EXTENSION",
    "library_path",
    "chain_verify",
    "chain_verify_logits",
    "chain_verify_greedy",
    "residual_sample",
    "acceptance_head_step",
    "confidence_features",
    "argmax_tokens",
    "decode_attention",
    "PANEL",
    "cache_attention",
    "pack_linear_weight",
    "quantize_rows",
    "quantize_blocks",
    "dequantize_blocks",
    "packed_linear",
    "unpack_linear_weight",
    "packed_rows",
    "decoder_layer",
    "decoder_layers",
    "draw_philox_seed_offset",
    "philox_uniforms",
    "advance_rows",
]

def draw_philox_seed_offset(device: torch.device, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Draw an int64 ``[2]`` (seed, offset) tensor on ``device`` from ``generator`` (or the default one)."""
    gen_device = generator.device if generator is not None else torch.device(device)
    so = torch.randint(0, 2**62, (2,), dtype=torch.int64, generator=generator, device=gen_device)
    return so.to(device, non_blocking=True)


def philox_uniforms(seed_offsets: torch.Tensor, slots: int, first_slot: int = 0) -> torch.Tensor:
    """Uniforms from per-row Philox streams: row b's draws depend on its own (seed, offset) alone, so a sampled row
    draws the same numbers in any batch and at any place in it (the engine's per-request randomness).

    Args:
        seed_offsets: ``[B, 2]`` int64 on the device of the result, row b's (seed, offset); a device tensor updated
            between replays keeps the op capturable in a CUDA graph.
        slots: n >= 0 uniforms per row; first_slot: the Philox counter slot of the first (>= 0).

    Returns:
        ``[B, n]`` float32 in (0, 1]: uniform ``[b, j]`` is Philox4x32-10 at counter (slot ``first_slot + j``, row 0,
        offset_b) with key seed_b, the same number on CPU and CUDA as the other ops draw (module docstring), and as
        ``reference.philox_row_uniforms``.

    Raises:
        ValueError: seed_offsets not ``[B, 2]``, slots or first_slot below 0 or past 2**32 counter slots.
        TypeError: seed_offsets not int64.
    """
    if not HAS_EXTENSION:
        return reference.philox_row_uniforms(seed_offsets, slots, first_slot)
    checks.philox_shapes(seed_offsets, slots, first_slot)
    return torch.ops.specdec_ext.philox_uniforms(seed_offsets, slots, first_slot)


def advance_rows(last: torch.Tensor, prev: Optional[torch.Tensor], room: Optional[torch.Tensor],
                 seed_offsets: Optional[torch.Tensor], emitted: torch.Tensor, accepted: Optional[torch.Tensor],
                 rows: int) -> None:
    """The next round's per-row inputs written in place, on the device, from a round's emitted tokens (overlapped
    rounds, ``engine/round.StepRunner.advance``): one kernel, capturable, no read-back.

    For each row b < ``rows``, a = ``accepted[b]`` (0 without ``accepted``, a plain step; a negative error code
    counts as 0; at most W - 1): ``last[b]`` becomes ``emitted[b, a]`` (the token the row emitted last), ``prev[b]``
    ``emitted[b, a - 1]`` (the old ``last[b]`` where a = 0), ``room[b]`` shrinks by the a + 1 tokens emitted and the
    Philox round count ``seed_offsets[b, 1]`` grows by 1; rows from ``rows`` on are untouched.

    Args:
        last: ``[P]`` int64, written. prev, room: ``[P]`` int64 or None, written. seed_offsets: ``[P, 2]`` int64 or
            None, its offsets written. emitted: ``[P', W]`` int64 (``verify_step``'s tokens), W >= 1. accepted:
            ``[P']`` int64 or None. rows: the rows advanced, 0 <= rows <= P', P (the written tensors contiguous,
            all on one device).

    Raises:
        TypeError: a tensor that is not int64. ValueError: shapes, ``rows`` out of range, a written tensor that is
        not contiguous, tensors on different devices.
    """
    if not HAS_EXTENSION:
        return reference.advance_rows(last, prev, room, seed_offsets, emitted, accepted, rows)
    # the compiled op checks its arguments with checks.advance_shapes' messages: a round's hot path, checked once
    torch.ops.specdec_ext.advance_rows(last, prev, room, seed_offsets, emitted, accepted, rows)


def _randomness(device, uniforms, philox_seed_offset, generator):
    if uniforms is not None and philox_seed_offset is not None:
        raise ValueError("pass at most one of uniforms or philox_seed_offset")
    if uniforms is None and philox_seed_offset is None:
        philox_seed_offset = draw_philox_seed_offset(device, generator)
    return uniforms, philox_seed_offset


def _widened(draft: torch.Tensor, target: torch.Tensor, fill: float) -> torch.Tensor:
    """``draft`` ``[..., V_draft]`` with fewer entries than ``target``'s V (a draft whose embedding rows are fewer:
    docs/design.md, "Embedding sizes that differ") padded to V with ``fill`` (0 for probabilities, -inf for logits):
    probability 0 beyond its rows. Other shapes pass unchanged, for the op's own checks."""
    if draft.dim() == 0 or target.dim() == 0 or draft.shape[-1] >= target.shape[-1] or draft.shape[-1] == 0:
        return draft
    return torch.nn.functional.pad(draft, (0, target.shape[-1] - draft.shape[-1]), value=fill)


def _raise_device_codes(num_accepted: torch.Tensor, op: str, logits: bool = False) -> None:
    """CUDA kernels cannot raise: they write a negative code into num_accepted. Check it when we may sync."""
    if num_accepted.device.type != "cuda" or torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling():
        return
    bad = num_accepted.min()
    if int(bad) < 0:
        raise ValueError(f"{op}: {errors.message(int(bad), logits)}")


def chain_verify(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    num_draft_tokens: Optional[torch.Tensor] = None,
    *,
    uniforms: Optional[torch.Tensor] = None,
    philox_seed_offset: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    validate: bool = False,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused chain verification: rejection sampling, residual resampling and bonus token, in one op.

    Args:
        draft_token_ids: ``[B, K]`` int32/int64, the K >= 1 candidates proposed by the draft.
        draft_probs: ``[B, K, V]`` float32/bfloat16/float16, draft distributions q_i that produced them; or
            ``[B, K, V_draft]`` with V_draft < V (a draft with fewer embedding rows: q = 0 beyond them).
        target_probs: ``[B, K+1, V]``, same dtype, target distributions p_0..p_K (p_K for the bonus token).
        num_draft_tokens: optional ``[B]`` int32/int64 in [0, K]: row b verifies only its first n_b
            candidates (ragged batch); n_b = 0 samples just the bonus token from p_0.
        uniforms / philox_seed_offset / generator: randomness, see the module docstring; uniforms is
            float32 ``[B, K+1]`` in (0, 1].
        validate: check every row the op may read (target rows 0..n_b, draft rows 0..n_b - 1) in full,
            for debugging; by default (see "Checked" below) an accepted candidate's rows are read, and
            checked, only at its token.
        check: on CUDA, read the kernel's error codes back and raise (a synchronisation); False leaves a row's
            negative code in ``num_accepted`` for the caller to read with its results (the engine's round reads
            them in its one read-back). The CPU kernel raises either way.

    Returns:
        ``(output_token_ids [B, K+1] int64, num_accepted [B] int64)``: row b holds its accepted prefix
        (num_accepted[b] tokens), then the residual or bonus token, then -1 padding.

    Checked: the rows read in full (p and q at a rejection, p for the bonus token) must be finite, >= 0
    and sum to 1 within 1e-3 (float32), 1e-2 (float16) or 2e-2 (bfloat16): unnormalised rows are refused,
    not renormalised, since the acceptance test min(1, p/q) would be wrong for them; at an accepted
    candidate, p(x) and q(x) must be finite and >= 0. A candidate with p(x) = 0 is never accepted.

    Raises:
        ValueError: wrong shapes, vocabulary mismatch, K = 0, n_b outside [0, K], devices that differ,
            a checked row or value that is NaN/Inf/negative or does not sum to 1, out-of-range ids,
            uniforms outside (0, 1] (messages: ``specdec_ext.errors``, the same on CPU and CUDA).
        TypeError: unsupported dtypes.

    Sums are accumulated in float64 (probabilities are read as float32).
    """
    uniforms, philox_seed_offset = _randomness(target_probs.device, uniforms, philox_seed_offset, generator)
    draft_probs = _widened(draft_probs, target_probs, 0.0)
    if not HAS_EXTENSION:
        return reference.chain_verify(draft_token_ids, draft_probs, target_probs, num_draft_tokens, uniforms,
                                      philox_seed_offset, validate)
    out, num = torch.ops.specdec_ext.chain_verify(draft_token_ids, draft_probs, target_probs, num_draft_tokens,
                                                  uniforms, philox_seed_offset, validate)
    if check:
        _raise_device_codes(num, "chain_verify")
    return out, num


def chain_verify_logits(
    draft_token_ids: torch.Tensor,
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    temperature: torch.Tensor,
    num_draft_tokens: Optional[torch.Tensor] = None,
    *,
    uniforms: Optional[torch.Tensor] = None,
    philox_seed_offset: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    validate: bool = False,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain verification from logits with the softmax fused in (no [B, K+1, V] probabilities written).

    Row b uses p_i = softmax(target_logits[b, i] / T_b) and q_i = softmax(draft_logits[b, i] / T_b).
    A row with ``temperature[b] == 0`` is verified greedily: candidate i is accepted iff it equals
    argmax(target_logits[b, i]) (first index on ties), and the target's argmax is emitted at the
    first mismatch (or as the bonus token). Greedy and sampled rows may share a batch.

    Args:
        draft_token_ids: ``[B, K]`` int32/int64.
        draft_logits: ``[B, K, V]`` float32/bfloat16/float16, or ``[B, K, V_draft]`` with V_draft < V (q = 0
            beyond the draft's rows).
        target_logits: ``[B, K+1, V]``, same dtype.
        temperature: ``[B]`` float32: 0 (greedy) or >= 1e-6 (``errors.MIN_TEMPERATURE``; float32 cannot
            sample at a smaller one, which is refused rather than silently treated as greedy).
        num_draft_tokens, uniforms, philox_seed_offset, generator, validate, check: as in :func:`chain_verify`.

    Logits may be ``-inf`` (masked tokens: top-k, top-p, grammars); NaN and ``+inf`` are refused, and so is
    a row that is ``-inf`` everywhere. The softmax is computed as exp((x - max) / T), stable at any allowed T.

    Returns / Raises: as :func:`chain_verify`.
    """
    uniforms, philox_seed_offset = _randomness(target_logits.device, uniforms, philox_seed_offset, generator)
    draft_logits = _widened(draft_logits, target_logits, float("-inf"))
    if not HAS_EXTENSION:
        return reference.chain_verify_logits(draft_token_ids, draft_logits, target_logits, temperature,
                                             num_draft_tokens, uniforms, philox_seed_offset, validate)
    out, num = torch.ops.specdec_ext.chain_verify_logits(draft_token_ids, draft_logits, target_logits, temperature,
                                                         num_draft_tokens, uniforms, philox_seed_offset, validate)
    if check:
        _raise_device_codes(num, "chain_verify_logits", logits=True)
    return out, num


def chain_verify_greedy(
    draft_token_ids: torch.Tensor,
    target_logits: torch.Tensor,
    num_draft_tokens: Optional[torch.Tensor] = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy chain verification: candidate i is accepted iff it is the argmax of ``target_logits[b, i]``
    (first index on ties), and the target's argmax is emitted at the first mismatch or as the bonus token.
    No draft distribution and no randomness (as vLLM keeps its greedy sampler apart); the output equals
    greedy target-only decoding of the same logits.

    Args:
        draft_token_ids: ``[B, K]`` int32/int64.
        target_logits: ``[B, K+1, V]`` float32/bfloat16/float16; ``-inf`` entries are masked tokens.
        num_draft_tokens: optional ``[B]`` in [0, K] (ragged rows).
        check: as in :func:`chain_verify`.

    Returns / Raises: as :func:`chain_verify` (NaN/+Inf logits, a fully masked row read, ids or n_b out of range).
    """
    if not HAS_EXTENSION:
        return reference.chain_verify_greedy(draft_token_ids, target_logits, num_draft_tokens)
    out, num = torch.ops.specdec_ext.chain_verify_greedy(draft_token_ids, target_logits, num_draft_tokens)
    if check:
        _raise_device_codes(num, "chain_verify_greedy", logits=True)
    return out, num


def residual_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    *,
    uniforms: Optional[torch.Tensor] = None,
    philox_seed_offset: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """One draw per row from the residual distribution norm(max(0, p - q)) (Leviathan et al. 2023, Thm. 1).

    Args:
        target_probs: ``[B, V]`` float32/bfloat16/float16, p.
        draft_probs: ``[B, V]``, same dtype, q; or ``[B, V_draft]`` with V_draft < V (q = 0 beyond).
        uniforms: optional float32 ``[B]`` in (0, 1]; or philox_seed_offset / generator.

    Returns:
        ``[B]`` int64 token ids. When the residual mass Z is 0 (p = q up to rounding) the draw is from p.
        Never an id with zero target mass.

    Both rows are read in full and checked as :func:`chain_verify` checks the rows it reads in full.

    Raises:
        ValueError / TypeError: as :func:`chain_verify`.
    """
    uniforms, philox_seed_offset = _randomness(target_probs.device, uniforms, philox_seed_offset, generator)
    draft_probs = _widened(draft_probs, target_probs, 0.0)
    if not HAS_EXTENSION:
        return reference.residual_sample(target_probs, draft_probs, uniforms, philox_seed_offset)
    out = torch.ops.specdec_ext.residual_sample(target_probs, draft_probs, uniforms, philox_seed_offset)
    _raise_device_codes(out, "residual_sample")
    return out


_HEAD_NAN = ("acceptance_head_step: a row gives a NaN or Inf acceptance probability or running product "
             "(hidden, features or cum_accept hold a NaN or Inf); a NaN would silently disable the stop rule")


def acceptance_head_step(
    hidden: Optional[torch.Tensor],
    features: Optional[torch.Tensor],
    feature_weight: Optional[torch.Tensor],
    feature_bias: Optional[torch.Tensor],
    block_weight: torch.Tensor,
    block_bias: torch.Tensor,
    out_weight: torch.Tensor,
    out_bias: torch.Tensor,
    cum_accept: torch.Tensor,
    candidate_length: int,
    k_min: int,
    k_max: int,
    threshold: float,
    stop_below: Optional[torch.Tensor] = None,
    *,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One SpecDec++ drafting step of the acceptance head, fused (Huang et al. 2024, Sec. 3.2, Eq. 4).

    Computes the head's acceptance probability p_hat = sigmoid(w_out . x_L + b_out), where
    x_0 = hidden + W_f features + b_f and x_l = x_{l-1} + SiLU(W_l x_{l-1} + b_l); updates
    ``cum_accept *= p_hat`` in place; and decides
    stop = K >= K_max or (K >= K_min and (1 - cum_accept > h or cum_accept < stop_below)), with
    K = ``candidate_length``.

    Args:
        hidden: ``[B, H]`` float32/bfloat16/float16, a draft hidden state (which one depends on the head:
            :class:`~specdec_ext.head.AcceptanceHead`), or None for a head that reads only ``features``.
        features: ``[B, F]`` float32 draft-confidence features (``head.confidence_features``), or None.
        feature_weight: ``[H, F]`` float32 and feature_bias ``[H]`` float32 (None without features); the
            features' normalisation is folded into them (:meth:`AcceptanceHead.fused_weights`).
        block_weight: ``[L, H, H]`` float32 (out, in); block_bias: ``[L, H]`` float32.
        out_weight: ``[H]`` float32 (H, the head's width, is its length); out_bias: ``[1]`` float32.
        cum_accept: ``[B]`` float32, running product of p_hat over this round's candidates, updated in place.
        candidate_length: the round's candidate length K if drafting stopped after this step (>= 1).
        k_min, k_max: candidate-length bounds, 1 <= k_min <= k_max (paper: [2, 20]).
        threshold: stop threshold h in [0, 1] (paper: 0.3 or 0.7).
        stop_below: ``[B]`` float32 on ``cum_accept``'s device, or None: per row, a survival below which the row
            also stops (within the bounds): ``threshold="auto"``'s goodput rule, lambda_b * marginal_ms(K)
            (:class:`~specdec_ext.policies.goodput.GoodputRule`); -inf for no such stop.
        check: on CUDA, read back whether a row's p_hat is NaN and raise (a host synchronisation; False: such a
            row only stops, as under graph capture; the engine's stop rule passes False, since a stop never
            touches verification).

    Returns:
        ``(p_accept [B] float32, stop [B] bool)``.

    Raises:
        ValueError: shape mismatch (e.g. a head for another hidden size), bad bounds or threshold, neither
            hidden nor features, or a row whose p_hat or running product is NaN/Inf (NaN in hidden,
            features or cum_accept); on CUDA that row gets p_accept = NaN and stop = True, and the error
            is raised when the call may synchronise (not under graph capture or compilation).
        TypeError: unsupported dtypes.
    """
    args = (hidden, features, feature_weight, feature_bias, block_weight, block_bias, out_weight, out_bias,
            cum_accept, candidate_length, k_min, k_max, threshold, stop_below)
    if not HAS_EXTENSION:
        return reference.acceptance_head_step(*args)
    p, stop = torch.ops.specdec_ext.acceptance_head_step(*args)
    if check and p.device.type == "cuda" and not (torch.cuda.is_current_stream_capturing()
                                                   or torch.compiler.is_compiling()):
        if bool(torch.isnan(p).any()):
            raise ValueError(_HEAD_NAN)
    return p, stop


def confidence_features(dist: torch.Tensor, tokens: torch.Tensor, logits: bool) -> torch.Tensor:
    """The draft-confidence features of candidates under the draft's distribution q, fused: one pass for
    the two largest entries, one for the sums (``head/features.py`` explains their use).

    Args:
        dist: ``[B, V]`` float32/bfloat16/float16: logits, with q = softmax(dist) (``logits=True``; ``-inf``
            entries are masked tokens), or probabilities q (``logits=False``).
        tokens: ``[B]`` int32/int64, the candidates y.
        logits: which of the two ``dist`` holds.

    Returns:
        ``[B, 3]`` float32: q(y), q_(1) - q_(2) (top-1 minus top-2 probability), and the entropy
        H(q) = -sum_v q(v) log q(v) in nats (from logits: log Z - sum_v e_v (x_v - m) / Z, with m the
        maximum, e_v = exp(x_v - m), Z = sum_v e_v).

    Raises:
        ValueError: shapes, a token outside [0, V), NaN/+Inf logits or a fully masked row, NaN/Inf/negative
            probabilities (on CUDA when the call may synchronise). TypeError: dtypes.
    """
    if not HAS_EXTENSION:
        return reference.confidence_features(dist, tokens, logits)
    out, code = torch.ops.specdec_ext.confidence_features(dist, tokens, logits)
    _raise_device_codes(code, "confidence_features", logits)
    return out


def argmax_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens: the first index of the maximum along the last dimension, ``torch.argmax(logits, -1)``
    exactly (ties go to the first index, and NaN counts as the maximum, as in torch), without its cost on a CPU:
    torch's CPU argmax walks a row one entry at a time (bfloat16 [4, 8192]: 119 us on a 2-core AMD EPYC), the
    kernel reduces it in two vectorised passes (8 us; ``1bd1639:bench/argmax.py``, README "Greedy tokens on a CPU"). The
    engine's greedy draft steps and plain steps use it, and ``chain_verify_greedy`` the same kernel per row.

    On other devices this is ``torch.argmax`` (one reduction kernel on a GPU), so there is a CPU kernel only.

    Args:
        logits: ``[..., V]`` float32/bfloat16/float16 with V >= 1, any strides.

    Returns:
        ``logits.shape[:-1]`` int64 token ids in [0, V), on logits' device.

    Raises:
        ValueError: no vocabulary dimension (a 0-dim tensor) or V = 0. TypeError: a dtype other than the three.
    """
    if not HAS_EXTENSION or (logits.device.type != "cpu" and not checks._is_fake(logits)):
        return reference.argmax_tokens(logits)  # the checks, then torch.argmax
    return torch.ops.specdec_ext.argmax_tokens(logits)


def graph_chain(anchor: torch.Tensor, pieces: list, flags: list) -> int:
    """One CUDA graph of ``pieces`` (cudaGraph_t handles, as integers: ``torch.cuda.CUDAGraph(keep_graph=True)``'s
    ``raw_cuda_graph()``), the middle ones each under a conditional IF node: ``pieces[0]``, then ``pieces[i]``
    (0 < i < n - 1) where the one-element bool ``flags[i - 1]`` on the GPU holds when its turn comes, then
    ``pieces[-1]`` (``csrc/cuda/graphs.cu``; CUDA 12.4's conditional nodes, set by a one-thread kernel with
    ``cudaGraphSetConditional``). The pieces are cloned; what they point to must outlive the graph. ``anchor``: a
    tensor on the graph's device. Returns the instantiated graph's handle, for :func:`graph_launch` and
    :func:`graph_destroy`.

    Raises ValueError (n < 2 pieces, a flag count other than n - 2, a flag that is not one bool on ``anchor``'s
    device) or RuntimeError (CUDA refused the graph; a build without CUDA has no such op)."""
    return torch.ops.specdec_ext.graph_chain(anchor, [int(p) for p in pieces], list(flags))


def graph_launch(anchor: torch.Tensor, graph: int) -> None:
    """Launch a :func:`graph_chain` graph on the current stream of ``anchor``'s device."""
    torch.ops.specdec_ext.graph_launch(anchor, graph)


def graph_destroy(anchor: torch.Tensor, graph: int) -> None:
    """Free a :func:`graph_chain` graph (not the pieces it was made from)."""
    torch.ops.specdec_ext.graph_destroy(anchor, graph)


if HAS_EXTENSION:

    @torch.library.register_fake("specdec_ext::confidence_features")
    def _confidence_features_fake(dist, tokens, logits):
        B, _ = checks.confidence_shapes(dist, tokens, logits)
        return dist.new_empty((B, 3), dtype=torch.float32), dist.new_empty((B,), dtype=torch.int64)

    @torch.library.register_fake("specdec_ext::advance_rows")
    def _advance_rows_fake(last, prev, room, seed_offsets, emitted, accepted, rows):
        checks.advance_shapes(last, prev, room, seed_offsets, emitted, accepted, rows)  # writes in place: no output

    @torch.library.register_fake("specdec_ext::philox_uniforms")
    def _philox_uniforms_fake(seed_offsets, slots, first_slot=0):
        B = checks.philox_shapes(seed_offsets, slots, first_slot)
        return seed_offsets.new_empty((B, slots), dtype=torch.float32)

    @torch.library.register_fake("specdec_ext::argmax_tokens")
    def _argmax_tokens_fake(logits):
        return logits.new_empty(checks.argmax_shapes(logits), dtype=torch.int64)

    @torch.library.register_fake("specdec_ext::chain_verify")
    def _chain_verify_fake(draft_token_ids, draft_probs, target_probs, num_draft_tokens=None, uniforms=None,
                           philox_seed_offset=None, validate=False):
        B, K, _ = checks.verify_shapes(draft_token_ids, draft_probs, target_probs, num_draft_tokens, None, uniforms,
                                       philox_seed_offset, logits=False)
        return (target_probs.new_empty((B, K + 1), dtype=torch.int64), target_probs.new_empty((B,), dtype=torch.int64))

    @torch.library.register_fake("specdec_ext::chain_verify_logits")
    def _chain_verify_logits_fake(draft_token_ids, draft_logits, target_logits, temperature, num_draft_tokens=None,
                                  uniforms=None, philox_seed_offset=None, validate=False):
        B, K, _ = checks.verify_shapes(draft_token_ids, draft_logits, target_logits, num_draft_tokens, temperature,
                                       uniforms, philox_seed_offset, logits=True)
        return (target_logits.new_empty((B, K + 1), dtype=torch.int64),
                target_logits.new_empty((B,), dtype=torch.int64))

    @torch.library.register_fake("specdec_ext::chain_verify_greedy")
    def _chain_verify_greedy_fake(draft_token_ids, target_logits, num_draft_tokens=None):
        B, K, _ = checks.greedy_shapes(draft_token_ids, target_logits, num_draft_tokens)
        return (target_logits.new_empty((B, K + 1), dtype=torch.int64),
                target_logits.new_empty((B,), dtype=torch.int64))

    @torch.library.register_fake("specdec_ext::residual_sample")
    def _residual_sample_fake(target_probs, draft_probs, uniforms=None, philox_seed_offset=None):
        B, _ = checks.residual_shapes(target_probs, draft_probs, uniforms, philox_seed_offset)
        return target_probs.new_empty((B,), dtype=torch.int64)

    @torch.library.register_fake("specdec_ext::acceptance_head_step")
    def _acceptance_head_step_fake(hidden, features, feature_weight, feature_bias, block_weight, block_bias, out_weight,
                                   out_bias, cum_accept, candidate_length, k_min, k_max, threshold, stop_below=None):
        B, _ = checks.head_shapes(hidden, features, feature_weight, feature_bias, block_weight, block_bias, out_weight,
                                  out_bias, cum_accept, candidate_length, k_min, k_max, threshold, stop_below)
        return out_weight.new_empty((B,), dtype=torch.float32), out_weight.new_empty((B,), dtype=torch.bool)
