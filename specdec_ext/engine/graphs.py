"""CUDA graphs of the round's steps: captured at a shape's first round, replayed from then on.

On a GPU a small model's step is bound by kernel launches, not arithmetic (an H100, the bundled pair in bf16: the
target's one-token forward 8.3 ms eager against 0.87 ms replayed from a graph). :class:`StepGraphs` captures, per
fixed shape of a bucketed round (``engine/round.StepRunner``):

- the **draft steps between two reads** of the stop flags (each forward, sampling, the stop rule's step) as one
  graph, where the round has no stop rule (fixed K) or one that can be captured (``StopRule.capture_key``:
  SpecDec++'s acceptance-head step with a fixed h or the per-row ``threshold="auto"`` rule, whose state lives in
  the policy's buffers, refilled in place each round), per (bucket, first and last step, sampling mode, rule); the
  span that reaches the round's cap carries the **verify step** in the same graph (target forward over K + 1
  tokens, the fused verification, both caches' roll-back, the read-back packed), so a round of fixed K, or one
  drafting to the cap, is one replay (gpt-fast's and SGLang's graph of a whole round);
- the whole **verify step** alone after the rows stopped drafting at a read, per (bucket, verification width,
  draft steps, sampling mode);
- the **draft's forward** alone where another stop rule decides (confidence, AdaEDL, the batch verification budget,
  a host rule): such a rule keeps state on the host between steps, so it stays eager, the forward's launches
  replayed.

A graph reads and writes fixed addresses: it reads the tensors it was captured with, and a later call's inputs are
copied into them (SGLang's ``replay_prepare``) unless they are the same memory (the runner's persistent inputs, a
previous step's graph outputs, which is most of them: no copy), its outputs are the tensors it wrote at capture,
overwritten by its next replay (the round reads them before that; a forward's outputs are copied out, as one draft
step's logits are kept while the next replays the same graph). Every graph shares one memory pool (captured in the
order the rounds meet their shapes, replayed one at a time on one stream). Each is captured after one eager warm-up
run on a side stream (lazy initialisation stays out of the graph); what it wrote in place (the KV caches' lengths, a
stop rule's buffers) is restored after it, so capture changes nothing a round can see. The graphs read the backends' caches where they were
captured: when a backend's cache is replaced (a longer request, more rows), every graph is dropped and captured
again.

What cannot be captured runs eagerly: a ``logits_processor`` (host work) and a host stop rule
(``StopRule.host``).

:meth:`StepGraphs.replay_chain` lets a graph decide on the device whether its parts run: pieces captured one by one
(``torch.cuda.CUDAGraph(keep_graph=True)``) and composed by the extension into one graph in which each piece between
the first and the last sits under a conditional IF node (CUDA 12.4's ``cudaGraphConditionalHandle``,
``csrc/cuda/graphs.cu``) whose flag the GPU reads at each replay, so a round's draft steps past the point where every
row stopped are skipped without a read-back (``early_exit="device"``, ``engine/round.py``). Torch's own
``CUDAGraph.begin_capture_to_if_node`` reached it only in 2026, after the torch the lent GPU machines run (2.11); the
pieces, captured by torch into its graph pool and kept alive beside the composed graph, own their memory as any other
graph does.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode_temporarily

def chain_nodes() -> bool:
    """Whether this build composes graphs with conditional nodes (:meth:`StepGraphs.replay_chain` on CUDA): the
    extension compiled for CUDA, where the ``graph_chain`` op has a CUDA kernel."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("specdec_ext::graph_chain", "CUDA")
    except RuntimeError:  # the op is not registered: the extension is absent
        return False


class _Tape(TorchDispatchMode):
    """The ops a step dispatches while it is recorded (:class:`_Recorded`): each op with its arguments and results,
    as a captured graph keeps its kernels with their addresses and the values passed at capture. A host read of a
    device value (``.item()``, ``.tolist()``, ``bool(t)``: a result that is not a tensor) raises, as it does while a
    CUDA stream captures."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        results = out if isinstance(out, (tuple, list)) else (out,)
        if any(r is not None and not isinstance(r, torch.Tensor) for r in results):
            raise RuntimeError(f"a captured step read a device value on the host ({func}): a CUDA graph cannot "
                               "capture a read-back; move it out of the step")
        self.add(func, args, kwargs, results, view=func.is_view)
        return out

    def add(self, func: Callable, args, kwargs, results, view: bool = False) -> None:
        """``func(*args, **kwargs)`` onto the tape, with each of its ``results`` that is no input's memory (a view
        of an input, made again at no replay, stays off the tape)."""
        inputs = {_storage(t) for t in _tensors(args, kwargs)}
        fresh = [r if isinstance(r, torch.Tensor) and _storage(r) not in inputs else None for r in results]
        if not (view and all(r is None for r in fresh)):  # a view (reshape, to, contiguous where they copied
            self.ops.append((func, args, kwargs, fresh))  # nothing): the same memory at every replay

    def replay(self) -> None:
        """Every recorded op again on the tensors and values it was recorded with; a result it made afresh is copied
        into the tensor it made at recording, so the ops after it, and the caller, read it where they did then."""
        for func, args, kwargs, fresh in self.ops:
            out = func(*args, **kwargs)
            for kept, new in zip(fresh, out if isinstance(out, (tuple, list)) else (out,)):
                if kept is not None:
                    kept.copy_(new)


def opaque(fn: Callable) -> Callable:
    """``fn`` recorded whole where a step is recorded (:class:`_Tape`): run outside the tape and replayed as one call,
    its tensor results copied where the recording left them. For what cannot run under a dispatch mode: a
    ``torch.compile``'d forward (its kernels are what a capture would take)."""

    def call(*args):
        tape = _get_current_dispatch_mode()
        if not isinstance(tape, _Tape):
            return fn(*args)
        with _pop_mode_temporarily():
            out = fn(*args)
        tape.add(fn, args, {}, out if isinstance(out, (tuple, list)) else (out,))
        return out

    return call


