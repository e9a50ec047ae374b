"""A Hugging Face causal LM with its KV cache, attention mask and per-row positions.

Rows of a batch keep their own length without per-row cache surgery: every fed position stays in
the (shared-length) KV cache (a ``DynamicCache`` whose layers append in place: ``kv_cache.GrowingCache``);
positions a row rejects are masked out (attention mask 0) and do not advance that row's position ids. The
tail that every row rejected is cropped for real, so with batch size 1 this is plain cropping. Only the
models are touched here; policies never are.

Sliding-window models (Mistral, Gemma-2/3, Qwen2 with ``use_sliding_window``, ...): transformers'
sliding cache layers keep only the last W - 1 positions, so a rejected candidate cannot be cropped once
the window is full, and their masks count the window in cache columns, which holes would shorten. For
them the runner keeps a full (croppable) cache and builds the attention masks itself from each row's
position ids: a query at position t sees the valid keys at positions t - W < s <= t in sliding layers
(transformers' window), and every valid key up to t in full-attention layers. The model receives a
prepared 4D mask (all layers sliding) or one per layer type (hybrid models whose forward accepts that).
Models whose attention cannot be expressed so (different windows per layer, chunked attention, a
hybrid model that takes a single mask, flash attention) are refused up front, naming the model.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

from . import onednn_linear
from .kv_cache import GrowingCache, GrowingLayer, copy_rows
from .onednn_linear import PackedLinears


def model_device(model) -> torch.device:
    """The device of ``model``'s input embedding (a quantized model's reads packed blocks: theirs)."""
    emb = model.get_input_embeddings()
    held = getattr(emb, "weight", None)
    return (held if held is not None else emb.packed).device


def cache_keyword(model) -> str:
    """The keyword under which ``model``'s forward takes its KV cache: ``"cache"`` (transformers 5.24 on, where
    ``past_key_values`` warns of its removal in 5.40) or ``"past_key_values"`` (earlier 5.x)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def usable_device(model, name: str) -> torch.device:
    """The device of ``model``'s input embeddings; ValueError if its weights are not loaded (meta)."""
    device = model_device(model)
    if device.type == "meta":
        raise ValueError(f"the {name} model is on the meta device (weights not loaded): no way to run it")
    return device


# The backends torch's scaled_dot_product_attention may pick inside the runners' forwards on a CUDA device. cuDNN's
# attention is left out: it builds an execution plan per new shape, and decoding makes a new shape every step (the
# cache grows by one column or by a round's accepted tokens). Measured on an H100 (torch 2.11+cu130, the bundled
# pair in bf16, 4 HumanEval prompts x 64 tokens, greedy; 1bd1639:docs/results/cuda_sdpa_backends.json, the arms of
# 1bd1639:bench/cuda_sdpa_backends.py): fixed K = 4 ran at 11.5 tokens/s on first sight of the shapes and 120 once cuDNN
# had cached their plans, against 150 and 141 without cuDNN; transformers' own plain decoding 25 / 115 against
# 93 / 100.
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_backends(device: torch.device):
    """The context a runner's forward runs in: on CUDA, ``sdpa_kernel(CUDA_SDPA_BACKENDS)`` (set the module's
    ``CUDA_SDPA_BACKENDS`` to None to leave torch's choice alone); elsewhere nothing."""
    if device.type != "cuda" or CUDA_SDPA_BACKENDS is None:
        return contextlib.nullcontext()
    return sdpa_kernel(CUDA_SDPA_BACKENDS)


