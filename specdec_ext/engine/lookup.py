"""Prompt lookup: candidates copied from the request's own context, with no draft model (n-gram proposals).

A request's next tokens often repeat a stretch of its prompt or of what it generated (code that reuses its
identifiers, an answer that quotes its question). :class:`PromptLookup` finds the longest suffix of a row's context,
``ngram_max`` tokens down to ``ngram_min``, that occurred earlier in the context, and proposes the tokens that
followed its most recent earlier occurrence (Saxena 2023, transformers' ``prompt_lookup_num_tokens``; vLLM's
``ngram`` method; llama.cpp's lookup decoding).

In the engine the proposer is the draft (``SpeculativeGenerator(target, draft="ngram")``): before each round the
scheduler asks it for each row's continuation (:meth:`PromptLookup.propose`, on the host, from an index of the row's
n-grams kept up to date as tokens are appended), caps each row's room at its continuation's length (no match: the
row does not draft; no row matches: a plain step), and the :class:`LookupBackend` hands the round its draft steps'
logits: 0 at the copied token and :data:`NEG` elsewhere, a one-hot proposal distribution q. Verification is then the
usual rejection sampling: candidate c is accepted with probability min(1, p(c) / q(c)) = p(c), and at a rejection
the residual norm(max(0, p - q)) is p with c removed and renormalised, so the output follows the target exactly
(Leviathan et al. 2023, Thm. 1, for any proposal distribution); greedy, a candidate is accepted while it is the
target's argmax. The logits are finite, not -inf: a logits processor that masks the copied token leaves the uniform
distribution over the other ids, still a proposal distribution the verification reads.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

NEG = -1e4  # the logit of every id but the copied one: exp(NEG / T) is 0 in float32 for any temperature T below 100


class LookupState:
    """One request's n-gram index: for each n in the proposer's range, the most recent position that followed each
    n-gram of the context (only n-grams that something followed), and how much of the context it has read."""

    __slots__ = ("seen", "read")

    def __init__(self, sizes: Sequence[int]):
        self.seen = {n: {} for n in sizes}
        self.read = 0  # the n-grams ending before this position are indexed (PromptLookup.update)


class PromptLookup:
    """The prompt-lookup proposer (module docstring): candidates are the tokens that followed the most recent earlier
    occurrence of the context's longest suffix of ``ngram_max`` down to ``ngram_min`` tokens, at most ``k_max`` a
    round (the policy's cap and each row's room cap it further).

    Raises ValueError for ``ngram_min`` < 1, ``ngram_max`` < ``ngram_min`` or ``k_max`` < 1 (naming the argument)."""

    name = "ngram"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, k_max: int = 8):
        for arg, v in (("ngram_min", ngram_min), ("ngram_max", ngram_max), ("k_max", k_max)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{arg} must be an integer >= 1 (tokens), got {v!r}")
        if ngram_max < ngram_min:
            raise ValueError(f"ngram_max must be >= ngram_min ({ngram_min}), got {ngram_max}")
        self.ngram_min, self.ngram_max, self.k_max = ngram_min, ngram_max, k_max
        self.sizes = tuple(range(ngram_max, ngram_min - 1, -1))  # longest first

    def __repr__(self) -> str:
        return f"PromptLookup(ngram_min={self.ngram_min}, ngram_max={self.ngram_max}, k_max={self.k_max})"

    def new_state(self) -> LookupState:
        return LookupState(self.sizes)

    def update(self, state: LookupState, ctx: Sequence[int]) -> None:
        """Index the n-grams of ``ctx`` that end before its last token (each has a next token) and were not yet
        indexed; a later occurrence replaces an earlier one (the most recent is proposed). The context only grows
        between calls (a request's prompt, then its emitted tokens)."""
        end = len(ctx) - 1  # n-grams ending at positions e < end, i.e. ctx[e - n + 1 .. e] followed by ctx[e + 1]
        for e in range(state.read, end):
            for n in self.sizes:
                if e + 1 >= n:
                    state.seen[n][tuple(ctx[e + 1 - n: e + 1])] = e + 1
        state.read = max(state.read, end)

    def propose(self, state: LookupState, ctx: Sequence[int], k: int) -> tuple[list, int]:
        """The continuation for ``ctx`` (at most ``min(k, k_max)`` tokens) and the length n of the suffix it matched
        (0 and an empty list where no suffix of ``ngram_min`` tokens or more occurred before)."""
        self.update(state, ctx)
        k = min(k, self.k_max)
        if k <= 0:
            return [], 0
        L = len(ctx)
        for n in self.sizes:
            if L < n:
                continue
            at = state.seen[n].get(tuple(ctx[L - n:]))
            if at is not None:
                return list(ctx[at: at + k]), n
        return [], 0


class LookupBackend:
    """The draft backend of a :class:`PromptLookup` proposer: no model, no KV cache. The scheduler sets each round's
    candidates (:meth:`set_candidates`); draft step k's forward returns each row's one-hot logits for its k-th
    candidate, ``[B, 1, V]`` float32 (0 at the candidate, :data:`NEG` elsewhere; token 0 for rows with fewer
    candidates, which do not draft that step). Cache operations do nothing: the proposer reads the scheduler's host
    contexts."""

    lean = False
    proposes = True

    def __init__(self, proposer: PromptLookup, vocab: int, device: torch.device, name: str = "draft"):
        self.proposer, self.vocab, self.device, self.name = proposer, int(vocab), torch.device(device), name
        self.calls, self.seconds = 0, 0.0
        self._cands: Optional[torch.Tensor] = None  # [B, K] int64
        self._step = 0
        self.matched: list = []  # per live row, the length of the suffix its last proposal matched (0: none)

    def propose(self, rows: Sequence[tuple], room: Sequence[int]) -> list:
        """The round's candidates: for each live row ``(state, ctx)`` (its :class:`LookupState` and context) at most
        its ``room`` tokens from :meth:`PromptLookup.propose`, set for the draft steps (:meth:`set_candidates`).
        Returns each row's candidate count, its room for the round (0 where nothing matched: the row does not draft,
        and a round where no row matches is a plain step); :attr:`matched` keeps each row's matched suffix length."""
        found = [self.proposer.propose(state, ctx, k) for (state, ctx), k in zip(rows, room)]
        cands = [c for c, _ in found]
        self.matched = [n for _, n in found]
        self.set_candidates(cands)
        return [len(c) for c in cands]

    def set_candidates(self, rows: Sequence[Sequence[int]]) -> None:
        """The round's candidates, a list per live row (shorter rows padded with token 0)."""
        K = max((len(r) for r in rows), default=0)
        self._cands = torch.tensor([list(r) + [0] * (K - len(r)) for r in rows], dtype=torch.int64,
                                   device=self.device).view(len(rows), K)
        self._step = 0

    def forward(self, tokens: torch.Tensor, keep: int = 1, width=None, rows=None, start=None):
        """The next draft step's one-hot logits ``[B, 1, V]`` float32 and no hidden state (class docstring)."""
        B = tokens.shape[0]
        cands = self._cands
        col = cands[:, self._step] if cands is not None and self._step < cands.shape[1] else \
            torch.zeros(B, dtype=torch.int64, device=self.device)
        if col.shape[0] < B:  # a batch bucket's padding rows
            col = torch.cat([col, col.new_zeros(B - col.shape[0])])
        self._step += 1
        logits = torch.full((B, 1, self.vocab), NEG, dtype=torch.float32, device=self.device)
        logits.scatter_(2, col.view(B, 1, 1), 0.0)
        return logits, None

    step = forward

    # a proposer has no cache: what the scheduler asks of a model's backend is a no-op here
    def start(self, slots: int, columns: int) -> None:
        pass

    def new_bytes(self, slots: int, columns: int) -> int:
        return 0

    def reserve(self, slots: int, columns: int, live: int) -> None:
        pass

    def rollback(self, n_remove: torch.Tensor) -> None:
        pass

    def empty_rows(self, start: int, stop: int) -> None:
        pass

    def append(self, slots, seqs, starts) -> None:
        pass

    def select(self, order, columns) -> None:
        pass

    def take(self, slots, other, rows, columns) -> None:
        pass

    def close(self) -> None:
        self._cands = None
