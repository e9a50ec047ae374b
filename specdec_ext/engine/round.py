"""The step runner: one round of speculative decoding (the steps of :mod:`~specdec_ext.engine.steps`) run eagerly
on the live rows, or over batch buckets compiled or replayed from CUDA graphs (``engine/graphs.py``), with one
read-back to the host (docs/design.md, The step runner; docs/gpu.md).
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from .. import ops
from ..policies.base import RoundPlan
from . import readback
from .graphs import StepGraphs, opaque
from .readback import Launched, Staging
from .runner import sdpa_backends
from .sampling import RowSampling
from .steps import RoundInputs, RoundOutput, draft_step, pack, reads_after, verify_step

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

    - ``cuda_graphs=True`` captures the steps on CUDA (``engine/graphs.py``): the verify step whole, a draft step
      whole without a stop rule or with one that can be captured (``StopRule.capture_key``), else its forward alone;
      rounds with a ``logits_processor``, and rounds off CUDA, run eagerly (``cuda_graphs="emulate"``: recorded
      steps on any device, the tests' check of the graphs' buffers).
    - ``compile=True`` (with ``cuda_graphs``) compiles the models' forwards with ``torch.compile(fullgraph=True)``
      (``backend`` and ``mode`` its own) before capture (:meth:`_forward`), so the graphs replay fused kernels; the
      rest of each step, and rounds that are not captured, run eagerly.

    Raises ValueError for a batch larger than the largest bucket (with ``cuda_graphs``, such a batch runs eager steps
    over its rows), ``cuda_graphs`` without ``buckets``, ``compile`` without ``cuda_graphs``, or a ``mode`` that
    captures torch's own CUDA graphs."""

    def __init__(self, buckets: Optional[tuple] = None, compile: bool = False, backend: str = "inductor",
                 mode: Optional[str] = None, cuda_graphs: Union[bool, str] = False):
        self.buckets = tuple(sorted(buckets)) if buckets else None
        if cuda_graphs and self.buckets is None:
            raise ValueError("cuda_graphs: CUDA graphs replay bucketed steps (buckets=...)")
        if compile and not cuda_graphs:
            raise ValueError("compile: the forwards are compiled for the CUDA graphs that capture them "
                             "(cuda_graphs=True or 'emulate')")
        if compile and mode in ("reduce-overhead", "max-autotune"):
            raise ValueError(f"mode: the steps are captured in this runner's CUDA graphs, not torch.compile's (a mode "
                             f"without cudagraphs, e.g. None or 'max-autotune-no-cudagraphs'), got {mode!r}")
        self.compile, self.backend, self.mode = bool(compile), backend, mode
        self.graphs = StepGraphs(emulate=cuda_graphs == "emulate") if cuda_graphs else None
        self._forwards: dict = {}  # id(backend) -> (backend, its compiled forward) (compile=True)
        self._counted = [0, 0.0, 0, 0.0]  # the round's forwards run here: RoundOutput.counted
        self._buffers: dict = {}  # bucket -> its persistent input tensors by name
        self._staging = Staging()  # host copies of read-backs staged for overlapped rounds

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

    def run(self, draft, target, inp: RoundInputs, plan: RoundPlan,
            early_exit: Union[bool, frozenset, str]) -> RoundOutput:
        """One round of the live rows (module docstring) by backends ``draft`` (None for a plain step) and
        ``target``; the draft runs at most ``plan.cap`` steps (0: a plain step). ``early_exit``: True, False, the
        steps after which the round reads whether any row still drafts, or ``"device"`` (``steps.exit_steps``).

        Raises ValueError when the verification reports an invalid row (a NaN or +Inf logit, or a fully masked row)."""
        return self.read(self.launch(draft, target, inp, plan, early_exit))

    def launch(self, draft, target, inp: RoundInputs, plan: RoundPlan, early_exit: Union[bool, frozenset, str],
               stage: bool = False) -> "Launched":
        """:meth:`run` up to its read-back: the round's steps enqueued (replayed, compiled or eager; what the stop
        rule reads between steps is read here), the read-back not yet read. ``stage``: its read-back copied at once
        to a host buffer of its own (pinned, without a wait, on a GPU), so the next round may be launched, and replay
        the same graphs, before this one is read (overlapped rounds, ``engine/scheduler.py``)."""
        B = inp.last.shape[0]
        P = self.bucket(B)
        if self.buckets is not None:  # the bucket's persistent inputs, padding rows filled (SGLang's replay_prepare)
            inp = self._persistent(inp, P)
            for b in (draft, target):
                if b is not None and P > B:
                    b.empty_rows(B, P)
        graphed = self._replays(draft, target, inp, P)
        self._counted = [0, 0.0, 0, 0.0]  # draft calls, draft s, target calls, target s (this round's)
        t0 = time.perf_counter()
        drafted = self._draft(draft, target, inp, plan, early_exit, P, graphed) if plan.cap > 0 else \
            _Drafted(cands=inp.last.new_empty(P, 0))  # a plain step verifies no candidates
        t1 = time.perf_counter() if drafted.fused is None else drafted.t_fused  # a fused span's time: the verification
        asked = plan.rule.readback() if plan.rule is not None and drafted.steps else []
        if drafted.fused is not None:
            out, acc, packed = drafted.fused
        else:
            out, acc, packed = self._verify(draft, target, inp, drafted, P, graphed, asked)
            if graphed:
                self._counted[2] += 1
                self._counted[3] += time.perf_counter() - t1
        on_device = drafted.fused is not None and early_exit == "device" and plan.rule is not None
        staged = self._staging.stage(packed if drafted.steps else out) if stage else None
        return Launched(out, acc, packed, drafted, B, P, asked, on_device, t0, t1, self._counted, staged)

    def read(self, launched: "Launched") -> RoundOutput:
        """The round's one read-back (:meth:`launch`) into its output (``engine/readback.read``).

        Raises ValueError when the verification reports an invalid row (a NaN or +Inf logit, or a fully masked row)."""
        return readback.read(launched)

    def advance(self, launched: "Launched", drafting: bool, draws: bool) -> tuple:
        """The next round's per-row inputs written on the device from a launched round's outputs, before it is read
        (overlapped rounds): each live row's last token becomes the one it emitted last (``out[b, acc[b]]``), the
        token before it the one emitted before that (or the old last token where none was accepted), its room
        shrinks by the tokens it emitted, its Philox round count grows by one, no row is single any more; padding
        rows stay as :meth:`row_inputs` wrote them. Needs the round to have been launched over a bucket's persistent
        inputs (``buckets``) on one device; ``drafting``: the next round drafts (the launched one must have: its
        ``prev`` and ``room`` are advanced), ``draws``: it draws (seeds). Returns :meth:`row_inputs`' tuple
        (``extra`` None), views of the persistent tensors the next round's steps read in place.

        Raises ValueError without buckets, and for a drafting next round after a plain one (whose ``prev`` and
        ``room`` the device does not hold)."""
        r = launched
        if self.buckets is None:
            raise ValueError("advance: the next round's inputs are written into a bucket's persistent tensors "
                             "(StepRunner(buckets=...))")
        if drafting and not r.drafted.steps:
            raise ValueError("advance: a drafting round after a plain step needs its inputs from the host "
                             "(the draft first reads the plain steps' tokens)")
        kept, B = self._buffers[r.P], r.B
        last = kept["last"][0]
        prev, room = (kept["prev"][0], kept["room"][0]) if r.drafted.steps else (None, None)
        seeds = kept["seeds"][0] if draws else None
        ops.advance_rows(last, prev, room, seeds, r.out, r.acc, B)  # one kernel, no read-back
        return (last[:B], prev[:B] if drafting else None, room[:B] if drafting else None, None,
                seeds[:B] if seeds is not None else None)

    def _replays(self, draft, target, inp: RoundInputs, P: int) -> bool:
        """Whether the round's steps replay graphs (SGLang's ``can_run``): a captured bucket, no host logits
        processor, on CUDA (or recorded graphs), both models lean on one device. Drops the graphs of a replaced
        cache (``StepGraphs.check``)."""
        graphed = (self.graphs is not None and P in self.buckets and inp.processor is None
                   and (inp.last.device.type == "cuda" or self.graphs.emulate) and getattr(target, "lean", False)
                   and (draft is None or (getattr(draft, "lean", False) and draft.device == target.device)))
        if graphed:
            self.graphs.check((draft, target))
        return graphed

    def _draft(self, draft, target, inp: RoundInputs, plan: RoundPlan, early_exit, P: int, graphed: bool) -> "_Drafted":
        """The round's draft steps (at most ``plan.cap``) under the plan's stop rule: replayed as spans where the rule
        can be captured, else one call each; then, where the rule asks, the depth it verifies (the batch budget's)."""
        ddev, tdev, rule = inp.prev.device, inp.last.device, plan.rule
        room = inp.room if plan.row_caps is None else torch.minimum(
            inp.room, _pad_rows(torch.tensor(list(plan.row_caps), dtype=torch.int64), P).to(ddev))
        seeds = inp.seeds.to(ddev)
        if rule is not None:
            rule.begin(P, ddev)
        # a draft step is replayed whole without a rule, or with a rule that can be captured (StopRule.capture_key)
        rule_key = rule.capture_key() if graphed and rule is not None and not rule.host else None
        out_c, out_l = [], []
        if graphed and (rule is None or rule_key is not None):
            nd, steps, fused, t_fused = self._graphed_spans(draft, target, P, plan.cap, inp, room, seeds, rule,
                                                            rule_key, early_exit, out_c, out_l)
            if fused is not None:  # verified in the last span's graph
                return _Drafted(nd.to(tdev), steps, None, None, steps, fused, t_fused)
        else:
            nd, steps = self._steps_one_by_one(draft, P, plan.cap, inp, room, seeds, rule, early_exit, graphed,
                                               out_c, out_l)
        drafted = _Drafted(nd.to(tdev), steps, torch.stack(out_c, 1).to(tdev),
                           None if inp.sampling.greedy else torch.stack(out_l, 1).to(tdev), steps)
        trimmed = rule.depth(nd, steps) if rule is not None else None
        if trimmed is not None:
            drafted.n = trimmed.to(tdev)
            if early_exit:  # the budget verifies fewer slots than were drafted: a narrower forward
                drafted.verified = int(drafted.n.max())
                drafted.cands = drafted.cands[:, :drafted.verified]
                if drafted.logits is not None:
                    drafted.logits = drafted.logits[:, :drafted.verified]
        return drafted

    def _verify(self, draft, target, inp: RoundInputs, drafted: "_Drafted", P: int, graphed: bool,
                asked: list) -> tuple:
        """The verify step, replayed from a graph or run eagerly over the columns the widest row needs: the emitted
        tokens ``out``, the accepted counts and the round's packed read-back (both None for a plain step)."""
        steps = drafted.steps
        if graphed:
            return self._graphed_verify(draft if steps else None, target, P, drafted.cands, drafted.logits, inp,
                                        drafted.n, steps, asked)
        wide = self.buckets is not None  # fixed shapes: every forward reads the whole cache
        width = None if wide else inp.target_width + drafted.verified + 1
        at = None if wide else inp.target_start
        out, acc = verify_step(
            lambda t, keep: target.forward(t, keep, width, None, at)[0], inp.last, drafted.cands, drafted.logits,
            inp.sampling, drafted.n, inp.seeds, target.rollback, draft.rollback if steps else None, steps, inp.extra,
            inp.processor)
        return out, acc, None if acc is None else pack(out, acc, drafted.n, asked)

    def _steps_one_by_one(self, draft, P: int, cap: int, inp: RoundInputs, room, seeds, rule, early_exit,
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
        forward = self._graphed_forward(draft, P) if graphed else draft.forward
        steps = 0
        for k in range(1, cap + 1):
            width = None if wide else inp.draft_width + 1 + k
            at = None if wide or inp.draft_start is None else inp.draft_start + (k if k > 1 else 0)
            t_step = time.perf_counter()
            cand, masked, nd, drafting = draft_step(lambda t, w=width, a=at: forward(t, 1, w, None, a), tokens, seeds,
                                                    k, inp.draft_sampling, rule, drafting, room, nd, inp.processor,
                                                    out_c)
            if graphed:  # the replayed forward is counted here
                self._counted[0] += 1
                self._counted[1] += time.perf_counter() - t_step
            out_c.append(cand)
            out_l.append(masked)
            steps = k
            if k == cap or (rule is not None and reads_after(early_exit, k) and not bool(drafting.any())):
                break
            tokens = cand.view(P, 1)
        return nd, steps

    def _graphed_spans(self, draft, target, P: int, cap: int, inp: RoundInputs, room, seeds, rule, rule_key,
                       early_exit, out_c: list, out_l: list):
        """A round's draft steps with no stop rule or a capturable one, replayed as spans: the steps between two
        reads of the stop flags (``early_exit``; a round without a rule reads none) each one graph, and the span
        that reaches the cap one graph with the verification after it (gpt-fast's and SGLang's whole-round graph
        where nothing is read between steps: fixed K, or drafting to the cap). With ``early_exit="device"`` and a stop
        rule, one composed graph of every step to the cap and the verification, each step after the first under a
        conditional node run while some row drafts (:meth:`_graphed_chain`): nothing is read until the round's end,
        and the steps after every row stopped cost the GPU nothing. Appends each step's candidates and processed logits
        to ``out_c`` / ``out_l``; returns (candidates drafted per row ``[P]``, steps run (the cap where the device
        decided), the fused verification's ``(out, acc, packed)`` and the host clock when its graph began, or None
        and None when drafting stopped before the cap)."""
        on_device = early_exit == "device" and rule is not None  # the steps after the first decided by the GPU

        def span(first: int, last: int, state: Optional[tuple], verify: bool) -> tuple:
            t_span = time.perf_counter()
            if on_device:
                outs = self._graphed_chain(draft, target, P, cap, inp, room, seeds, rule, rule_key)
            else:
                outs = self._graphed_span(draft, target if verify else None, P, first, last, inp, room, seeds, rule,
                                          rule_key, state, out_c, out_l)
            n_steps = last - first + 1
            out_c.extend(outs[:n_steps])
            out_l.extend(outs[n_steps: 2 * n_steps])
            counted = self._counted
            counted[0] += 0 if on_device else n_steps  # on the device: counted from the read-back (StepRunner.run)
            if verify:  # the span's time is the verification's (its draft steps are not timed apart)
                counted[2] += 1
                counted[3] += time.perf_counter() - t_span
            else:
                counted[1] += time.perf_counter() - t_span
            return outs[2 * n_steps:]

        first, state = 1, None
        for last in [k for k in range(1, cap) if rule is not None and not on_device and reads_after(early_exit, k)]:
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
        entry = self._forwards.get(id(backend))
        if entry is None or entry[0] is not backend:
            # a code object of its own per model: torch.compile keeps its graphs and its record of which sizes
            # changed per code object, so the draft's forward would otherwise make the target's head counts dynamic
            fn = type(backend.lean_model).forward
            own = types.FunctionType(fn.__code__.replace(co_name=f"{backend.lean_model.name}_forward"),
                                     fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
            compiled = torch.compile(types.MethodType(own, backend.lean_model), fullgraph=True, backend=self.backend,
                                     mode=self.mode)

            @opaque  # recorded graphs off CUDA call it whole (no dispatch mode inside compiled code)
            def forward(tokens, keep=1):
                with torch._dynamo.config.patch(recompile_limit=GRAPHS, accumulated_recompile_limit=GRAPHS):
                    return compiled(backend.cache, tokens, None, keep)

            def step(tokens, keep=1):
                return backend.map.logits(forward(backend.map.tokens(tokens), keep))

            entry = self._forwards[id(backend)] = (backend, step)
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
                      rule_key, state: Optional[tuple], out_c: list, out_l: list) -> tuple:
        """Draft steps ``first`` .. ``last``, with no stop rule or a capturable one (``rule_key``), replayed as one
        graph per (bucket, span, sampling mode, rule); with ``target``, the verification of the round's candidates
        too. ``state``: (the last candidate ``[P, 1]``, rows drafting, candidates drafted) after step ``first - 1``,
        None for the round's first span (which reads ``prev`` and ``last``); ``out_c`` / ``out_l``: the candidates
        and processed logits of the steps before ``first``. Returns the span's candidates, then
        its processed logits, then (candidates drafted ``[P]``, rows drafting ``[P]``), then with the verification
        ``(out, acc, packed)`` (:func:`~specdec_ext.engine.steps.pack`)."""
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
                                   seeds, target.rollback, draft.rollback, last, extra)
            return outs + (out, acc, pack(out, acc, n, asked))  # the rule's kept tensors, as the steps wrote them

        start = (inp.prev, None, None) if state is None else state
        inputs = list(start) + [inp.last, seeds, room, ds.temperature, ds.top_k, ds.top_p] + out_c + out_l
        written = [draft.cache.lengths] + (rule.written() if rule is not None else [])
        if target is not None:
            inputs += [ts.temperature, ts.top_k, ts.top_p, inp.extra]
            written.append(target.cache.lengths)
        key = ("span", id(draft), id(target), P, first, last, ds.greedy, ds.masks, ts.greedy, ts.masks, rule_key,
               inp.extra is None, _shapes(asked))
        return self.graphs.replay(key, fn, inputs, written)

    def _graphed_chain(self, draft, target, P: int, cap: int, inp: RoundInputs, room, seeds, rule, rule_key) -> tuple:
        """A round whose draft steps after the first the GPU decides (``early_exit="device"``), replayed as one
        composed graph (:meth:`StepGraphs.replay_chain`, per bucket, cap, sampling mode and rule): the first step,
        which also makes the round's buffers (every step's candidates and logits, 0 until a step writes them, and a
        flag per later step); step k (1 < k <= cap) under a conditional node that runs it where some row still
        drafts, writing its candidate and logits, the candidates drafted and the rows drafting in place and the flag
        of the step after it; the verification of the cap's candidates, the draft rolled back by the steps that ran
        (the most candidates a row drafted), the read-back packed. Returns what :meth:`_graphed_span` returns for a
        span of every step with the verification."""
        ds, ts = inp.draft_sampling, inp.sampling
        asked = rule.readback()

        def first(prev, last_t, seeds, room, d_temperature, d_top_k, d_top_p, *_):
            rows = RowSampling(d_temperature, d_top_k, d_top_p, ds.greedy, ds.masks, ds.vocab)
            n = torch.zeros(P, dtype=torch.int64, device=room.device)
            cand, masked, n, drafting = draft_step(lambda t: _attending(draft, self._forward(draft), t, 1),
                                                   torch.stack([prev, last_t], 1), seeds, 1, rows, rule, room > 0,
                                                   room, n)
            cands = torch.zeros((cap,) + tuple(cand.shape), dtype=cand.dtype, device=cand.device)
            logits = torch.zeros((cap,) + tuple(masked.shape), dtype=masked.dtype, device=masked.device)
            cands[0].copy_(cand)
            logits[0].copy_(masked)
            flags = torch.zeros(cap - 1, dtype=torch.bool, device=cand.device)
            if cap > 1:
                flags[0].copy_(drafting.any())
            return cands, logits, n, drafting, flags

        def later(k: int) -> Callable:
            def step(prev, last_t, seeds, room, d_temperature, d_top_k, d_top_p, t_temperature, t_top_k, t_top_p,
                     extra, cands, logits, n, drafting, flags):
                rows = RowSampling(d_temperature, d_top_k, d_top_p, ds.greedy, ds.masks, ds.vocab)
                outs = draft_step(lambda t: _attending(draft, self._forward(draft), t, 1), cands[k - 2].view(P, 1),
                                  seeds, k, rows, rule, drafting, room, n)
                for kept, new in zip((cands[k - 1], logits[k - 1], n, drafting), outs):
                    kept.copy_(new)
                if k < cap:
                    flags[k - 1].copy_(drafting.any())

            return step

        def verify(prev, last_t, seeds, room, d_temperature, d_top_k, d_top_p, t_temperature, t_top_k, t_top_p,
                   extra, cands, logits, n, drafting, flags):
            trows = RowSampling(t_temperature, t_top_k, t_top_p, ts.greedy, ts.masks, ts.vocab)
            out, acc = verify_step(lambda t, keep: _attending(target, self._forward(target), t, keep)[0], last_t,
                                   cands.t().contiguous(), None if ts.greedy else logits.transpose(0, 1).contiguous(),
                                   trows, n, seeds,
                                   target.rollback, draft.rollback, cap, extra, ran=n.max())
            return out, acc, pack(out, acc, n, asked)  # the rule's kept tensors, as the steps wrote them

        inputs = [inp.prev, inp.last, seeds, room, ds.temperature, ds.top_k, ds.top_p, ts.temperature, ts.top_k,
                  ts.top_p, inp.extra]
        written = [draft.cache.lengths, target.cache.lengths] + rule.written()
        key = ("chain", id(draft), id(target), P, cap, ds.greedy, ds.masks, ts.greedy, ts.masks, rule_key,
               inp.extra is None, _shapes(asked))
        (cands, logits, n, drafting, _), fused = self.graphs.replay_chain(
            key, [first] + [later(k) for k in range(2, cap + 1)] + [verify], inputs, written)
        return tuple(cands.unbind(0)) + tuple(logits.unbind(0)) + (n, drafting) + tuple(fused)

    def _graphed_verify(self, draft, target, P: int, cands, draft_logits, inp: RoundInputs, n, steps: int,
                        asked: list):
        """The verify step replayed whole from a graph per (bucket, width, draft steps, sampling mode): its tokens and
        accepted counts, and (after draft steps) the round's read-back packed with the stop rule's ``asked`` tensors
        (:func:`~specdec_ext.engine.steps.pack`)."""
        s = inp.sampling

        def fn(last, cands, draft_logits, temperature, top_k, top_p, n, seeds, extra, *asked):
            rows = RowSampling(temperature, top_k, top_p, s.greedy, s.masks, s.vocab)
            out, acc = verify_step(lambda t, keep: _attending(target, self._forward(target), t, keep)[0], last, cands,
                                   draft_logits, rows, n, seeds, target.rollback,
                                   draft.rollback if draft is not None else None, steps, extra)
            return out, acc, None if acc is None else pack(out, acc, n, asked)  # the read-back packed in the graph

        key = ("verify", id(target), id(draft), P, cands.shape[1], steps, s.greedy, s.masks, draft_logits is None,
               n is None, inp.extra is None, _shapes(asked))
        lengths = [target.cache.lengths] + ([draft.cache.lengths] if draft is not None else [])
        return self.graphs.replay(key, fn, [inp.last, cands, draft_logits, s.temperature, s.top_k, s.top_p, n,
                                            inp.seeds, inp.extra] + list(asked), lengths)