def _tensors(args, kwargs) -> list:
    found = []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (tuple, list)):
            found += [t for t in a if isinstance(t, torch.Tensor)]
    return found


def _storage(t: torch.Tensor) -> int:
    """Where ``t``'s storage starts (an opaque tensor, oneDNN's packed weights: its identity)."""
    try:
        return t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return id(t)


def _record(fn: Callable, *args):
    """``fn(*args)`` run once under a :class:`_Tape`: returns ``(tape, fn's results)``."""
    tape = _Tape()
    with tape:
        out = fn(*args)
    return tape, out


class _Recorded:
    """A stand-in for a captured graph off CUDA (``StepGraphs(emulate=True)``, for the tests): the step's ops as it
    dispatched them once (:class:`_Tape`), replayed on the same tensors, so a replay does what a graph's does and no
    more: the Python around the ops does not run again, values read from the host at recording stay as they were,
    and the results land in the tensors of the recording, overwritten by the next replay."""

    def __init__(self, tape: "_Tape", inference: bool):
        self.tape, self.inference = tape, inference

    def replay(self) -> None:
        with torch.inference_mode(self.inference):
            self.tape.replay()


class _RecordedChain:
    """:class:`_Recorded` for :meth:`StepGraphs.replay_chain`: each piece's ops recorded apart, piece i
    (0 < i < n - 1) replayed only where its flag holds (read by the host: the conditional node's stand-in)."""

    def __init__(self, tapes: list, flags: torch.Tensor, inference: bool):
        self.tapes, self.flags, self.inference = tapes, flags, inference

    def replay(self) -> None:
        with torch.inference_mode(self.inference):
            self.tapes[0].replay()
            _run_middle([lambda *_, t=t: t.replay() for t in self.tapes], [], (self.flags,), every=False)
            self.tapes[-1].replay()


def _run_middle(pieces: Sequence[Callable], static: list, shared: tuple, every: bool) -> None:
    """The chain's middle pieces, eagerly: piece i where ``shared[-1][i - 1]`` holds (``every``: all of them, as a
    capture's warm-up runs every kernel once)."""
    for i in range(1, len(pieces) - 1):
        if every or bool(shared[-1][i - 1]):
            pieces[i](*static, *shared)


def _run_chain(pieces: Sequence[Callable], static: list, every: bool) -> tuple:
    """The chain's pieces run eagerly in order (the middle ones where their flags hold, or ``every`` one): returns
    ``(shared, outputs)``."""
    shared = pieces[0](*static)
    _run_middle(pieces, static, shared, every)
    return shared, pieces[-1](*static, *shared)


