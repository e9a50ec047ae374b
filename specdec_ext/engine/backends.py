"""A model with its KV cache, behind the one interface the round runs on.

- :class:`LeanBackend`: a :class:`~specdec_ext.engine.model.LeanModel` over a
  :class:`~specdec_ext.engine.cache.StaticCache` (Llama, Qwen2, Qwen3 on one device): fixed-shape forwards with no
  host synchronisation, the steps a CUDA graph captures.
- :class:`HFBackend`: ``transformers``' forward through :class:`~specdec_ext.engine.runner.CausalLMRunner` (other
  architectures, sliding-window models, ``device_map`` and tensor-parallel targets): its roll-back turns rejected
  positions into attention-mask holes and reads their counts on the host, so it is correct, not capturable.

The live rows of a batch are the backend's rows ``0 .. B - 1``. Each backend counts its forward calls and the wall
time spent in them (``calls``, ``seconds``). A lean backend's forwards read ``width`` columns (the widest live row's
length after them, known on the host); None reads the whole cache, as compiled and captured steps do.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from .cache import StaticCache, cache_bytes, columns_for
from .model import LeanModel, supports
from .models import stand_in_id, vocab_size
from .runner import CausalLMRunner, sdpa_backends

PREFILL_PADDING = 0.25  # length_groups: the padding a prefill group may compute, as a share of its real tokens
PREFILL_SLACK = 128     # ... or this many padding tokens (a forward of a few short prompts costs little more)
# The most tokens (rows x columns, padding included) one prefill forward computes; a longer prefill runs as forwards
# over consecutive column chunks, through the KV cache (None: one forward). On a 2-core AMD EPYC (fp32 bundled
# target) 16 prompts of 767 tokens took 6.9 s in one forward and 5.2 s in chunks of 128 columns (2,048 tokens):
# the activations of a 12k-token forward leave the caches. Chunks much smaller lose again (64 columns of 4 rows).
PREFILL_CHUNK_TOKENS: Optional[int] = 2048


def length_groups(lengths: Sequence[int], padding: float = PREFILL_PADDING,
                  slack: int = PREFILL_SLACK) -> list[list[int]]:
    """The rows ``0 .. len(lengths) - 1`` in groups to prefill together, the widest group first: rows sorted by
    length (longest first) and cut greedily so that a group, padded to its longest row, computes at most
    ``padding`` times its real tokens, or ``slack`` tokens, in padding (one padded prefill of the first 64 HumanEval
    prompts, 39 to 365 tokens, would be 64% padding)."""
    groups: list[list[int]] = []
    real = 0  # the real tokens of the last group
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if groups:
            width, total = lengths[groups[-1][0]], real + lengths[i]
            if (len(groups[-1]) + 1) * width - total <= max(padding * total, slack):
                groups[-1].append(i)
                real = total
                continue
        groups.append([i])
        real = lengths[i]
    return groups


def chunk_columns(rows: int, columns: int) -> int:
    """The columns one prefill forward of ``rows`` rows takes (:data:`PREFILL_CHUNK_TOKENS`; at least one)."""
    return columns if PREFILL_CHUNK_TOKENS is None else max(1, PREFILL_CHUNK_TOKENS // max(rows, 1))


class _Timed:
    """Counts forward calls and the wall time inside them."""

    calls = 0
    seconds = 0.0

    def _timed(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


class VocabMap:
    """A model whose embedding rows (``own``) differ from the round's vocabulary V (the target's): its logits come
    out ``[..., V]`` (padded with -inf, a probability of 0 for the ids beyond its rows, or cut to V) and an id it
    cannot embed (one only the target emits) is read as :func:`~specdec_ext.engine.models.stand_in_id`. The draft's
    proposal distribution is then the one the verification reads, so the output stays the target's; only the
    draft's proposals after such an id suffer. With equal sizes every map is the identity."""

    def __init__(self, model, vocab: Optional[int]):
        self.own = vocab_size(model)
        self.vocab = self.own if vocab is None else int(vocab)
        self.stand_in = stand_in_id(model)

    def tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.own >= self.vocab:
            return tokens
        return torch.where(tokens < self.own, tokens, torch.full_like(tokens, self.stand_in))

    def seqs(self, seqs: Sequence[Sequence[int]]) -> Sequence[Sequence[int]]:
        if self.own >= self.vocab:
            return seqs
        return [[t if t < self.own else self.stand_in for t in s] for s in seqs]

    def logits(self, out):
        """``(logits [B, n, own], hidden)`` -> ``(logits [B, n, V], hidden)``."""
        if self.own == self.vocab:
            return out
        logits, hidden = out
        if self.own > self.vocab:
            return logits[..., : self.vocab], hidden
        return torch.nn.functional.pad(logits, (0, self.vocab - self.own), value=float("-inf")), hidden


