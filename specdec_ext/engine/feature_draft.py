"""A draft that reads the target's hidden states (EAGLE, Li et al. 2024, "EAGLE: Speculative Sampling Requires
Rethinking Feature Uncertainty", section 3).

A draft model of its own sees only tokens; the target's last hidden state at a position already holds what the
target knows of the context. :class:`FeatureDraft` is one Llama decoder layer whose input at position t is
``fc([embedding(x_t), f_{t-1}])``: the token's embedding (the target's, shared) beside the feature of the position
before, where f is the target's final-norm output (what its LM head reads). Its own final-norm output at t predicts
f_t, and the target's output rows of the N ids the target emits most often (FR-Spec, ``subset_head.py``) turn it
into a distribution over x_{t+1}. Drafting k tokens ahead, the feature of a position the target has not verified is
the draft's own prediction of it.

In the engine (:class:`FeatureBackend`) the target's lean forward records its hidden states by position
(``LeanModel.tap``): prefill and every verification write the features of the positions they computed. Before a
draft step the backend recomputes the positions whose keys it computed from its own predicted features once the
target's are known (the accepted candidates of the last round: vLLM's and SGLang's EAGLE workers refill the draft's
cache the same way), in the same forward as the step's tokens. The draft's tokens are the round's candidates like
any draft's, so verification, and the output's distribution, do not change: lossless for any draft.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .backends import LeanBackend, _Timed
from .model import LeanModel


class FeatureDraft(torch.nn.Module):
    """An EAGLE draft (module docstring): ``model``, a one-layer ``LlamaForCausalLM`` whose token embedding is the
    target's and whose LM head is a :class:`~specdec_ext.engine.subset_head.SubsetLMHead` of the target's output rows
    (``training/draft_store.py`` attaches both), and ``fc``, ``Linear(2H, H)`` over ``[embedding, feature]``.

    Raises ValueError when ``fc`` is not ``[H, 2H]`` for the model's hidden size H."""

    kind = "eagle"

    def __init__(self, model, fc: torch.nn.Linear):
        super().__init__()
        H = model.config.hidden_size
        if tuple(fc.weight.shape) != (H, 2 * H):
            raise ValueError(f"FeatureDraft: fc must map 2H = {2 * H} features to H = {H}, got "
                             f"{list(fc.weight.shape[::-1])}")
        self.model, self.fc = model, fc
        self.config = model.config

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()

    def inputs(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The decoder layer's input ``[b, n, H]`` from tokens ``[b, n]`` int64 and the features of the positions
        before them ``[b, n, H]`` (zeros where there is none: position 0)."""
        e = self.model.get_input_embeddings()(tokens)
        return self.fc(torch.cat([e, features.to(e.dtype)], dim=-1))

    def forward(self, tokens: torch.Tensor, features: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced over whole sequences (training, and the tests' oracle): tokens ``[b, n]`` int64 at positions
        0 .. n - 1, ``features`` ``[b, n, H]`` the feature of each position before (row t holds f_{t-1}).
        Returns the subset logits ``[b, n, N]`` float32 and the predicted features ``[b, n, H]`` (final-norm
        outputs)."""
        out = self.model.model(inputs_embeds=self.inputs(tokens, features), attention_mask=attention_mask,
                               use_cache=False)
        hidden = out.last_hidden_state
        return self.model.get_output_embeddings().subset_logits(hidden).float(), hidden


def shifted(features: torch.Tensor) -> torch.Tensor:
    """``[b, n, H]`` features f_0 .. f_{n-1} -> the features each position reads, zeros, f_0 .. f_{n-2}."""
    return F.pad(features, (0, 0, 1, 0))[:, :-1]


class FeatureBackend(_Timed):
    """A :class:`FeatureDraft` over a static KV cache, reading the target's features (module docstring). The target
    must run on a :class:`~specdec_ext.engine.backends.LeanBackend`: its lean model's ``tap`` is set to this
    backend's record. ``vocab``: the round's V.

    Raises ValueError for a target backend that is not lean."""

    lean = False  # its steps read the host's per-row state: eager rounds only (no CUDA graph capture)

    def __init__(self, draft: FeatureDraft, target: LeanBackend, vocab: Optional[int] = None, name: str = "draft"):
        if not isinstance(target, LeanBackend):
            raise ValueError("a feature draft reads the target's hidden states through the lean forward: the target "
                             "must be a Llama, Qwen2 or Qwen3 model on one device (fast_target=True)")
        self.draft, self.name = draft, name
        self.inner = LeanBackend(draft.model, name, vocab=vocab)
        self.device = self.inner.device
        self.max_pos = self.inner.max_pos
        self.target = target
        tm: LeanModel = target.lean_model
        self._norm = lambda x: tm._rms(x, tm.final_norm)
        tm.tap = self._record
        self.H = draft.config.hidden_size
        self.store: Optional[torch.Tensor] = None  # [slots, columns + 1, H]: the target's feature at each position
        self.tokens: Optional[torch.Tensor] = None  # [slots, columns + 1] int64: the draft's token at each position
        self.own: Optional[torch.Tensor] = None  # [slots, H]: the draft's predicted feature after its last position
        self.lens: list = []  # per slot, the positions the draft's cache holds
        self.exact: list = []  # per slot, the leading positions computed from the target's features
        self.calls, self.seconds = 0, 0.0

    # ------------------------------------------------------------------ the target's features
    def _record(self, slots: torch.Tensor, starts: torch.Tensor, x: torch.Tensor) -> None:
        """``LeanModel.tap``: the target's final-norm output at positions ``starts[i] ..`` of slot ``slots[i]``."""
        if self.store is None:
            return
        b, n, _ = x.shape
        cols = (starts.view(b, 1) + torch.arange(n, device=starts.device)).clamp_max(self.store.shape[1] - 1)
        self.store[slots.view(b, 1), cols] = self._norm(x).to(self.store.dtype)

    def _alloc(self, slots: int, columns: int, keep: int = 0) -> None:
        old = (self.store, self.tokens, self.own)
        dt = self.draft.dtype
        self.store = torch.zeros(slots, columns + 1, self.H, dtype=dt, device=self.device)
        self.tokens = torch.zeros(slots, columns + 1, dtype=torch.int64, device=self.device)
        self.own = torch.zeros(slots, self.H, dtype=dt, device=self.device)
        if keep and old[0] is not None:
            c = min(old[0].shape[1], columns + 1)
            self.store[:keep, :c] = old[0][:keep, :c]
            self.tokens[:keep, :c] = old[1][:keep, :c]
            self.own[:keep] = old[2][:keep]
        self.lens = self.lens[:keep] + [0] * (slots - keep)
        self.exact = self.exact[:keep] + [0] * (slots - keep)

    # ------------------------------------------------------------------ the backend interface
    def start(self, slots: int, columns: int) -> None:
        self.inner.start(slots, columns)
        c = self.inner.cache
        self._alloc(c.slots, c.max_len)

    def new_bytes(self, slots: int, columns: int) -> int:
        per_column = self.H * self.draft.fc.weight.element_size() + 8  # a feature and a token id
        return self.inner.new_bytes(slots, columns) + slots * (columns + 1) * per_column

    def reserve(self, slots: int, columns: int, live: int) -> None:
        self.inner.reserve(slots, columns, live)
        c = self.inner.cache
        if self.store is None or c.slots > self.store.shape[0] or c.max_len + 1 > self.store.shape[1]:
            self._alloc(c.slots, c.max_len, live)

    def rollback(self, n_remove: torch.Tensor) -> None:
        """Drop the last ``n_remove[b]`` positions of live row b (``[B]`` int64): the cache's lengths are set by
        the next forward of each row."""
        for b, n in enumerate(n_remove.tolist()):
            self.lens[b] -= n
            self.exact[b] = min(self.exact[b], self.lens[b])

    def empty_rows(self, start: int, stop: int) -> None:
        self.inner.empty_rows(start, stop)
        for b in range(start, stop):
            self.lens[b] = self.exact[b] = 0

    def append(self, slots: Sequence[int], seqs: Sequence[Sequence[int]], starts: Sequence[int]) -> None:
        """Feed each ``seqs[i]`` to slot ``slots[i]`` after its first ``starts[i]`` positions: the tokens are kept and
        computed by the next forward of the row (which recomputes from the first position not computed from the
        target's features, and the target has computed them all by then)."""
        for s, seq, st in zip(slots, seqs, starts):
            if seq:
                self.tokens[s, st: st + len(seq)] = torch.tensor(list(seq), dtype=torch.int64, device=self.device)
            self.lens[s] = st + len(seq)
            self.exact[s] = min(self.exact[s], st)

    def select(self, order: Sequence[int], columns: Sequence[int]) -> None:
        self.inner.cache.lengths[: len(self.lens)] = torch.tensor(self.exact, device=self.device)
        self.inner.select(order, [min(c, self.exact[o]) for o, c in zip(order, columns)])
        idx = torch.tensor(list(order), dtype=torch.int64, device=self.device)
        for t in (self.store, self.tokens, self.own):
            t[: len(order)] = t[idx]
        self.lens = [self.lens[o] for o in order] + self.lens[len(order):]
        self.exact = [self.exact[o] for o in order] + self.exact[len(order):]

    def take(self, slots, other, rows, columns) -> None:
        raise ValueError("a feature draft does not prefill ahead (admission='ahead'): it reads the target's features")

    def close(self) -> None:
        """Nothing to free: the caches are kept for the next call."""

    def forward(self, tokens: torch.Tensor, keep: int = 1, width: Optional[int] = None, rows=None,
                start: Optional[int] = None):
        """The draft over ``tokens`` ``[B, n]`` at each live row's next positions (``rows``: must be None, the live
        rows 0 .. B - 1): ``(logits [B, keep, V] float32, hidden [B, keep, H])``. Each row first recomputes its
        positions not computed from the target's features; a position whose feature the target has not computed
        reads the draft's own prediction (one token per row, the step after the last)."""
        if rows is not None:
            raise ValueError("FeatureBackend.forward: the live rows only (rows=None)")
        return self._timed(self._forward, tokens, keep)

    step = forward

    @torch.inference_mode()
    def _forward(self, tokens: torch.Tensor, keep: int):
        B, n = tokens.shape
        tlen = self.target.cache.lengths[:B].tolist()
        groups: dict = {}
        for b in range(B):
            L, e, T = self.lens[b], self.exact[b], tlen[b]
            # recompute from the first position not computed from the target's features, where the target has the
            # feature it reads (after a verification); else only the new positions
            first = e if e < L and e - 1 < T else L
            last = L + n - 1
            own = last - 1 >= T  # the last position reads the draft's own prediction: one new token, no recompute
            if own and (n != 1 or first != L):
                raise RuntimeError(f"FeatureBackend: row {b} asks for {n} positions from {L} with the target's "
                                   f"features up to {T}")
            self.tokens[b, L: L + n] = tokens[b]
            groups.setdefault((last + 1 - first, own), []).append((b, first))
        logits = torch.empty(B, keep, self.inner.map.vocab, dtype=torch.float32, device=self.device)
        hidden = torch.empty(B, keep, self.H, dtype=self.draft.dtype, device=self.device)
        cache = self.inner.cache
        for (m, own), part in groups.items():
            rows = [b for b, _ in part]
            idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
            first = torch.tensor([f for _, f in part], device=self.device)  # [g]
            cols = first.view(-1, 1) + torch.arange(m, device=self.device)  # [g, m]: the positions computed
            toks = self.tokens[idx.view(-1, 1), cols]
            feats = self.store[idx.view(-1, 1), (cols - 1).clamp_min(0)] * (cols > 0).unsqueeze(-1).to(self.store.dtype)
            if own:
                feats[:, -1] = self.own[idx]
            cache.lengths[idx] = first
            ordered = rows == list(range(rows[0], rows[0] + len(rows)))
            sel = slice(rows[0], rows[0] + len(rows)) if ordered else idx
            width = max(f for _, f in part) + m
            out = self.inner.lean_model.forward(cache, toks, sel, keep, width, None, self.draft.inputs(toks, feats))
            out, hn = self.inner.map.logits(out)
            logits[idx], hidden[idx] = out, hn
            self.own[idx] = hn[:, -1]
            for b, f in part:
                if f == self.exact[b]:  # every position before the first computed one is the target's
                    self.exact[b] = self.lens[b] + n - (1 if own else 0)
                self.lens[b] += n
        return logits, hidden