@dataclass
class _Drafted:
    """What a round's draft phase leaves its verification: ``n`` ``[P]`` int64, the candidates each row drafted (or
    verifies, where a budget trimmed them), on the target's device; ``steps``, draft forwards run; ``cands``
    ``[P, K]`` and ``logits`` ``[P, K, V]`` (None when greedy) the candidates and their processed draft logits, on the
    target's device; ``verified``, the width K the target verifies; ``fused``, where the verification already ran in one
    graph with the last span of draft steps, its ``(out, acc, packed)``, and ``t_fused`` the host clock when that graph
    began."""

    n: Optional[torch.Tensor] = None
    steps: int = 0
    cands: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    verified: int = 0
    fused: Optional[tuple] = None
    t_fused: Optional[float] = None


def _shapes(tensors: list) -> tuple:
    """The shapes of ``tensors`` (a stop rule's read-back, part of a graph's key: a graph reads the shapes it was
    captured with)."""
    return tuple(tuple(t.shape) for t in tensors)


def _attending(backend, fn: Callable, *args):
    """``fn(*args)`` with the attention kernels the backend's eager forward allows (``runner.sdpa_backends``)."""
    with sdpa_backends(backend.device):
        return fn(*args)


def _pad_rows(t: Optional[torch.Tensor], P: int, value=0) -> Optional[torch.Tensor]:
    """``t`` (rows first) with rows of ``value`` appended up to ``P`` rows (None stays None)."""
    if t is None or t.shape[0] >= P:
        return t
    return torch.cat([t, t.new_full((P - t.shape[0],) + tuple(t.shape[1:]), value)])