class LeanBackend(_Timed):
    """A lean model over a static KV cache (module docstring). ``packed``, ``attention``: :class:`LeanModel`'s."""

    lean = True

    def __init__(self, model, name: str, packed: Optional[bool] = None, vocab: Optional[int] = None,
                 attention: str = "auto"):
        self.model, self.name = model, name
        self.map = VocabMap(model, vocab)
        self.lean_model = LeanModel(model, name, packed, attention)
        self.device = self.lean_model.device
        self.max_pos = self.lean_model.max_pos
        self.cache: Optional[StaticCache] = None
        self.calls, self.seconds = 0, 0.0

    def start(self, slots: int, columns: int) -> None:
        """A call's start: room for ``slots`` rows of ``columns`` columns (rounded up to the cache's column block,
        at most the model's positions), every slot empty. The cache is kept from call to call while it is large
        enough, so compiled or captured steps meet the same tensors."""
        size = self._new_size(slots, columns)
        if size is not None:
            self.cache = self.lean_model.cache(*size)
        self.cache.lengths.zero_()

    def _new_size(self, slots: int, columns: int) -> Optional[tuple[int, int]]:
        """``(slots, columns)`` of the cache :meth:`start` allocates for this call (at least the kept cache's), or
        None where the kept cache is large enough."""
        cols = columns_for(columns, self.max_pos)
        if self.cache is not None and self.cache.slots >= slots and self.cache.max_len >= cols:
            return None
        if self.cache is None:
            return slots, cols
        return max(slots, self.cache.slots), max(cols, self.cache.max_len)

    def new_bytes(self, slots: int, columns: int) -> int:
        """Bytes :meth:`start` of this size would allocate (0 where the kept cache is large enough)."""
        size = self._new_size(slots, columns)
        if size is None:
            return 0
        m = self.lean_model
        return cache_bytes(len(m.layers), size[0], m.n_kv, size[1], m.head_dim, m.dtype)

    def reserve(self, slots: int, columns: int, live: int) -> None:
        """Room for ``slots`` rows of ``columns`` columns, keeping the first ``live`` rows (a longer request joins)."""
        cols = columns_for(columns, self.max_pos)
        if self.cache.slots < slots or self.cache.max_len < cols:
            self.cache = self.cache.resized(max(slots, self.cache.slots), max(cols, self.cache.max_len), live)

    def forward(self, tokens: torch.Tensor, keep: int = 1, width: Optional[int] = None, rows=None,
                start: Optional[int] = None):
        """:meth:`LeanModel.forward` of the live rows ``0 .. B - 1`` (or ``rows``), under inference mode: ``(logits
        [B, keep, V] float32, hidden [B, keep, H])``."""
        with sdpa_backends(self.device), torch.inference_mode():
            return self.map.logits(self._timed(self.lean_model.forward, self.cache, self.map.tokens(tokens), rows, keep,
                                               width, start))

    def step(self, tokens: torch.Tensor, keep: int = 1, width: Optional[int] = None, rows=None,
             start: Optional[int] = None):
        """:meth:`forward` neither timed nor counted: the form compiled and captured steps call (the step runner
        counts them)."""
        return self.map.logits(self.lean_model.forward(self.cache, self.map.tokens(tokens), rows, keep, width, start))

    def rollback(self, n_remove: torch.Tensor) -> None:
        """Drop the last ``n_remove[b]`` positions of live row b (``[B]`` int64)."""
        self.cache.rollback(n_remove.to(self.device), n_remove.shape[0])

    def empty_rows(self, start: int, stop: int) -> None:
        """Rows ``start .. stop - 1`` hold nothing: a batch bucket's padding rows, read as empty by a round."""
        self.cache.lengths[start:stop] = 0

    def append(self, slots: Sequence[int], seqs: Sequence[Sequence[int]], starts: Sequence[int]) -> None:
        """Feed each ``seqs[i]`` (token ids) to slot ``slots[i]`` after its first ``starts[i]`` columns (prefill: 0;
        catch-up: the columns the row holds): rows of similar length together (:func:`length_groups`), right-padded to the group's longest and
        rolled back by their padding, each group in column chunks (:func:`chunk_columns`)."""
        for group in length_groups([len(s) for s in seqs], PREFILL_PADDING, PREFILL_SLACK):
            rows = [slots[i] for i in group]
            w = max(len(seqs[i]) for i in group)
            ordered = rows == list(range(rows[0], rows[0] + len(rows)))
            index = slice(rows[0], rows[0] + len(rows)) if ordered else torch.tensor(rows, device=self.device)
            self.cache.lengths[index] = torch.tensor([starts[i] for i in group], device=self.device)
            if w == 0:
                continue
            toks = torch.zeros(len(group), w, dtype=torch.int64)
            for j, i in enumerate(group):
                toks[j, : len(seqs[i])] = torch.tensor(seqs[i], dtype=torch.int64)
            toks = toks.to(self.device)
            top = max(starts[i] for i in group)
            same = ordered and all(starts[i] == top for i in group)  # one length: the forward's slice path
            step = chunk_columns(len(group), w)
            for c in range(0, w, step):
                end = min(w, c + step)
                self.forward(toks[:, c:end], width=top + end, rows=index, start=top + c if same else None)
            pad = [w - len(seqs[i]) for i in group]
            if any(pad):
                self.cache.lengths[index] -= torch.tensor(pad, device=self.device)

    def select(self, order: Sequence[int], columns: Sequence[int]) -> None:
        """The live rows become the old rows ``order`` (``columns[i]``: the columns row ``order[i]`` holds): rows that
        stay in place are not copied (finished rows leave, the last rows take their places)."""
        moves = [(src, dst) for dst, src in enumerate(order) if src != dst]
        if any(src < len(order) for src, _ in moves):  # a permutation among the kept rows: through a copy
            idx = torch.tensor(list(order), device=self.device)
            for buf in (self.cache.k, self.cache.v):
                for t in buf:
                    t[: len(order)] = t[idx]
            self.cache.lengths[: len(order)] = self.cache.lengths[idx].clone()
            return
        self.cache.move([s for s, _ in moves], [d for _, d in moves], [columns[d] for _, d in moves])

    def take(self, slots: Sequence[int], other: "LeanBackend", rows: Sequence[int], columns: Sequence[int]) -> None:
        """Slots ``slots`` take rows ``rows`` of ``other`` (a backend of the same model that prefilled them ahead)."""
        self.cache.take(slots, other.cache, rows, columns)

    def close(self) -> None:
        """Nothing to free: the cache is kept for the next call."""