def pad_front(t: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    """``t`` with zeros put before it along ``dim`` up to ``width``."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim)


def new_column_mask(valid: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, 1, n, C]`` bool attention mask of a forward's n new columns over a cache whose valid columns are
    ``valid`` ``[B, C]`` (nonzero = valid, the new columns last): query i (column C - n + i) sees its row's valid
    columns up to its own."""
    C = valid.shape[1]
    cols = torch.arange(C, device=valid.device)
    causal = cols.unsqueeze(0) <= cols[C - n :].unsqueeze(1)  # [n, C]
    return (valid.bool().unsqueeze(1) & causal.unsqueeze(0)).unsqueeze(1)


def sliding_layout(model) -> Optional[dict]:
    """None for a model without sliding-window attention, else ``{"window": W, "types": set of layer types,
    "dict": whether the forward takes one mask per layer type}``.

    Raises ValueError (naming the model and the reason) for attention this runner cannot roll back exactly."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    name = f"{type(model).__name__} ({getattr(cfg, 'model_type', '?')})"
    if types is not None and any(t not in ("full_attention", "sliding_attention") for t in types):
        raise ValueError(f"{name} has attention layers of types {sorted(set(types))}: speculative rollback supports "
                         "full and sliding-window attention only")
    if types is not None and "sliding_attention" not in types:
        return None
    if window is None or (getattr(cfg, "use_sliding_window", True) is False):
        return None
    per_layer = {getattr(c, "sliding_window", window) for c in getattr(cfg, "per_layer_config", []) or []}
    if len(per_layer - {None}) > 1:
        raise ValueError(f"{name} has different sliding windows per layer {sorted(per_layer - {None})}: not supported")
    if getattr(cfg, "_attn_implementation", None) not in (None, "eager", "sdpa", "specdec_decode"):
        raise ValueError(f"{name} uses attention {cfg._attn_implementation!r}; speculative rollback of a sliding-window "
                         "model needs 'sdpa', 'eager' or 'specdec_decode' (load it with attn_implementation='sdpa')")
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None) or getattr(model, "model", None)
    takes_dict = base is not None and "causal_mask_mapping := attention_mask, dict" in inspect.getsource(type(base).forward)
    kinds = set(types) if types is not None else {"sliding_attention"}
    if len(kinds) > 1 and not takes_dict:
        raise ValueError(f"{name} mixes full and sliding-window layers but its forward takes a single attention mask: "
                         "speculative rollback cannot give each kind of layer its own mask")
    return {"window": int(window), "types": kinds, "dict": takes_dict and len(kinds) > 1}


class CausalLMRunner:
    """``model`` (a transformers causal LM) with its KV cache and rows (module docstring): ``mask`` ``[B, C]``
    (nonzero = valid position; its width is the cache length) and ``next_pos`` ``[B]`` (each row's count of valid
    positions, i.e. its next position id). ``packed``: run its
    ``torch.nn.Linear`` layers through oneDNN with weights packed once (``engine/onednn_linear.py``; False:
    ``F.linear``; None: as ``onednn_linear.wanted`` decides: a CPU float32 model of at most 2 GiB of linear weights).

    Raises:
        ValueError: ``model``'s weights are not loaded (meta device), or ``packed=True`` where oneDNN cannot."""

    _state = ("cache", "mask", "next_pos", "col_pos")

    def __init__(self, model, name: str, packed: Optional[bool] = None):
        self.model = model
        self.name = name
        self.device = usable_device(model, name)
        self.linears = PackedLinears(model) if onednn_linear.wanted(model, packed) else None
        self.layout = sliding_layout(model)
        self.cache_keyword = cache_keyword(model)
        self.col_pos: Optional[torch.Tensor] = None   # [B, C] position id of every cache column (sliding models)
        self.cache: Optional[DynamicCache] = None
        self.mask: Optional[torch.Tensor] = None      # [B, C] int64
        self.next_pos: Optional[torch.Tensor] = None  # [B] int64
        self._hidden: Optional[torch.Tensor] = None
        self._hook = None

    # ------------------------------------------------------------------------------------
    def start(self, batch_size: int) -> None:
        # sliding-window models: full layers, which can be cropped; the masks impose the window
        self.cache = GrowingCache() if self.layout else GrowingCache(config=self.model.config)
        self.mask = torch.zeros(batch_size, 0, dtype=torch.int64, device=self.device)
        self.next_pos = torch.zeros(batch_size, dtype=torch.int64, device=self.device)
        self.col_pos = torch.zeros(batch_size, 0, dtype=torch.int64, device=self.device)

    def close(self) -> None:
        self.cache = self.mask = self.next_pos = self.col_pos = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def forward(self, *args, **kwargs):
        """:meth:`_forward` with the CUDA attention backends of :func:`sdpa_backends`."""
        with sdpa_backends(self.device):
            return self._forward(*args, **kwargs)

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def _trim(self, length: int) -> None:
        if length < self.length:
            self._crop_to(length)
            self.mask = self.mask[:, :length]

    def rollback(self, n_remove: torch.Tensor) -> None:
        """Drop the last ``n_remove[b]`` valid positions of row b (all fed in this round): they become holes,
        and the tail of columns that are holes in every row is cropped for real. A row that sat out some of
        the round's forwards (a hole in their columns) loses its own last valid positions, not those columns."""
        n_remove = n_remove.to(self.device)
        if not n_remove.numel() or int(n_remove.max()) == 0:
            return
        valid = self.mask.bool()
        from_end = valid.flip(1).long().cumsum(1).flip(1)  # valid positions at or after each column, per row
        self.mask = self.mask.masked_fill(valid & (from_end <= n_remove.unsqueeze(1)), 0)
        self.next_pos = self.next_pos - n_remove
        self._trim_holes()

    def _trim_holes(self) -> None:
        """Crop the tail columns that are holes in every row."""
        valid_cols = self.mask.any(0).nonzero()
        self._trim(int(valid_cols.max()) + 1 if valid_cols.numel() else 0)

    def _select_mask_rows(self, idx: torch.Tensor) -> None:
        """Keep rows ``idx`` of the mask and positions, then drop the columns, at either end, that are holes
        in every row (the rows that left held them)."""
        self.mask = self.mask[idx]
        self.next_pos = self.next_pos[idx]
        if self.mask.numel():
            self._trim_holes()
            self._trim_front()

    def _trim_front(self) -> None:
        """Drop the leading columns that are holes in every row (positions are explicit, so nothing shifts)."""
        valid_cols = self.mask.any(0).nonzero()
        n = int(valid_cols.min()) if valid_cols.numel() else 0
        if n:
            self._drop_front(n)
            self.mask = self.mask[:, n:]

    @torch.inference_mode()
    def replace_rows(self, slots: torch.Tensor, other: "CausalLMRunner", rows: Optional[torch.Tensor] = None) -> None:
        """Continuous batching: the rows at positions ``slots`` (``[n]`` int64, requests that finished) take the n
        rows of ``other`` (a runner of the same model that has just read the new requests' prompts), in place.
        Each new row's cache is written right-aligned into its slot (its positions are its own) and the slot's
        older columns become holes, so only the new rows' data moves; the whole cache is copied only when a new
        prompt is wider than the cache (it is padded on the left); ``other`` is spent. An ``other`` that has read
        nothing (length 0) empties the slots.
        Columns that are holes in every row are then dropped at both ends. Where ``slots`` is every row in order,
        this runner takes ``other``'s state as it is (nothing is copied).

        With ``rows`` (``[n]`` int64, rows of ``other``), only those rows are written, from their first column that
        is not a hole in all of them, and ``other`` stays usable (admission ahead takes a staged runner's rows a few
        at a time). ``rows`` that are every row of ``other`` in order are as no ``rows`` (``other`` is spent)."""
        if type(other) is not type(self) or other.model is not self.model:
            raise ValueError("replace_rows: the other runner must run the same model with the same runner class")
        if rows is not None and rows.tolist() != list(range(other.mask.shape[0])):
            src = rows.to(other.mask.device)
            valid_cols = other.mask[src].bool().any(0).nonzero()
            self._write(slots, other, src, int(valid_cols.min()) if valid_cols.numel() else other.length)
        elif slots.tolist() == list(range(self.mask.shape[0])) == list(range(other.mask.shape[0])):
            # every row, in order (plain decoding's requests finish together): the result is ``other`` itself, so
            # take its state instead of writing every row of it into this cache (bundled pair, fp32 target, plain
            # decoding of 128 HumanEval requests at B = 64 on a 2-core CPU: 0.06 s for the refill where writing the
            # rows took 0.52-0.92 s, the whole target cache copied)
            for name in self._state:
                setattr(self, name, getattr(other, name))
            other.close()
            return
        else:
            self._write(slots, other, None, 0)
            other.close()
        self._trim_holes()  # an empty ``other`` (rows the draft reads later) leaves the slots' tail columns as holes
        self._trim_front()

    def _write(self, slots: torch.Tensor, other: "CausalLMRunner", src: Optional[torch.Tensor], lead: int) -> None:
        """Rows ``src`` of ``other`` (all: None), columns ``lead`` on, into rows ``slots``: mask, positions, KV."""
        w = other.length - lead
        if w > self.length:
            self._pad_front(w - self.length)
            self.mask = pad_front(self.mask, w)
        idx = slots.to(self.device)
        width = self.length
        theirs = other.mask if src is None else other.mask[src]
        pos = other.next_pos if src is None else other.next_pos[src]
        self.mask = self.mask.clone()
        self.mask[idx] = 0
        self.mask[idx, width - w :] = theirs[:, lead:].to(self.mask.dtype)
        self.next_pos = self.next_pos.clone()
        self.next_pos[idx] = pos.to(self.next_pos.device)
        self._write_rows(idx, other, src, lead)


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
        valid = valid.to(self.device).bool()
        steps = valid.long().cumsum(-1)
        position_ids = self.next_pos.unsqueeze(1) + (steps - 1).clamp_min(0)
        self.mask = torch.cat([self.mask, valid.long()], dim=1)
        attention = self.mask
        if self.layout:
            self.col_pos = torch.cat([self.col_pos, position_ids], dim=1)
            attention = self._sliding_masks(n)
        if hidden and self._hook is None:
            self._hook = self.model.get_output_embeddings().register_forward_pre_hook(self._capture)
        self._hidden = None
        with self._linears():
            out = self.model(input_ids=tokens, attention_mask=attention, position_ids=position_ids,
                             use_cache=True, logits_to_keep=keep, **{self.cache_keyword: self.cache})
        logits = out.logits
        self.next_pos = self.next_pos + steps[:, -1]
        h = None
        if hidden:
            h = self._hidden[:, -keep:]
        return logits[:, -keep:].float(), h

    @property
    def packed(self) -> bool:
        """Whether the model's linear layers run with packed oneDNN weights (``packed`` of the constructor)."""
        return self.linears is not None

    def _linears(self):
        return self.linears.applied() if self.linears is not None else contextlib.nullcontext()

    def _capture(self, module, args):
        self._hidden = args[0]

    def _sliding_masks(self, n: int):
        """Masks for the last ``n`` (new) columns of a sliding-window model: [B, 1, n, C], True (or 0.0 in
        eager attention) where a query may attend. Window by each row's position ids, as transformers'
        sliding mask (key position > query position - W) would be without holes; a query at a hole sees
        itself only, so no softmax row is empty."""
        C = self.mask.shape[1]
        q_cols = torch.arange(C - n, C, device=self.device)
        k_cols = torch.arange(C, device=self.device)
        self_only = (k_cols.unsqueeze(0) == q_cols.unsqueeze(1)).unsqueeze(0)
        base = new_column_mask(self.mask, n)[:, 0]                                 # [B, n, C]
        masks = {}
        if "full_attention" in self.layout["types"]:
            masks["full_attention"] = base | self_only
        if "sliding_attention" in self.layout["types"]:
            qpos = self.col_pos[:, C - n :].unsqueeze(2)
            within = (qpos - self.col_pos.unsqueeze(1)) < self.layout["window"]
            masks["sliding_attention"] = (base & within) | self_only
        eager = getattr(self.model.config, "_attn_implementation", "sdpa") == "eager"
        dtype = next(self.model.parameters()).dtype
        for k, m in masks.items():
            m = m.unsqueeze(1)
            masks[k] = torch.zeros(m.shape, dtype=dtype, device=self.device).masked_fill(~m, torch.finfo(dtype).min) \
                if eager else m
        return masks if self.layout["dict"] else next(iter(masks.values()))

    def _crop_to(self, length: int) -> None:
        self.cache.crop(length - self.length)
        if self.col_pos is not None:
            self.col_pos = self.col_pos[:, :length]

    def _drop_front(self, n: int) -> None:
        for layer in self._layers():
            layer.keys, layer.values = layer.keys[:, :, n:], layer.values[:, :, n:]
        if self.col_pos is not None:
            self.col_pos = self.col_pos[:, n:]

    def _layers(self) -> list:
        """The cache layers that hold keys and values (none before the first forward)."""
        return [l for l in self.cache.layers if getattr(l, "is_initialized", False) and l.keys.numel()]

    def _pad_front(self, n: int) -> None:
        for layer in self._layers():
            if isinstance(layer, GrowingLayer):  # in its buffer's spare columns where it has them
                layer.pad_front(n)
            else:
                layer.keys = pad_front(layer.keys, layer.keys.shape[2] + n, dim=2)
                layer.values = pad_front(layer.values, layer.values.shape[2] + n, dim=2)
        if self.layout:
            self.col_pos = pad_front(self.col_pos, self.col_pos.shape[1] + n)

    def _write_rows(self, idx: torch.Tensor, other: "CausalLMRunner", src: Optional[torch.Tensor] = None,
                    lead: int = 0) -> None:
        width, w = self.length, other.length - lead
        if self.layout:
            self.col_pos = self.col_pos.clone()
            self.col_pos[idx] = 0
            self.col_pos[idx, width - w :] = (other.col_pos if src is None else other.col_pos[src])[:, lead:]
        if w and not self._layers() and (src is not None or lead):  # other keeps its rows: copies of those taken
            rows = self.mask.shape[0]
            for i, layer in enumerate(other.cache.layers):
                kv = []
                for t in (layer.keys, layer.values):
                    full = t.new_zeros((rows, t.shape[1], width, t.shape[3]))
                    copy_rows(full[:, :, width - w :], idx, t[:, :, lead:], src)
                    kv.append(full)
                self.cache.update(*kv, i)
        elif w and not self._layers():  # nothing stored here yet (one-token prompts, no forward): start from zeros
            rows = self.mask.shape[0]
            for layer in other._layers():
                if isinstance(layer, GrowingLayer):  # with spare columns: the next append goes in place
                    layer.place_rows(rows, idx, width)
                    continue
                for name in ("keys", "values"):
                    t = getattr(layer, name)
                    full = t.new_zeros((rows, t.shape[1], width, t.shape[3]))
                    copy_rows(full[:, :, width - w :], idx, t)
                    setattr(layer, name, full)
            self.cache = other.cache
        elif w:
            for mine, theirs in zip(self._layers(), other._layers()):
                copy_rows(mine.keys[:, :, width - w :], idx, theirs.keys[:, :, lead:], src)
                copy_rows(mine.values[:, :, width - w :], idx, theirs.values[:, :, lead:], src)

    def select_rows(self, index: torch.Tensor) -> None:
        idx = index.to(self.device)
        # the index as it came (the engine's is on the CPU): take_rows reads it for every layer's keys and values,
        # which on a GPU would be a device sync each time
        self.cache.batch_select_indices(index)
        if self.col_pos is not None:
            self.col_pos = self.col_pos[idx]
        self._select_mask_rows(idx)
