"""The steps of one round of speculative decoding, as fixed-shape functions with one read-back to the host
(Leviathan et al. 2023, Alg. 1; SpecDec++ Alg. 1; docs/design.md, The engine); :mod:`~specdec_ext.engine.round`'s
``StepRunner`` runs them eagerly, compiled or from CUDA graphs.

1. **Draft steps** (:func:`draft_step`, up to the plan's cap K): the draft's forward (the first feeds each row's last
   two tokens, ``prev`` and ``last``; each later one the candidate just drafted), each row's processed distribution
   (``sampling.mask_logits``), its candidate (argmax, or a draw from its own Philox stream) and the policy's stop rule,
   on the device.
2. **The verify step** (:func:`verify_step`): the target over ``[last, c_1 .. c_K]``, ``ops.chain_verify_logits`` (or
   ``chain_verify_greedy``), and both caches' roll-back by subtraction.
3. **One read-back** (:func:`pack`, :func:`unpack`): the emitted tokens, accepted and drafted counts (and what the
   rule asks) in one tensor.

With ``early_exit`` the round also reads, after each draft step of a rule that can stop rows (or after the steps
``early_exit`` lists: tiers), whether any row still drafts, and the budget's verified depth; without it the draft
runs to the cap: the form a CUDA graph replays (:func:`exit_steps`). Row b's uniforms come from its own stream
(``ops.philox_uniforms``, ``seeds[b]``: its seed and round count), draft step k from counter slot k - 1 and the
verification from slots :data:`VERIFY_SLOT` + i.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from .. import ops
from ..policies.base import DraftStep
from .sampling import RowSampling, draw_tokens, mask_logits, row_probs

VERIFY_SLOT = 1 << 30  # the Philox counter slot of a round's first verification uniform (draft steps use 0, 1, ...)


@dataclass
class RoundInputs:
    """A round's per-row inputs (the scheduler builds them from its host state each round).

    last: ``[B]`` int64, each row's last token (the target has read everything before it), on the target's device;
    prev: ``[B]`` int64, the token before it (the draft has read everything before that), on the draft's device;
    room: ``[B]`` int64, the most candidates each row may draft (its own cap, its tokens left minus one; 0 for a
    row whose context is one token); extra: ``[B]`` int64 or None, positions the draft drops beyond a round's (1 for
    rows whose first draft feed was a placeholder); sampling: the rows' :class:`RowSampling` on the target's device
    (``draft_sampling`` on the draft's); seeds: ``[B, 2]`` int64, each row's Philox seed and offset; target_width /
    draft_width: the longest live row of each cache, in columns (host ints); processor: the call's host logits
    processor hooks, or None; target_start / draft_start: the length every live row has in that cache where they
    share one (eager forwards then write and mask by slices), else None."""

    last: torch.Tensor
    prev: torch.Tensor
    room: torch.Tensor
    extra: Optional[torch.Tensor]
    sampling: RowSampling
    draft_sampling: RowSampling
    seeds: torch.Tensor
    target_width: int
    draft_width: int
    processor: Optional[object] = None
    target_start: Optional[int] = None
    draft_start: Optional[int] = None


@dataclass
class RoundOutput:
    """What a round returns to the host: per row the tokens it emitted (accepted candidates, then the residual or
    bonus token), the candidates it verified and accepted; steps: draft forwards run; verified: the verification's
    width; readback: the stop rule's values; the ms of the draft phase and of the verification (host clock; a
    verification replayed in one graph with the draft steps before it counts that graph's time as its own); counted:
    (draft calls, draft s, target calls, target s) of the forwards the runner ran itself, captured or replayed, which
    the backends do not count (their eager forwards count themselves)."""

    tokens: list
    drafted: list
    accepted: list
    steps: int
    verified: int
    readback: list
    draft_ms: float
    verify_ms: float
    counted: tuple = (0, 0.0, 0, 0.0)


def draft_step(forward: Callable, tokens: torch.Tensor, seeds: torch.Tensor, k: int, sampling: RowSampling, rule,
               drafting: torch.Tensor, room: torch.Tensor, n: torch.Tensor, processor=None, cands: Optional[list] = None):
    """Draft step ``k`` (1-based): the draft's forward over ``tokens`` ``[B, t]`` (``forward(tokens)`` -> logits,
    hidden), each row's candidate from its processed distribution (a uniform from its Philox stream ``seeds[b]``,
    counter slot k - 1), and the stop ``rule``'s decision. ``drafting`` ``[B]`` bool: rows still drafting; ``room``
    ``[B]``: each row's cap; ``n`` ``[B]`` int64: candidates each row has drafted. Returns ``(candidate [B],
    processed logits [B, V] float32, n, drafting)`` after this step. Fixed shapes, no host synchronisation (a device
    ``rule``; a ``processor`` is host work)."""
    logits, hidden = forward(tokens)
    last = logits[:, -1]
    if processor is not None:
        last = processor.draft(last, cands)
    masked = mask_logits(last, sampling)
    need_probs = not sampling.greedy or (rule is not None and rule.needs_probs)
    probs = row_probs(masked, sampling) if need_probs else None
    u = ops.philox_uniforms(seeds, 1, k - 1)[:, 0] if not sampling.greedy else None
    cand = draw_tokens(masked, sampling, u, probs)
    n = torch.where(drafting, torch.full_like(n, k), n)
    stop = room <= k
    if rule is not None:
        info = DraftStep(k, cand.shape[0], probs.gather(-1, cand.view(-1, 1)).squeeze(-1) if probs is not None else None,
                         probs, hidden[:, -1] if hidden is not None and rule.needs_hidden else None, cand, masked,
                         drafting, drafting & ~stop)
        stop = stop | rule.step(info)
    return cand, masked, n, drafting & ~stop


def verify_step(forward: Callable, last: torch.Tensor, cands: torch.Tensor, draft_logits: Optional[torch.Tensor],
                sampling: RowSampling, n: torch.Tensor, seeds: torch.Tensor, roll_target: Optional[Callable],
                roll_draft: Optional[Callable], steps: int, extra: Optional[torch.Tensor], processor=None,
                ran: Optional[torch.Tensor] = None):
    """The target scores ``[last, cands]`` ``[B, K + 1]`` (``forward(tokens, keep)`` -> logits), one fused op accepts a
    prefix of each row's ``n[b]`` candidates and emits the residual or bonus token (uniforms from each row's Philox
    stream ``seeds[b]``, counter slots :data:`VERIFY_SLOT` + i); K = 0 is a plain step (a draw from the target's
    distribution). Then both caches roll back: the target keeps ``last`` and the accepted candidates
    (``roll_target(K - accepted)``), the draft, which ran ``steps`` steps, the same context but its last token
    (``roll_draft(steps - accepted + extra)``; ``ran``, a device count, in place of ``steps`` where the device decided
    how many draft steps ran). Returns ``(out [B, K + 1] int64, num_accepted [B] int64)`` (None for
    a plain step); a negative count is a kernel's error code for that row. Fixed shapes, no host synchronisation (a
    ``processor`` is host work)."""
    B, K = cands.shape
    logits = forward(torch.cat([last.view(B, 1), cands], 1), K + 1)
    if processor is not None:
        logits = processor.target(logits, cands)
    u = ops.philox_uniforms(seeds, K + 1, VERIFY_SLOT) if not sampling.greedy else None  # row b's stream
    if K == 0:  # the target's next token, as plain decoding (the bonus token's uniform)
        out = draw_tokens(mask_logits(logits[:, 0], sampling), sampling, u[:, 0] if u is not None else None).view(B, 1)
        if not steps:  # a plain step: nothing drafted, nothing to accept
            return out, None
        acc = torch.zeros(B, dtype=torch.int64, device=out.device)  # drafted, none verified
    elif sampling.greedy:
        out, acc = ops.chain_verify_greedy(cands, logits, n, check=False)  # codes read with the round's tokens
    else:
        out, acc = ops.chain_verify_logits(cands, draft_logits, mask_logits(logits, sampling), sampling.temperature, n,
                                           uniforms=u, check=False)
    kept = acc.clamp_min(0)
    if K:
        roll_target(K - kept)
    if steps:
        back = (steps if ran is None else ran) - kept
        roll_draft(back if extra is None else back + extra.to(back.device))
    return out, acc


def exit_steps(early_exit) -> Union[bool, frozenset]:
    """``early_exit`` as :meth:`StepRunner.run` takes it: True (a read after every draft step), False (none), the
    frozenset of steps after which the round reads (a tuple or list of increasing integers >= 1), or ``"device"``
    (the GPU reads the stop flags itself: in a captured round each draft step after the first is a conditional node
    that runs while some row drafts; a round that is not captured reads after every step).

    Raises ValueError for anything else (naming ``early_exit`` and what it takes)."""
    if isinstance(early_exit, bool) or early_exit == "device":
        return early_exit
    steps = list(early_exit) if isinstance(early_exit, (tuple, list)) else None
    if not steps or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in steps) or \
            any(a >= b for a, b in zip(steps, steps[1:])):
        raise ValueError(f"early_exit: expected True, False, 'device' or increasing draft steps >= 1 after which the "
                         f"round reads its stop flags, e.g. (1, 3, 7); got {early_exit!r}")
    return frozenset(steps)


def reads_after(early_exit: Union[bool, frozenset, str], k: int) -> bool:
    """Whether a round whose steps are not decided on the device reads its stop flags after draft step ``k``
    (``early_exit`` as :func:`exit_steps` gives it; ``"device"``: after every step)."""
    return early_exit is True or early_exit == "device" or (isinstance(early_exit, frozenset) and k in early_exit)


def pack(out: torch.Tensor, acc: torch.Tensor, n: torch.Tensor, asked=()) -> torch.Tensor:
    """The round's read-back in one tensor: each row's emitted tokens ``out`` ``[P, W]``, its accepted count ``acc``
    ``[P]`` and the candidates it drafted ``n`` ``[P]``, as ``[P, W + 2]`` int64; with a stop rule's ``asked``
    tensors (rows first, or one-dimensional), all of it flattened to float64 and those tensors' values after it."""
    packed = torch.cat([out, acc.view(-1, 1), n.view(-1, 1).to(out.device)], 1)
    if not asked:
        return packed
    return torch.cat([packed.flatten().double()] + [t.flatten().double().to(out.device) for t in asked])


def unpack(packed: torch.Tensor, B: int, W: int, asked: list) -> tuple:
    """``packed`` (:func:`pack`) read to the host: the first ``B`` rows' ``W`` tokens, accepted and drafted counts
    (a list of ``W + 2`` ints per row), and each ``asked`` tensor's values (a list per row of a two-dimensional
    tensor's first ``B`` rows, else all of its values)."""
    if not asked:
        return packed[:B].tolist(), []
    flat = packed.tolist()  # the round's one read
    at = len(flat) - sum(t.numel() for t in asked)  # P rows of W + 2 ints, then the asked tensors
    rows = [[int(x) for x in flat[b * (W + 2): (b + 1) * (W + 2)]] for b in range(B)]
    readback = []
    for t in asked:
        vals = flat[at: at + t.numel()]
        at += t.numel()
        cols = t.shape[-1] if t.dim() > 1 else 0
        readback.append([vals[i * cols: (i + 1) * cols] for i in range(B)] if cols else vals)
    return rows, readback
