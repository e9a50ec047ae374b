"""A Hugging Face causal LM with its KV cache, attention mask and per-row positions.

Rows of a batch keep their own length without per-row cache surgery: every fed position stays in
the (shared-length) ``DynamicCache``; positions a row rejects are masked out (attention mask 0) and
do not advance that row's position ids. The tail that every row rejected is cropped for real, so
with batch size 1 this is plain cropping. Only the models are touched here; policies never are.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
from transformers import DynamicCache


def model_device(model) -> torch.device:
    emb = model.get_input_embeddings()
    return emb.weight.device


def usable_device(model, name: str) -> torch.device:
    """The device of ``model``'s input embeddings; ValueError if its weights are not loaded (meta)."""
    device = model_device(model)
    if device.type == "meta":
        raise ValueError(f"the {name} model is on the meta device (weights not loaded): no way to run it")
    return device


class TimedRunner:
    """Base of the model runners: ``forward`` feeds tokens (see ``_forward``) and adds the wall time
    spent inside the call to ``seconds``. The attention-mask bookkeeping of rows with holes lives here;
    subclasses only crop their own KV storage (``_crop_to``).

    State: ``mask`` ``[B, C]`` (nonzero = valid position; its width is the cache length) and
    ``next_pos`` ``[B]`` (each row's count of valid positions, i.e. its next position id)."""

    seconds = 0.0

    def forward(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._forward(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def _crop_to(self, length: int) -> None:
        raise NotImplementedError

    def _trim(self, length: int) -> None:
        if length < self.length:
            self._crop_to(length)
            self.mask = self.mask[:, :length]

    def rollback(self, n_remove: torch.Tensor) -> None:
        """Drop the last ``n_remove[b]`` positions of row b (all fed in this round, all valid): they become
        holes, and the tail that every row dropped is cropped for real."""
        n_remove = n_remove.to(self.device)
        C = self.length
        cols = torch.arange(C, device=self.device).unsqueeze(0)
        self.mask = self.mask.masked_fill(cols >= (C - n_remove).unsqueeze(1), 0)
        self.next_pos = self.next_pos - n_remove
        self._trim(C - (int(n_remove.min()) if n_remove.numel() else 0))

    def _select_mask_rows(self, idx: torch.Tensor) -> None:
        """Keep rows ``idx`` of the mask and positions, then drop tail columns that are holes in every row."""
        self.mask = self.mask[idx]
        self.next_pos = self.next_pos[idx]
        if self.mask.numel():
            valid_cols = self.mask.any(0).nonzero()
            self._trim(int(valid_cols.max()) + 1 if valid_cols.numel() else 0)


class CausalLMRunner(TimedRunner):
    def __init__(self, model, name: str):
        self.model = model
        self.name = name
        self.device = usable_device(model, name)
        self.cache: Optional[DynamicCache] = None
        self.mask: Optional[torch.Tensor] = None      # [B, C] int64
        self.next_pos: Optional[torch.Tensor] = None  # [B] int64
        self.calls = 0
        self.seconds = 0.0  # wall time inside forward()
        self._hidden: Optional[torch.Tensor] = None
        self._hook = None

    # ------------------------------------------------------------------------------------
    def start(self, batch_size: int) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.mask = torch.zeros(batch_size, 0, dtype=torch.int64, device=self.device)
        self.next_pos = torch.zeros(batch_size, dtype=torch.int64, device=self.device)

    def close(self) -> None:
        self.cache = self.mask = self.next_pos = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @torch.inference_mode()
    def _forward(self, tokens: torch.Tensor, valid: Optional[torch.Tensor] = None, keep: int = 1,
                hidden: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Feed ``tokens`` ``[B, n]`` (``valid`` ``[B, n]`` bool marks real tokens; others become holes).

        Returns float32 logits of the last ``keep`` positions ``[B, keep, V]`` and, if ``hidden``, the
        input of the LM head at those positions ``[B, keep, H]``.
        """
        tokens = tokens.to(self.device)
        B, n = tokens.shape
        if valid is None:
            valid = torch.ones(B, n, dtype=torch.bool, device=self.device)
        valid = valid.to(self.device)
        steps = valid.long().cumsum(-1)
        position_ids = self.next_pos.unsqueeze(1) + (steps - 1).clamp_min(0)
        self.mask = torch.cat([self.mask, valid.long()], dim=1)
        if hidden and self._hook is None:
            self._hook = self.model.get_output_embeddings().register_forward_pre_hook(self._capture)
        self._hidden = None
        out = self.model(input_ids=tokens, attention_mask=self.mask, position_ids=position_ids,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=keep)
        self.calls += 1
        self.next_pos = self.next_pos + steps[:, -1]
        h = None
        if hidden:
            h = self._hidden[:, -keep:]
        return out.logits[:, -keep:].float(), h

    def _capture(self, module, args):
        self._hidden = args[0]

    def _crop_to(self, length: int) -> None:
        self.cache.crop(length - self.length)

    def select_rows(self, index: torch.Tensor) -> None:
        idx = index.to(self.device)
        self.cache.batch_select_indices(idx)
        self._select_mask_rows(idx)