class _Chain:
    """An instantiated composed graph (``ops.graph_chain``) with the torch graphs of its pieces, which own the memory
    its kernels read and write: they live as long as it does."""

    def __init__(self, anchor: torch.Tensor, pieces: list, flags: torch.Tensor):
        from .. import ops

        self.ops, self.anchor, self.pieces = ops, anchor, pieces
        self.exec = ops.graph_chain(anchor, [g.raw_cuda_graph() for g in pieces], [f.view(1) for f in flags])

    def replay(self) -> None:
        self.ops.graph_launch(self.anchor, self.exec)

    def __del__(self):
        if getattr(self, "exec", None):
            self.ops.graph_destroy(self.anchor, self.exec)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` view the same memory the same way (a graph's input needs no copy)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


class StepGraphs:
    """The CUDA graphs of one :class:`~specdec_ext.engine.round.StepRunner` (module docstring), keyed by the step
    and its shapes; ``captures`` counts the graphs captured (they are kept until a backend's cache is replaced).
    ``emulate=True``: the steps are recorded, not captured (:class:`_Recorded`), on any device: the tests' check of
    the buffers' plumbing where no GPU is."""

    def __init__(self, emulate: bool = False):
        self.emulate = bool(emulate)
        self._graphs: dict = {}
        self._caches: dict = {}  # id(backend) -> (backend, the cache its graphs read)
        self._pool = None
        self.captures = 0

    def check(self, backends: Sequence) -> None:
        """Drop every graph when one of ``backends`` (lean backends) has replaced the cache its graphs read."""
        changed = False
        for b in backends:
            if b is None:
                continue
            kept = self._caches.get(id(b))
            if kept is None or kept[0] is not b or kept[1] is not b.cache:
                changed = changed or kept is not None
                self._caches[id(b)] = (b, b.cache)
        if changed:  # the pool goes with its last graph: a new one for the graphs captured next
            self._graphs.clear()
            self._pool = None

    def replay(self, key: tuple, fn: Callable, inputs: Sequence[Optional[torch.Tensor]], state: Sequence):
        """``fn(*inputs)`` (a tuple of tensors, or of tensors and None) replayed from the graph captured for ``key``
        at its first call. ``state``: the tensors ``fn`` writes in place that a round reads (the caches' lengths, a
        stop rule's buffers), restored after the warm-up run. Returns the graph's outputs: valid until its next
        replay."""
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(fn, inputs, state)
        graph, static, outs = entry
        for buf, t in zip(static, inputs):
            if buf is not None and buf is not t and not _same(buf, t):  # most are the very tensors captured
                buf.copy_(t)
        graph.replay()
        return outs

    def replay_chain(self, key: tuple, pieces: Sequence[Callable], inputs: Sequence[Optional[torch.Tensor]],
                     state: Sequence) -> tuple:
        """Pieces replayed as one graph whose middle ones run where the device says (module docstring):
        ``pieces[0](*inputs)`` returns the tensors the pieces share, the last of them a ``[n - 2]`` bool tensor of
        flags; ``pieces[i](*inputs, *shared)`` (0 < i < n - 1) runs where ``flags[i - 1]`` holds, writing in place
        (the flags after its own among them); ``pieces[-1](*inputs, *shared)`` always, returning the outputs.
        Captured at its first call as :meth:`replay` captures (``state`` restored after the warm-up, in which every
        piece runs); returns ``(shared, outputs)``, valid until the next replay."""
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(pieces, inputs, state, chain=True)
        graph, static, outs = entry
        for buf, t in zip(static, inputs):
            if buf is not None and buf is not t and not _same(buf, t):
                buf.copy_(t)
        graph.replay()
        return outs

    def _capture(self, fn, inputs: Sequence[Optional[torch.Tensor]], state: Sequence, chain: bool = False):
        # the graph reads the tensors it was captured with: a later call passing the same memory (a runner's
        # persistent inputs, an earlier graph's outputs) copies nothing; other tensors are copied in. A tensor passed
        # twice, or one a step writes in place, gets a buffer of its own.
        written = {t.data_ptr() for t in state}
        static, seen = [], set()
        for t in inputs:
            own = t is not None and (t.data_ptr() in seen or t.data_ptr() in written)
            static.append(t.clone() if own else t)
            if t is not None:
                seen.add(t.data_ptr())
        saved = [t.clone() for t in state]
        self.captures += 1
        if self.emulate:  # recorded: the ops of one run, every middle piece's too, as a capture takes them all
            inference = torch.is_inference_mode_enabled()
            if chain:
                first, shared = _record(fn[0], *static)
                middle = [_record(piece, *static, *shared)[0] for piece in fn[1:-1]]
                last, outs = _record(fn[-1], *static, *shared)
                recorded, outs = _RecordedChain([first, *middle, last], shared[-1], inference), (shared, outs)
            else:
                tape, outs = _record(fn, *static)
                recorded = _Recorded(tape, inference)
            for t, before in zip(state, saved):
                t.copy_(before)
            return recorded, static, outs
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: cuBLAS handles, workspaces and the like outside the graph
            _run_chain(fn, static, every=True) if chain else fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        for t, before in zip(state, saved):
            t.copy_(before)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if not chain:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                outs = fn(*static)
            return graph, static, outs
        pieces = [torch.cuda.CUDAGraph(keep_graph=True) for _ in fn]  # each captured apart, composed after
        with torch.cuda.graph(pieces[0], pool=self._pool):
            shared = fn[0](*static)
        for graph, piece in zip(pieces[1:-1], fn[1:-1]):
            with torch.cuda.graph(graph, pool=self._pool):
                piece(*static, *shared)
        with torch.cuda.graph(pieces[-1], pool=self._pool):
            outs = fn[-1](*static, *shared)
        return _Chain(shared[-1], pieces, shared[-1]), static, (shared, outs)
