"""Quantized weights of a target (or draft): the linear layers held as int8 with a scale per output feature.

A one-token step reads every weight once, so on a CPU its time is the time to read them: SmolLM2-135M's decoder
layers and output layer hold 134M weights, 270 MB in bfloat16, 135 MB in int8 (llama.cpp reads its Q4_1 file's
~90 MB). ``quantize(model, "q8")`` makes the model's linear weights (every decoder layer's projections and the output
layer, untied from the input embedding, which stays float: a distilled draft shares it) the values ``q * scale`` of
symmetric per-row int8 quantization (``ops.quantize_rows``): the model computes with them everywhere, in
transformers' forward as in the lean one, and the lean model's fused decoder-layer op reads them as int8 panels with
their scales (``ops.pack_linear_weight(w, torch.int8)``, ``csrc/cpu/layer_cpu.cpp``), a quarter of the float32
bytes. Prefills and forwards of more than ``engine.model.FUSED_MAX_ROWS`` tokens run oneDNN's matmuls on the same
values in the model's dtype. The model keeps its float weights' fingerprint (``engine.models.fingerprint``), so the
drafts and heads made for it still load.

Speculative decoding stays lossless for this target: every forward of a round computes the quantized model's
function, so greedy tokens equal the quantized model's own plain decoding and sampled tokens follow its
distribution (tests/test_weights.py). Quantization changes the model: its text is not the float model's.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import ops
from .models import fingerprint

WEIGHTS = ("q8",)  # the kinds of quantized weights quantize() makes
_ATTR = "specdec_weights"  # the model attribute that names them


def _linear_weights(model) -> list[torch.Tensor]:
    """The weights quantize() replaces: each decoder layer's ``*_proj`` weights and the output layer's."""
    out = [p for layer in model.model.layers for name, p in layer.named_parameters() if name.endswith("proj.weight")]
    return out + [model.get_output_embeddings().weight]


def _untie(model) -> None:
    """Give the output layer its own weight where it shares the input embedding's (tied embeddings)."""
    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False


@torch.no_grad()
def quantize(model, weights: str, name: str = "target"):
    """Replace ``model``'s linear weights, in place, by their ``weights`` quantization (module docstring) and mark the
    model so that the lean model packs them as int8 panels. ``weights``: ``"q8"`` (int8, one float32 scale per output
    feature). A feature draft's decoder is quantized, its ``fc`` stays float. Returns ``model``. Quantizing a model
    already quantized this way changes nothing.

    Raises:
        ValueError: ``weights`` not one of :data:`WEIGHTS`; a model that is not on a CPU (the int8 kernels are CPU
            ones) or not a decoder-layer model with ``model.model.layers``; a model quantized another way."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(map(repr, WEIGHTS))} (or None for the model's float "
                         f"weights), got {weights!r}")
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    if device.type != "cpu":
        raise ValueError(f"weights={weights!r} needs the {name} model on a CPU (its int8 kernels are CPU ones), got "
                         f"{device}; on a GPU keep bfloat16 weights")
    outer, inner = model, getattr(model, "model", None)
    if not hasattr(inner, "layers") and hasattr(getattr(inner, "model", None), "layers"):
        model = inner  # a wrapper of a decoder model (a feature draft, engine/feature_draft.py): its decoder's weights
    if not hasattr(getattr(model, "model", None), "layers"):
        raise ValueError(f"weights={weights!r}: the {name} model ({type(model).__name__}) has no decoder layers "
                         "(model.model.layers) to quantize")
    done = kind(outer)
    if done is not None and done != weights:
        raise ValueError(f"the {name} model's weights are already {done!r}, not {weights!r}")
    if done is None:
        model.specdec_float_fingerprint = fingerprint(model)
    _untie(model)
    for w in _linear_weights(model):
        q, scale = ops.quantize_rows(w)
        w.copy_(q.float() * scale[:, None])
    setattr(model, _ATTR, weights)
    setattr(outer, _ATTR, weights)
    return outer


def kind(model) -> Optional[str]:
    """The quantized weights :func:`quantize` gave ``model`` (``"q8"``), or None for float weights."""
    return getattr(model, _ATTR, None)


def weight_bytes(model) -> int:
    """Bytes of linear weights a one-token step reads: the decoder layers' projections and the output layer as the
    lean model's fused op holds them (int8 plus a float32 scale per row for ``"q8"``; else the model's dtype)."""
    total = 0
    for w in _linear_weights(model):
        rows, cols = w.shape
        total += rows * (cols + 4) if kind(model) == "q8" else w.numel() * w.element_size()
    return total
