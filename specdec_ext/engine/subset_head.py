"""An LM head over a subset of the vocabulary, for drafts (FR-Spec, Zhao et al. 2025, section 3).

A small draft's output layer can cost more than the rest of it: SmolLM2-135M's tied 49,152 x 576 embedding is
113 MB in float32, against about 28 MB for two of its decoder layers. The draft then computes logits only for the
target's N most frequent tokens and gives every other id probability 0: :class:`SubsetLMHead` multiplies by the N
rows and scatters the result into ``[..., V]`` logits filled with -inf, so the draft still speaks the target's
vocabulary of V ids and every part of the engine (sampling, verification, acceptance heads) sees an ordinary draft.
Speculation stays lossless: the verification reads the draft's distribution as it is, zeros included; a token
outside the subset is simply never proposed.
"""

from __future__ import annotations

import torch


class SubsetLMHead(torch.nn.Module):
    """Logits ``[..., V]`` (float -inf outside ``token_ids``) from hidden states ``[..., H]``.

    Args:
        weight: ``[N, H]`` the output rows of the N ids, any float dtype.
        token_ids: ``[N]`` int64, distinct ids in ``[0, vocab_size)``.
        vocab_size: V, the width of the logits.

    A quantized draft's head (``engine.weights.quantize``) holds its rows only packed: :meth:`hold` replaces
    ``weight`` by ``linear``, an ``engine.packed.PackedLinear`` of N outputs.

    Raises ValueError for ids out of range or repeated, or a weight whose rows are not one per id."""

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        if weight.dim() != 2 or weight.shape[0] != ids.numel():
            raise ValueError(f"SubsetLMHead: weight must be [N, H] with N = len(token_ids) = {ids.numel()}, "
                             f"got {list(weight.shape)}")
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"SubsetLMHead: token_ids must be distinct ids in [0, {vocab_size}), got {ids.numel()} ids "
                             f"in [{int(ids.min()) if ids.numel() else '-'}, {int(ids.max()) if ids.numel() else '-'}]")
        self.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
        self.register_buffer("token_ids", ids.to(weight.device))
        self.vocab_size = int(vocab_size)
        self.in_features, self.out_features = weight.shape[1], int(vocab_size)
        self.linear = None  # the packed rows' module, once held (hold())

    @property
    def rows(self) -> int:
        """N, the subset's size (the rows the head multiplies)."""
        return self.token_ids.numel()

    def hold(self, linear: torch.nn.Module) -> None:
        """Multiply by ``linear`` (``[..., H]`` -> ``[..., N]``: the rows packed) instead of ``weight``, dropped."""
        del self.weight
        self.linear = linear

    def subset_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` hidden states -> ``[..., N]`` logits of the subset's ids, in the hidden states' dtype."""
        return torch.nn.functional.linear(hidden, self.weight) if self.linear is None else self.linear(hidden)

    def scatter(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., N]`` subset logits -> ``[..., V]``, -inf outside the subset."""
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.token_ids, logits)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.scatter(self.subset_logits(hidden))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, subset={self.token_ids.numel()}, vocab_size={self.vocab_size}"
