"""One round of speculative decoding as fixed-shape steps, with one read-back to the host (Leviathan et al. 2023,
Alg. 1; SpecDec++ Alg. 1; docs/design.md, The engine).

1. **Draft steps** (:func:`draft_step`, up to the plan's cap K): the draft's forward (the first feeds each row's last
   two tokens, ``prev`` and ``last``; each later one the candidate just drafted), each row's processed distribution
   (``sampling.mask_logits``), its candidate (argmax, or a draw from its own Philox stream) and the policy's stop rule,
   on the device.
2. **The verify step** (:func:`verify_step`): the target over ``[last, c_1 .. c_K]``, ``ops.chain_verify_logits`` (or
   ``chain_verify_greedy``), and both caches' roll-back by subtraction.
3. **One read-back**: the emitted tokens, accepted and drafted counts (and what the rule asks) in one tensor.

With ``early_exit`` the round also reads, after each draft step of a rule that can stop rows (or after the steps
``early_exit`` lists: tiers), whether any row still drafts, and the budget's verified depth; without it the draft
runs to the cap: the form a CUDA graph replays. Row b's
uniforms come from its own stream (``ops.philox_uniforms``, ``seeds[b]``: its seed and round count), draft step k
from counter slot k - 1 and the verification from slots :data:`VERIFY_SLOT` + i.
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from .. import errors, ops
from ..policies.base import DraftStep, RoundPlan
from .graphs import StepGraphs, when
from .runner import sdpa_backends
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
    verification replayed in one graph with the draft steps before it counts that graph's time as its own)."""

    tokens: list
    drafted: list
    accepted: list
    steps: int
    verified: int
    readback: list
    draft_ms: float
    verify_ms: float


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
        out, acc = ops.chain_verify_greedy(cands, logits, n)
    else:
        out, acc = ops.chain_verify_logits(cands, draft_logits, mask_logits(logits, sampling), sampling.temperature, n,
                                           uniforms=u)
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


BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # batch buckets of compiled or captured steps (rows padded to the bucket)
_CACHED = ("t_temperature", "t_top_k", "t_top_p", "d_temperature", "d_top_k", "d_top_p")  # kept by the scheduler
GRAPHS = 4096  # compiled steps' graphs kept: one per bucket, step, candidate count and sampling mode