class HFBackend(_Timed):
    """``transformers``' forward and KV cache through :class:`CausalLMRunner` (module docstring)."""

    lean = False

    def __init__(self, model, name: str, vocab: Optional[int] = None):
        self.model, self.name = model, name
        self.map = VocabMap(model, vocab)
        self.runner = CausalLMRunner(model, name)
        self.device = self.runner.device
        self.calls, self.seconds = 0, 0.0
        self.rows = 0

    def start(self, slots: int, columns: int) -> None:
        self.runner.start(0)
        self.rows = 0

    def new_bytes(self, slots: int, columns: int) -> int:
        """Bytes the runner's cache reaches for ``slots`` rows of ``columns`` columns (it grows as it is fed); 0 for a
        model spread over devices (``device_map``), whose layers' caches are not all on one."""
        if len(set((getattr(self.model, "hf_device_map", None) or {}).values())) > 1:
            return 0
        cfg = self.model.config
        try:
            kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            layers = cfg.num_hidden_layers
        except AttributeError:  # a config that names its sizes otherwise: not estimated
            return 0
        return cache_bytes(layers, slots, kv, columns, head_dim, next(self.model.parameters()).dtype)

    def reserve(self, slots: int, columns: int, live: int) -> None:
        """The runner's cache grows as it is fed."""

    def forward(self, tokens: torch.Tensor, keep: int = 1, width: Optional[int] = None, rows=None,
                start: Optional[int] = None, hidden: bool = True, valid: Optional[torch.Tensor] = None):
        """The runner's forward of the live rows: ``(logits [B, keep, V] float32, hidden [B, keep, H] or None)``."""
        return self.map.logits(self._timed(self.runner.forward, self.map.tokens(tokens), valid, keep, hidden))

    def rollback(self, n_remove: torch.Tensor) -> None:
        self.runner.rollback(n_remove)

    def append(self, slots: Sequence[int], seqs: Sequence[Sequence[int]], starts: Sequence[int]) -> None:
        """Feed each ``seqs[i]`` to row ``slots[i]``: rows past the live ones (new requests) are prefilled in groups
        of similar length by runners of their own and written into their rows (``replace_rows``); live rows that
        hold tokens get theirs in one forward of every live row, right-aligned, the others' columns holes."""
        seqs = self.map.seqs(seqs)
        fresh = [i for i, s in enumerate(slots) if s >= self.rows or starts[i] == 0]
        self._grow(max(slots, default=-1) + 1)
        for group in length_groups([len(seqs[i]) for i in fresh], PREFILL_PADDING, PREFILL_SLACK):
            rows = [fresh[j] for j in group]
            w = max(len(seqs[i]) for i in rows)
            part = CausalLMRunner(self.model, self.name)
            part.start(len(rows))
            if w:
                toks, valid = _right_aligned([seqs[i] for i in rows], w)
                step = chunk_columns(len(rows), w)
                for c in range(0, w, step):
                    self._timed(part.forward, toks[:, c: c + step], valid[:, c: c + step], 1)
            self.runner.replace_rows(torch.tensor([slots[i] for i in rows]), part)
        rest = [i for i in range(len(slots)) if i not in set(fresh) and seqs[i]]
        if rest:
            w = max(len(seqs[i]) for i in rest)
            toks = torch.zeros(self.rows, w, dtype=torch.int64)
            valid = torch.zeros(self.rows, w, dtype=torch.bool)
            sub, mask = _right_aligned([seqs[i] for i in rest], w)
            idx = torch.tensor([slots[i] for i in rest])
            toks[idx], valid[idx] = sub, mask
            self._timed(self.runner.forward, toks, valid, 1)

    def _grow(self, rows: int) -> None:
        """At least ``rows`` rows: rows this runner has not been given yet (requests the draft has not read) are
        appended as copies of row 0, which the first append to them replaces."""
        if rows <= self.rows:
            return
        if self.rows == 0:
            self.runner.start(rows)
        else:
            grow = rows - self.rows
            self.runner.select_rows(torch.cat([torch.arange(self.rows), torch.zeros(grow, dtype=torch.int64)]))
        self.rows = rows

    def select(self, order: Sequence[int], columns: Sequence[int]) -> None:
        self._grow(max(order, default=-1) + 1)
        if list(order) != list(range(self.rows)):
            self.runner.select_rows(torch.tensor(list(order), dtype=torch.int64))
        self.rows = len(order)

    def take(self, slots: Sequence[int], other: "HFBackend", rows: Sequence[int], columns: Sequence[int]) -> None:
        self._grow(max(slots) + 1)
        self.runner.replace_rows(torch.tensor(list(slots)), other.runner, rows=torch.tensor(list(rows)))

    def close(self) -> None:
        self.runner.close()


def _right_aligned(seqs: Sequence[Sequence[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences as ``[n, width]`` int64 padded with zeros on the left, and the mask of real tokens."""
    toks = torch.zeros(len(seqs), width, dtype=torch.int64)
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    for j, s in enumerate(seqs):
        if s:
            toks[j, width - len(s):] = torch.tensor(list(s), dtype=torch.int64)
            valid[j, width - len(s):] = True
    return toks, valid


def uses_lean(model, name: str, lean: bool = True) -> bool:
    """Whether :func:`backend_for` gives ``model`` (in the ``name`` role) a :class:`LeanBackend`: where ``lean`` and
    :func:`supports`."""
    return bool(lean) and supports(model)


def backend_for(model, name: str, lean: bool = True, vocab: Optional[int] = None):
    """The backend of ``model`` in the ``name`` role: a :class:`LeanBackend` where :func:`uses_lean`, else an
    :class:`HFBackend`; ``vocab``: the round's V where the model's embedding rows differ (:class:`VocabMap`)."""
    if uses_lean(model, name, lean):
        return LeanBackend(model, name, vocab=vocab)
    return HFBackend(model, name, vocab)
