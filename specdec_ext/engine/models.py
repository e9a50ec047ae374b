"""Facts about a Hugging Face causal LM that the engine, the head pipeline and the zoo all need."""

from __future__ import annotations

import hashlib
import json
from typing import Optional

import torch


def vocab_size(model) -> int:
    """V, the number of rows of the model's output embedding (its LM head)."""
    emb = model.get_output_embeddings()
    if emb is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings: not a causal LM")
    return emb.weight.shape[0]


def hidden_size(model) -> int:
    """H, the width of the LM head's input (the hidden state an acceptance head reads)."""
    return model.get_output_embeddings().weight.shape[1]


def param_count(model) -> int:
    """The number of the model's parameters (elements, over every tensor)."""
    return sum(p.numel() for p in model.parameters())


def context_length(model) -> Optional[int]:
    return getattr(model.config, "max_position_embeddings", None)


def model_name(model) -> str:
    """A portable name: the directory's last component, or the class name (never an absolute path)."""
    name = getattr(model.config, "_name_or_path", "") or ""
    return name.rstrip("/").split("/")[-1] if name else type(model).__name__


_NAME_KEYS = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures", "use_cache")


@torch.no_grad()
def fingerprint(model) -> str:
    """A short hash of a model's configuration and a few of its weights (rounded to bfloat16, so the same
    model loaded in float32 or bfloat16, on any device, has the same fingerprint)."""
    cfg = model.config.to_dict()
    for k in _NAME_KEYS:
        cfg.pop(k, None)
    h = hashlib.sha1(json.dumps(cfg, sort_keys=True, default=str).encode())
    for weight, rows in ((model.get_output_embeddings().weight, slice(0, 8)),
                         (model.get_input_embeddings().weight, slice(-8, None))):
        if hasattr(weight, "full_tensor"):  # a tensor-parallel (DTensor) weight: the whole matrix, as on one device
            weight = weight.full_tensor()
        h.update(weight[rows].detach().to("cpu", torch.bfloat16).float().numpy().tobytes())
    return h.hexdigest()[:16]
