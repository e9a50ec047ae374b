"""``attn_implementation="specdec_decode"``: transformers attention through ``ops.decode_attention`` on CPUs.

Importing ``specdec_ext`` registers the name with transformers' ``AttentionInterface`` (the attention function)
and ``AttentionMaskInterface`` (masks as booleans, never skipped, so every layer sees its padding and holes).
A model loaded with ``attn_implementation="specdec_decode"``, or switched with
``model.set_attn_implementation("specdec_decode")``, runs its attention layers through the kernel when the kernel
serves the call, and through transformers' SDPA function otherwise:

* the kernel: CPU tensors, at most ``MAX_QUERIES`` queries per row (decode steps, verification of K + 1
  positions), a boolean mask, no dropout in training, no attention sinks, position bias or logit soft-cap;
* a logit soft-cap (Gemma-2), which neither the kernel nor SDPA applies: matmul, cap, masked softmax, matmul
  in torch ops (what transformers' eager attention computes);
* SDPA: prefills of longer prompts (its flash kernel is faster there), GPUs, and everything else.

Why: torch's fused CPU attention takes 4-6x as long as matmul-softmax-matmul for one query per row in bfloat16
(``bench/bench_ops.py --attention``), and at batch sizes of 16-64 half of a padded cache is padding. Measured end to
end by ``1bd1639:bench/attention_impl.py``.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import ops

NAME = "specdec_decode"
# Queries per row the kernel takes (decode steps, verification of K + 1 positions); longer prefills go to SDPA's
# flash kernel. The kernel wins by 3.5-5.8x at one query per row in bf16, but with 5 queries per row and no
# padding it is slower than SDPA (bench/bench_ops.py --attention): it gains there only where it skips padding.
MAX_QUERIES = 16


def kernel_takes(device, queries: int) -> bool:
    """Whether ``ops.decode_attention`` can serve a forward of ``queries`` queries per row on ``device``: a CPU, the
    compiled extension, at most ``MAX_QUERIES`` queries (also the draft's lean runner's test, ``fast_llama``)."""
    return torch.device(device).type == "cpu" and ops.HAS_EXTENSION and queries <= MAX_QUERIES


def kernel_serves(query: torch.Tensor, attention_mask, dropout: float, training: bool, kwargs: dict) -> bool:
    """Whether :func:`decode_attention_forward` runs ``ops.decode_attention`` for this call (see the module's
    docstring)."""
    if not kernel_takes(query.device, query.shape[2]):
        return False
    if attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        return False
    if (dropout and training) or kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None:
        return False
    return not (kwargs.get("output_attentions") or kwargs.get("softcap") is not None)


def decode_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature: query ``[B, Hq, n, D]``, key and value ``[B, Hkv, C, D]``,
    mask ``[B, 1, n, C']`` bool (C' >= C); returns ``(attn_output [B, n, Hq, D], None)``."""
    return _attend(module, query, key, value, attention_mask, dropout, scaling, kwargs)


def _attend(module, query, key, value, attention_mask, dropout, scaling, kwargs):
    softcap = kwargs.get("softcap")
    if softcap is not None and attention_mask is not None and attention_mask.dtype == torch.bool:
        return _softcapped(query, key, value, attention_mask[:, :, :, : key.shape[2]], scaling, float(softcap)), None
    if not kernel_serves(query, attention_mask, dropout, module.training, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    mask = attention_mask[:, :, :, : key.shape[2]]
    return ops.decode_attention(query, key, value, mask, scale), None


def _softcapped(query, key, value, mask, scaling, softcap):
    """Attention with soft-capped logits, softcap * tanh(q.k * scale / softcap) (Gemma-2), in torch ops; the
    softmax in float32. Output ``[B, n, Hq, D]``."""
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1) if group > 1 else key
    v = value.repeat_interleave(group, dim=1) if group > 1 else value
    scores = torch.tanh(torch.matmul(query, k.transpose(-1, -2)).float() * (scale / softcap)) * softcap
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(query.dtype)
    return torch.matmul(weights, v).transpose(1, 2).contiguous()


def boolean_mask(*args, **kwargs):
    """transformers' SDPA mask, never skipped (``allow_is_causal_skip=False``): the kernel needs it."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, decode_attention_forward)
AttentionMaskInterface.register(NAME, boolean_mask)