class StepRunner:
    """Runs rounds of the step functions (module docstring) for the scheduler.

    Eagerly (the default, ``buckets=None``): the live rows as they are, each forward reading the columns the widest
    row needs. With ``buckets`` (``BUCKETS``; every model lean): rows padded to the smallest bucket that holds them
    (padding rows: room 0, greedy, empty caches), the round's per-row inputs (last tokens, caps, sampling settings,
    Philox seeds and offsets) copied into the bucket's persistent tensors, each forward reading the whole cache, so
    each step has one shape per (bucket, step) and a graph can be replayed for it.

    - ``compile=True`` alone compiles each step with ``torch.compile(fullgraph=True)`` (``backend`` and ``mode`` its
      own; ``mode="reduce-overhead"`` on CUDA replays torch's CUDA graphs), the CPU's proxy for CUDA-graph capture;
      the compiled steps are kept from round to round and call to call.
    - ``cuda_graphs=True`` captures the steps on CUDA (``engine/graphs.py``): the verify step whole, a draft step
      whole without a stop rule or with one that can be captured (``StopRule.capture_key``), else its forward alone;
      rounds with a ``logits_processor``, and rounds off CUDA, run eagerly (``cuda_graphs="emulate"``: recorded
      steps on any device, the tests' check of the graphs' buffers). With ``compile=True`` the models' forwards are
      compiled before capture (:meth:`_forward`), so the graphs replay fused kernels; the rest of each step, and
      rounds that are not captured, run eagerly.

    Raises ValueError for a batch larger than the largest bucket (with ``cuda_graphs``, such a batch runs eager steps
    over its rows), ``cuda_graphs`` without ``buckets``, or ``cuda_graphs`` and ``compile`` with a ``mode`` that
    captures torch's own CUDA graphs."""

    def __init__(self, buckets: Optional[tuple] = None, compile: bool = False, backend: str = "inductor",
                 mode: Optional[str] = None, cuda_graphs: Union[bool, str] = False):
        self.buckets = tuple(sorted(buckets)) if buckets else None
        if cuda_graphs and self.buckets is None:
            raise ValueError("cuda_graphs: CUDA graphs replay bucketed steps (buckets=...)")
        if cuda_graphs and compile and mode in ("reduce-overhead", "max-autotune"):
            raise ValueError(f"mode: the steps are captured in this runner's CUDA graphs, not torch.compile's (a mode "
                             f"without cudagraphs, e.g. None or 'max-autotune-no-cudagraphs'), got {mode!r}")
        self.compile, self.backend, self.mode = bool(compile), backend, mode
        self.graphs = StepGraphs(emulate=cuda_graphs == "emulate") if cuda_graphs else None
        self._steps: dict = {}
        self._buffers: dict = {}  # bucket -> its persistent input tensors by name

    def _persistent(self, inp: RoundInputs, P: int) -> RoundInputs:
        """``inp`` copied into bucket P's persistent input tensors (allocated at the bucket's first round), so the
        steps of every round of a bucket read the same tensors, as a replayed graph must. Padding rows (B < P) are
        filled in place: token 0, room 0 (they never draft), greedy, stream 0. A tensor copied in the last round and
        passed again (the scheduler's cached sampling settings) is not copied again."""
        kept = self._buffers.setdefault(P, {})
        B = inp.last.shape[0]

        def keep(name: str, t: Optional[torch.Tensor], pad=0) -> Optional[torch.Tensor]:
            if t is None:
                return None
            buf, src = kept.get(name, (None, None))
            if src is t:  # the same tensor as last round's (the kept source pins it: never another one's address)
                return buf
            if buf is not None and t.data_ptr() == buf.data_ptr() and t.shape[1:] == buf.shape[1:] and \
                    t.dtype == buf.dtype:  # the buffer's first rows, padding included (row_inputs wrote it)
                return buf
            shape = (P,) + tuple(t.shape[1:])
            if buf is None or buf.shape != shape or buf.dtype != t.dtype or buf.device != t.device:
                buf = t.new_empty(shape)
            buf[:B].copy_(t)
            if B < P:
                buf[B:].fill_(pad)
            kept[name] = (buf, t if name in _CACHED else None)
            return buf

        def rows(prefix: str, s: RowSampling) -> RowSampling:
            return RowSampling(keep(prefix + "temperature", s.temperature), keep(prefix + "top_k", s.top_k, s.vocab),
                               keep(prefix + "top_p", s.top_p, 1.0), s.greedy, s.masks, s.vocab)

        return RoundInputs(keep("last", inp.last), keep("prev", inp.prev), keep("room", inp.room),
                           keep("extra", inp.extra), rows("t_", inp.sampling), rows("d_", inp.draft_sampling),
                           keep("seeds", inp.seeds), inp.target_width, inp.draft_width, inp.processor)  # no starts

    def row_inputs(self, last: list, prev: Optional[list], room: Optional[list], single: Optional[list],
                   seeds: Optional[list], tdev: torch.device, ddev: torch.device) -> tuple:
        """A round's per-row integers from the scheduler's host lists, on the devices in one copy per device: ``last``
        each row's last token; when the round drafts, ``prev`` the token before it, ``room`` its cap and ``single``
        whether its context is one token (``extra`` 1 for it); when it draws, ``seeds`` each row's (Philox seed, round
        count). With buckets they are written into the bucket's persistent row buffer (padding rows 0: token 0, room
        0, stream 0), through a pinned host copy on a GPU (no wait for the device), so the round's steps and graphs
        read them where they are (:meth:`_persistent` copies nothing for them); else one tensor of the live rows.
        Returns ``(last [B], prev [B], room [B], extra [B], seeds [B, 2])`` int64, each None where not given (``extra``
        None where no row is single)."""
        B = len(last)
        P = self.bucket(B)
        drafting, draws = prev is not None, seeds is not None
        if self.buckets is None:
            host = list(last) + (list(prev) + list(room) + [int(x) for x in single] if drafting else [])
            host += [int(x) for pair in seeds for x in pair] if draws else []
            flat = torch.tensor(host, dtype=torch.int64).to(tdev)
            at = {"last": 0, "prev": B, "room": 2 * B, "extra": 3 * B, "seeds": len(host) - 2 * B}
            dflat = flat if ddev == tdev or not drafting else flat.to(ddev)
        else:
            kept = self._buffers.setdefault(P, {})
            if kept.get("rows_device") != tdev:  # [last | prev | room | extra | seeds] x P
                buf = torch.zeros(6 * P, dtype=torch.int64, device=tdev)
                host = buf if tdev.type == "cpu" else torch.zeros(6 * P, dtype=torch.int64, pin_memory=True)
                kept["rows"] = (buf, host, host.numpy())  # numpy's view: the host list written without dispatch
                kept["rows_device"] = tdev
                for name, (start, shape) in {"last": (0, (P,)), "prev": (P, (P,)), "room": (2 * P, (P,)),
                                             "extra": (3 * P, (P,)), "seeds": (4 * P, (P, 2))}.items():
                    view = buf[start: start + 2 * P if name == "seeds" else start + P].view(shape)
                    kept[name] = (view if name in ("last", "seeds") or ddev == tdev else None, None)
            flat, host, view = kept["rows"]
            pad = [0] * (P - B)
            values = list(last) + pad
            values += list(prev) + pad + list(room) + pad + [int(x) for x in single] + pad if drafting else [0] * 3 * P
            values += [int(x) for pair in seeds for x in pair] + pad + pad if draws else [0] * 2 * P
            view[:] = values
            if host is not flat:  # pinned: the copy is ordered before the round's steps on the stream
                flat.copy_(host, non_blocking=True)
            at = {"last": 0, "prev": P, "room": 2 * P, "extra": 3 * P, "seeds": 4 * P}
            dflat = flat if ddev == tdev or not drafting else flat.to(ddev)
        out_last = flat[:B]
        out_prev = dflat[at["prev"]: at["prev"] + B] if drafting else None
        out_room = dflat[at["room"]: at["room"] + B] if drafting else None
        extra = dflat[at["extra"]: at["extra"] + B] if drafting and any(single) else None
        out_seeds = flat[at["seeds"]: at["seeds"] + 2 * B].view(B, 2) if draws else None
        return out_last, out_prev, out_room, extra, out_seeds

    def bucket(self, B: int) -> int:
        """The rows a round of B live rows runs: B, or the smallest bucket that holds them."""
        if self.buckets is None:
            return B
        for size in self.buckets:
            if size >= B:
                return size
        if self.graphs is not None:  # beyond the buckets: eager steps over the live rows, no graph
            return B
        raise ValueError(f"batch_size: {B} rows are more than the largest batch bucket {self.buckets[-1]}")

    def _step(self, fn: Callable) -> Callable:
        """``fn`` as the round calls it: itself, or compiled with one graph per shape (``dynamic=False``: a graph per
        bucket and step, as captured graphs are; the recompile limit raised to hold them all)."""
        if not self.compile or self.graphs is not None:  # with CUDA graphs only the forwards compile (_forward)
            return fn
        if fn not in self._steps:
            compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=self.backend, mode=self.mode)

            def call(*args, **kwargs):
                with torch._dynamo.config.patch(recompile_limit=GRAPHS, accumulated_recompile_limit=GRAPHS):
                    return compiled(*args, **kwargs)

            self._steps[fn] = call
        return self._steps[fn]

    def run(self, draft, target, inp: RoundInputs, plan: RoundPlan,
            early_exit: Union[bool, frozenset, str]) -> RoundOutput:
        """One round of the live rows (module docstring) by backends ``draft`` (None for a plain step) and
        ``target``; the draft runs at most ``plan.cap`` steps (0: a plain step). ``early_exit``: True, False, the
        steps after which the round reads whether any row still drafts, or ``"device"`` (:func:`exit_steps`).

        Raises ValueError when the verification reports an invalid row (a NaN or +Inf logit, or a fully masked row)."""
        B = inp.last.shape[0]
        P = self.bucket(B)
        if self.buckets is not None:  # the bucket's persistent inputs, padding rows filled (SGLang's replay_prepare)
            inp = self._persistent(inp, P)
            for b in (draft, target):
                if b is not None and P > B:
                    b.cache.lengths[B:P] = 0
        wide = self.buckets is not None  # fixed shapes: every forward reads the whole cache
        graphed = (self.graphs is not None and P in self.buckets and inp.processor is None
                   and (inp.last.device.type == "cuda" or self.graphs.emulate) and getattr(target, "lean", False)
                   and (draft is None or (getattr(draft, "lean", False) and draft.device == target.device)))
        if graphed:
            self.graphs.check((draft, target))
        direct = (self.compile and self.graphs is None) or graphed  # steps call uncounted forwards: counted here
        cap = plan.cap
        t0 = time.perf_counter()
        tdev = inp.last.device
        cands = inp.last.new_empty(P, 0) if cap == 0 else None  # a plain step verifies no candidates
        n = nd = None
        draft_logits, steps, rule, verified = None, 0, plan.rule, None
        fused = t_fused = None  # a verification replayed in one graph with the draft steps before it: (out, acc,
        # packed), and the host clock when that graph began
        if cap > 0:
            ddev = inp.prev.device
            room = inp.room if plan.row_caps is None else torch.minimum(
                inp.room, _pad_rows(torch.tensor(list(plan.row_caps), dtype=torch.int64), P).to(ddev))
            seeds = inp.seeds.to(ddev)
            if rule is not None:
                rule.begin(P, ddev)
            # a draft step is replayed whole without a rule, or with a rule that can be captured (StopRule.capture_key)
            rule_key = rule.capture_key() if graphed and rule is not None and not rule.host else None
            out_c, out_l = [], []
            if graphed and (rule is None or rule_key is not None):
                nd, steps, fused, t_fused = self._graphed_spans(draft, target, P, cap, inp, room, seeds, rule,
                                                                rule_key, early_exit, out_c, out_l)
            else:
                nd, steps = self._steps_one_by_one(draft, P, cap, inp, room, seeds, rule, early_exit, direct, graphed,
                                                   out_c, out_l)
            n = nd.to(tdev)
            if fused is None:
                cands = torch.stack(out_c, 1).to(tdev)
                if not inp.sampling.greedy:
                    draft_logits = torch.stack(out_l, 1).to(tdev)
                if rule is not None:
                    trimmed = rule.depth(nd, steps)
                    if trimmed is not None:
                        n = trimmed.to(tdev)
                        if early_exit:  # the budget verifies fewer slots than were drafted: a narrower forward
                            verified = int(n.max())
                            cands = cands[:, :verified]
                            draft_logits = draft_logits[:, :verified] if draft_logits is not None else None
        verified = steps if verified is None else verified
        t1 = time.perf_counter() if fused is None else t_fused  # a fused span's time is the verification's
        width = None if wide else inp.target_width + verified + 1
        at = None if wide else inp.target_start
        forward = target.step if direct else target.forward
        asked = rule.readback() if rule is not None and steps else []
        if fused is not None:
            out, acc, packed = fused
        elif graphed:
            out, acc, packed = self._graphed_verify(draft if steps else None, target, P, cands, draft_logits, inp, n,
                                                    steps, asked)
        else:
            out, acc = self._step(verify_step)(
                lambda t, keep: forward(t, keep, width, None, at)[0], inp.last, cands, draft_logits, inp.sampling, n,
                inp.seeds, target.rollback, draft.rollback if steps else None, steps, inp.extra, inp.processor)
            packed = None if acc is None else _pack(out, acc, n, asked)
        if direct and fused is None:
            target.calls += 1
            target.seconds += time.perf_counter() - t1
        if not steps:  # a plain step: one token per row, the whole read-back
            toks = out[:B, 0].tolist()
            t2 = time.perf_counter()
            return RoundOutput([[t] for t in toks], [0] * B, [0] * B, 0, 0, [], 0.0, (t2 - t1) * 1e3)
        rows, readback = _unpack(packed, B, verified + 1, asked)
        t2 = time.perf_counter()
        W = verified + 1
        accepted = [r[W] for r in rows]
        drafted = [r[W + 1] for r in rows]
        if fused is not None and early_exit == "device" and rule is not None:  # the draft steps the GPU ran
            steps = max(drafted)
            draft.calls += steps
        bad = min(accepted)
        if bad < 0:
            raise ValueError(f"verification: {errors.message(bad, True)}")
        emitted = [rows[b][: accepted[b] + 1] for b in range(B)]
        return RoundOutput(emitted, drafted, accepted, steps, verified, readback, (t1 - t0) * 1e3 if steps else 0.0,
                           (t2 - t1) * 1e3)

    def _steps_one_by_one(self, draft, P: int, cap: int, inp: RoundInputs, room, seeds, rule, early_exit, direct: bool,
                          graphed: bool, out_c: list, out_l: list):
        """The draft steps of a round one call each (eager, compiled, or with the forward alone replayed under a stop
        rule that cannot be captured), reading after the steps ``early_exit`` names whether any row still drafts.
        Appends each step's candidates and processed logits to ``out_c`` / ``out_l``; returns (candidates drafted
        per row ``[P]``, steps run)."""
        ddev = inp.prev.device
        wide = self.buckets is not None
        tokens = torch.stack([inp.prev, inp.last.to(ddev)], 1)
        drafting = room > 0
        nd = torch.zeros(P, dtype=torch.int64, device=ddev)
        step = self._step(draft_step)
        forward = self._graphed_forward(draft, P) if graphed else draft.step if direct else draft.forward
        steps = 0
        for k in range(1, cap + 1):
            width = None if wide else inp.draft_width + 1 + k
            at = None if wide or inp.draft_start is None else inp.draft_start + (k if k > 1 else 0)
            t_step = time.perf_counter()
            cand, masked, nd, drafting = step(lambda t, w=width, a=at: forward(t, 1, w, None, a), tokens, seeds, k,
                                              inp.draft_sampling, rule, drafting, room, nd, inp.processor, out_c)
            if direct:  # the compiled or captured step's forward is counted here
                draft.calls += 1
                draft.seconds += time.perf_counter() - t_step
            out_c.append(cand)
            out_l.append(masked)
            steps = k
            if k == cap or (rule is not None and _reads(early_exit, k) and not bool(drafting.any())):
                break
            tokens = cand.view(P, 1)
        return nd, steps

    def _graphed_spans(self, draft, target, P: int, cap: int, inp: RoundInputs, room, seeds, rule, rule_key,
                       early_exit, out_c: list, out_l: list):
        """A round's draft steps with no stop rule or a capturable one, replayed as spans: the steps between two
        reads of the stop flags (``early_exit``; a round without a rule reads none) each one graph, and the span
        that reaches the cap one graph with the verification after it (gpt-fast's and SGLang's whole-round graph
        where nothing is read between steps: fixed K, or drafting to the cap). With ``early_exit="device"`` and a stop
        rule, one span of every step to the cap, each step after the first a conditional node run while some row
        drafts (:func:`~specdec_ext.engine.graphs.when`): nothing is read until the round's end, and the steps
        after every row stopped cost the GPU nothing. Appends each step's candidates and processed logits to
        ``out_c`` / ``out_l``; returns (candidates drafted per row ``[P]``, steps run (the cap where the device
        decided), the fused verification's ``(out, acc, packed)`` and the host clock when its graph began, or None
        and None when drafting stopped before the cap)."""
        on_device = early_exit == "device" and rule is not None  # the steps after the first decided by the GPU

        def span(first: int, last: int, state: Optional[tuple], verify: bool) -> tuple:
            t_span = time.perf_counter()
            outs = self._graphed_span(draft, target if verify else None, P, first, last, inp, room, seeds, rule,
                                      rule_key, state, out_c, out_l, on_device)
            n_steps = last - first + 1
            out_c.extend(outs[:n_steps])
            out_l.extend(outs[n_steps: 2 * n_steps])
            draft.calls += 0 if on_device else n_steps  # counted from the read-back (StepRunner.run)
            if verify:  # the span's time is the verification's (its draft steps are not timed apart)
                target.calls += 1
                target.seconds += time.perf_counter() - t_span
            else:
                draft.seconds += time.perf_counter() - t_span
            return outs[2 * n_steps:]

        first, state = 1, None
        for last in [k for k in range(1, cap) if rule is not None and not on_device and _reads(early_exit, k)]:
            nd, drafting = span(first, last, state, False)
            if not bool(drafting.any()):
                return nd, last, None, None
            first, state = last + 1, (out_c[-1].view(P, 1), drafting, nd)
        t_verify = time.perf_counter()
        nd, _, *fused = span(first, cap, state, True)
        return nd, cap, tuple(fused), t_verify

    def _forward(self, backend) -> Callable:
        """``backend.step`` as the captured steps call it (``step(tokens, keep)``); with ``compile``, its lean
        model's forward compiled (``torch.compile(fullgraph=True)``, shapes made dynamic at their first change: a
        few compilations per model, not one per step) before it is captured, so a graph replays fused kernels."""
        if not self.compile:
            return backend.step
        entry = self._steps.get(("forward", id(backend)))
        if entry is None or entry[0] is not backend:
            # a code object of its own per model: torch.compile keeps its graphs and its record of which sizes
            # changed per code object, so the draft's forward would otherwise make the target's head counts dynamic
            fn = type(backend.lean_model).forward
            own = types.FunctionType(fn.__code__.replace(co_name=f"{backend.lean_model.name}_forward"),
                                     fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
            compiled = torch.compile(types.MethodType(own, backend.lean_model), fullgraph=True, backend=self.backend,
                                     mode=self.mode)

            def step(tokens, keep=1):
                with torch._dynamo.config.patch(recompile_limit=GRAPHS, accumulated_recompile_limit=GRAPHS):
                    return backend.map.logits(compiled(backend.cache, backend.map.tokens(tokens), None, keep))

            entry = self._steps[("forward", id(backend))] = (backend, step)
        return entry[1]

    def _graphed_forward(self, backend, P: int) -> Callable:
        """``backend``'s forward for the draft steps of a stop rule (``forward(tokens, keep, ...)`` as the eager
        steps call it), replayed from a graph per (bucket, tokens); its outputs copied out of the graph's buffers."""
        def forward(tokens, keep=1, *_):
            def fn(t):  # called at capture only
                return _attending(backend, self._forward(backend), t, keep)

            key = ("forward", id(backend), P, tokens.shape[1], keep)
            logits, hidden = self.graphs.replay(key, fn, [tokens], [backend.cache.lengths])
            return logits.clone(), hidden.clone()

        return forward

    def _graphed_span(self, draft, target, P: int, first: int, last: int, inp: RoundInputs, room, seeds, rule,
                      rule_key, state: Optional[tuple], out_c: list, out_l: list, on_device: bool = False) -> tuple:
        """Draft steps ``first`` .. ``last``, with no stop rule or a capturable one (``rule_key``), replayed as one graph
        per (bucket, span, sampling mode, rule); with ``target``, the verification of the round's candidates too.
        ``state``: (the last candidate ``[P, 1]``, rows drafting, candidates drafted) after step ``first - 1``, None
        for the round's first span (which reads ``prev`` and ``last``); ``out_c`` / ``out_l``: the candidates and
        processed logits of the steps before ``first``. ``on_device``: each step after ``first`` runs only while some
        row drafts (a conditional node), its candidates 0 and logits 0 where it did not, and the draft's roll-back
        counts the steps that ran (the most candidates a row drafted). Returns the span's candidates, then its
        processed logits,
        then (candidates drafted ``[P]``, rows drafting ``[P]``), then with the verification ``(out, acc, packed)``
        (:func:`_pack`)."""
        ds, ts = inp.draft_sampling, inp.sampling
        asked = rule.readback() if target is not None and rule is not None else []
        before = len(out_c)

        def fn(start_a, start_b, start_c, last_t, seeds, room, d_temperature, d_top_k, d_top_p, *rest):
            rows = RowSampling(d_temperature, d_top_k, d_top_p, ds.greedy, ds.masks, ds.vocab)
            step = self._forward(draft)
            if first == 1:  # the round's first feed: each row's last two tokens
                tokens, drafting = torch.stack([start_a, last_t], 1), room > 0
                n = torch.zeros(P, dtype=torch.int64, device=room.device)
            else:
                tokens, drafting, n = start_a, start_b, start_c
            cands, logits = list(rest[:before]), list(rest[before: 2 * before])
            for k in range(first, last + 1):
                if on_device and k > first:  # written in place where some row still drafts, else left at 0
                    cand, masked = torch.zeros_like(cands[-1]), torch.zeros_like(logits[-1])

                    def body(k=k, tokens=tokens, cand=cand, masked=masked, n=n, drafting=drafting):
                        outs = draft_step(lambda t: _attending(draft, step, t, 1), tokens, seeds, k, rows, rule,
                                          drafting, room, n)
                        for kept, new in zip((cand, masked, n, drafting), outs):
                            kept.copy_(new)

                    when(drafting.any(), body)
                else:
                    cand, masked, n, drafting = draft_step(lambda t: _attending(draft, step, t, 1), tokens, seeds, k,
                                                           rows, rule, drafting, room, n)
                cands.append(cand)
                logits.append(masked)
                tokens = cand.view(P, 1)
            outs = tuple(cands[before:]) + tuple(logits[before:]) + (n, drafting)
            if target is None:
                return outs
            t_temperature, t_top_k, t_top_p, extra = rest[2 * before: 2 * before + 4]
            trows = RowSampling(t_temperature, t_top_k, t_top_p, ts.greedy, ts.masks, ts.vocab)
            out, acc = verify_step(lambda t, keep: _attending(target, self._forward(target), t, keep)[0], last_t,
                                   torch.stack(cands, 1), None if ts.greedy else torch.stack(logits, 1), trows, n,
                                   seeds, target.rollback, draft.rollback, last, extra,
                                   ran=n.max() if on_device else None)
            return outs + (out, acc, _pack(out, acc, n, rest[2 * before + 4:]))

        start = (inp.prev, None, None) if state is None else state
        inputs = list(start) + [inp.last, seeds, room, ds.temperature, ds.top_k, ds.top_p] + out_c + out_l
        written = [draft.cache.lengths] + (rule.written() if rule is not None else [])
        if target is not None:
            inputs += [ts.temperature, ts.top_k, ts.top_p, inp.extra] + asked
            written.append(target.cache.lengths)
        key = ("span", id(draft), id(target), P, first, last, ds.greedy, ds.masks, ts.greedy, ts.masks, rule_key,
               inp.extra is None, len(asked), on_device)
        return self.graphs.replay(key, fn, inputs, written)

    def _graphed_verify(self, draft, target, P: int, cands, draft_logits, inp: RoundInputs, n, steps: int,
                        asked: list):
        """The verify step replayed whole from a graph per (bucket, width, draft steps, sampling mode): its tokens and
        accepted counts, and (after draft steps) the round's read-back packed with the stop rule's ``asked`` tensors
        (:func:`_pack`)."""
        s = inp.sampling

        def fn(last, cands, draft_logits, temperature, top_k, top_p, n, seeds, extra, *asked):
            rows = RowSampling(temperature, top_k, top_p, s.greedy, s.masks, s.vocab)
            out, acc = verify_step(lambda t, keep: _attending(target, self._forward(target), t, keep)[0], last, cands,
                                   draft_logits, rows, n, seeds, target.rollback,
                                   draft.rollback if draft is not None else None, steps, extra)
            return out, acc, None if acc is None else _pack(out, acc, n, asked)  # the read-back packed in the graph

        key = ("verify", id(target), id(draft), P, cands.shape[1], steps, s.greedy, s.masks, draft_logits is None,
               n is None, inp.extra is None, len(asked))
        lengths = [target.cache.lengths] + ([draft.cache.lengths] if draft is not None else [])
        return self.graphs.replay(key, fn, [inp.last, cands, draft_logits, s.temperature, s.top_k, s.top_p, n,
                                            inp.seeds, inp.extra] + list(asked), lengths)


def _reads(early_exit: Union[bool, frozenset, str], k: int) -> bool:
    """Whether a round whose steps are not decided on the device reads its stop flags after draft step ``k``
    (``early_exit`` as :func:`exit_steps` gives it; ``"device"``: after every step)."""
    return early_exit is True or early_exit == "device" or (isinstance(early_exit, frozenset) and k in early_exit)


def _pack(out: torch.Tensor, acc: torch.Tensor, n: torch.Tensor, asked=()) -> torch.Tensor:
    """The round's read-back in one tensor: each row's emitted tokens ``out`` ``[P, W]``, its accepted count ``acc``
    ``[P]`` and the candidates it drafted ``n`` ``[P]``, as ``[P, W + 2]`` int64; with a stop rule's ``asked``
    tensors (rows first, or one-dimensional), all of it flattened to float64 and those tensors' values after it."""
    packed = torch.cat([out, acc.view(-1, 1), n.view(-1, 1).to(out.device)], 1)
    if not asked:
        return packed
    return torch.cat([packed.flatten().double()] + [t.flatten().double().to(out.device) for t in asked])


def _unpack(packed: torch.Tensor, B: int, W: int, asked: list) -> tuple:
    """``packed`` (:func:`_pack`) read to the host: the first ``B`` rows' ``W`` tokens, accepted and drafted counts
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


def _attending(backend, fn: Callable, *args):
    """``fn(*args)`` with the attention kernels the backend's eager forward allows (``runner.sdpa_backends``)."""
    with sdpa_backends(backend.device):
        return fn(*args)


def _pad_rows(t: Optional[torch.Tensor], P: int, value=0) -> Optional[torch.Tensor]:
    """``t`` (rows first) with rows of ``value`` appended up to ``P`` rows (None stays None)."""
    if t is None or t.shape[0] >= P:
        return t
    return torch.cat([t, t.new_full((P - t.shape[0],) + tuple(t.shape[1:]), value)])
