"""A user's logits processor on the host path of a round (``generate(logits_processor=...)``): applied to the draft's
and the target's logits alike, each row and position with its own prefix, so the output follows the target's
processed distribution (docs/design.md, The engine)."""

from __future__ import annotations

from typing import Callable, Optional

import torch


class HostProcessor:
    """A logits processor ``(input_ids [1, t] int64, scores [1, V] float32) -> scores`` applied row by row, each row
    and position with its own prefix (the row's ``bases`` entry, then the candidates before the position): the
    host path of a round (the candidates are read to build the prefixes)."""

    def __init__(self, fn: Callable, bases: list):
        self.fn, self.bases = fn, bases

    def _rows(self, logits: torch.Tensor, cands: Optional[list]) -> torch.Tensor:
        out = []
        for i, base in enumerate(self.bases):
            prefix = list(base) + ([int(c) for c in cands[i]] if cands is not None else [])
            ids = torch.tensor([prefix], dtype=torch.int64, device=logits.device)
            out.append(self.fn(ids, logits[i: i + 1].float().clone())[0])
        return torch.stack(out)

    def draft(self, logits: torch.Tensor, cands: list) -> torch.Tensor:
        """The draft's logits ``[B, V]`` after the candidates ``cands`` (a list of ``[B]`` tensors) so far."""
        so_far = torch.stack(cands, 1).tolist() if cands else None
        return self._rows(logits, so_far)

    def target(self, logits: torch.Tensor, cands: torch.Tensor) -> torch.Tensor:
        """The target's logits ``[B, K + 1, V]``, position i after the first i candidates of ``cands`` ``[B, K]``."""
        c = cands.tolist()
        return torch.stack([self._rows(logits[:, i], [row[:i] for row in c]) for i in range(logits.shape[1])], 1)
