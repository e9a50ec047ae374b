"""Quantized weights of a target (or draft): the linear layers held as int8 with a scale per output feature, or in
4-bit blocks as a GGUF Q4_1 file stores them.

A one-token step reads every weight once, so on a CPU its time is the time to read them: SmolLM2-135M's decoder
layers and output layer hold 134M weights, 270 MB in bfloat16, 135 MB in int8, 84 MB with 4-bit layers (llama.cpp
reads its Q4_1 file's ~90 MB). ``quantize(model, kind)`` makes the model's linear weights the values they stand for
under that quantization, in place: the model computes with them everywhere, in transformers' forward as in the lean
one, and the lean model's fused decoder-layer op reads them packed (``ops.pack_linear_weight``,
``csrc/cpu/layer_cpu.cpp`` and ``blocks_cpu.cpp``):

* ``"q8"``: every decoder layer's projections and the output layer as ``q * scale``, symmetric per-row int8
  (``ops.quantize_rows``), read as int8 panels with their scales: a quarter of the float32 bytes.
* ``"q4"``: the decoder layers' projections as ``d * q + m`` per block of 32 inputs (``ops.quantize_blocks``, GGUF's
  Q4_1 and llama.cpp's reference quantizer: 4-bit q, float16 d and m), read as 4-bit blocks, 5 bits a weight; the
  output layer as ``d * q`` per block of 32 (GGUF's Q8_0: int8 q, float16 d), 8.5 bits a weight. A model loaded from
  a GGUF file with Q4_1 layers and a Q8_0 output layer (SmolLM2-135M's) quantizes back to the file's own q, d and m
  in every block: its weights are the file's exactly.
* ``"q4a8"``: the weights of ``"q4"``, multiplied as llama.cpp multiplies them: each token's activations quantized
  to int8 blocks of 32 (``max |x| / 127`` scale) before every product of a step or verification, whose sums are then
  exact integer dot products (AVX-512 VNNI's vpdpbusd, 64 weights an instruction): the products of a step about 2x
  faster than with float activations, where widening each weight to float32 costs more than reading it. A different
  function from ``"q4"``'s (the activations rounded to 8 bits), so an opt-in, never ``"auto"``.

The output layer is untied from the input embedding, which stays float (a distilled draft shares it), where its
values change (a GGUF file's Q8_0 output layer quantizes to itself: it stays tied, as with ``quantize(...,
exact=True)``, which changes nothing or returns None). Prefills and forwards of more than
``engine.model.FUSED_MAX_ROWS`` tokens run oneDNN's matmuls on the same values in the model's dtype; a ``"q4a8"``
model runs every forward, prefills too, through the fused op (transformers' own forward of it computes ``"q4"``'s
function, float activations). The model keeps its float weights' fingerprint (``engine.models.fingerprint``), so the
drafts and heads made for it still load.

Speculative decoding stays lossless for this target: every forward of a round computes the quantized model's
function, so greedy tokens equal the quantized model's own plain decoding and sampled tokens follow its
distribution (tests/test_weights.py). Quantization changes the model: its text is not the float model's.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import ops
from .models import fingerprint, tensors_key

WEIGHTS = ("q8", "q4", "q4a8")  # the kinds of quantized weights quantize() makes
_BLOCKS = ("q4", "q4a8")  # the kinds held in blocks of 32
INT8_ACTIVATIONS = ("q4a8",)  # the kinds whose products quantize the activations (engine.model runs them fused)
_ATTR = "specdec_weights"  # the model attribute that names them


def _layer_weights(model) -> list[torch.Tensor]:
    """Each decoder layer's ``*_proj`` weights."""
    return [p for layer in model.model.layers for name, p in layer.named_parameters() if name.endswith("proj.weight")]


def _linear_weights(model) -> list[torch.Tensor]:
    """The weights quantize() replaces: each decoder layer's ``*_proj`` weights and the output layer's."""
    return _layer_weights(model) + [model.get_output_embeddings().weight]


def _decoder(model):
    """The model whose ``model.layers`` hold the decoder layers (a feature draft wraps one)."""
    inner = getattr(model, "model", None)
    if not hasattr(inner, "layers") and hasattr(getattr(inner, "model", None), "layers"):
        return inner
    return model


def fits_blocks(model) -> bool:
    """Whether ``"q4"`` can hold ``model``: every linear layer's in features a multiple of 32."""
    return all(w.shape[1] % ops.BLOCK == 0 for w in _linear_weights(_decoder(model)))


def _untie(model) -> None:
    """Give the output layer its own weight where it shares the input embedding's (tied embeddings)."""
    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False


@torch.no_grad()
def quantize(model, weights: str, name: str = "target", exact: bool = False):
    """Replace ``model``'s linear weights, in place, by their ``weights`` quantization (module docstring) and mark the
    model so that the lean model packs them so. ``weights``: ``"q8"`` (int8, one float32 scale per output feature) or
    ``"q4"`` (decoder layers in 4-bit blocks of 32 with a float16 scale and minimum, GGUF's Q4_1; the output layer in
    8-bit blocks of 32, Q8_0), or ``"q4a8"`` (those weights, multiplied by int8 activations). A feature draft's
    decoder is quantized, its ``fc`` stays float. Returns ``model``.
    Quantizing a model already quantized this way changes nothing. ``exact``: only where the quantization gives back
    every weight as it is (a GGUF file's Q4_1 layers and Q8_0 output layer, loaded in float32); otherwise (weights
    that do not fit blocks of 32 included) the model is left as it was and None is returned.

    Raises:
        ValueError: ``weights`` not one of :data:`WEIGHTS`; a model that is not on a CPU (the kernels are CPU ones) or
            not a decoder-layer model with ``model.model.layers``; ``"q4"`` / ``"q4a8"`` on a layer whose in
            features are not a multiple of 32; a model quantized another way."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(map(repr, WEIGHTS))} (or None for the model's float "
                         f"weights), got {weights!r}")
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    if device.type != "cpu":
        raise ValueError(f"weights={weights!r} needs the {name} model on a CPU (its kernels are CPU ones), got "
                         f"{device}; on a GPU keep bfloat16 weights")
    outer, model = model, _decoder(model)  # a feature draft (engine/feature_draft.py): its decoder's weights
    if not hasattr(getattr(model, "model", None), "layers"):
        raise ValueError(f"weights={weights!r}: the {name} model ({type(model).__name__}) has no decoder layers "
                         "(model.model.layers) to quantize")
    done = kind(outer)
    if done is not None and done != weights:
        raise ValueError(f"the {name} model's weights are already {done!r}, not {weights!r}")
    blocks = _linear_weights(model) if weights in _BLOCKS else []
    odd = next((w for w in blocks if w.shape[1] % ops.BLOCK), None)
    if odd is not None and exact:
        return None
    if odd is not None:
        raise ValueError(f"weights={weights!r} needs every linear layer's in features a multiple of {ops.BLOCK} (the "
                         f"{name} model has one of {odd.shape[1]}); use weights='q8'")
    layers = len(_layer_weights(model))

    def values(i, w):  # the quantized values of the i-th of _linear_weights, float32
        if blocks:
            return ops.dequantize_blocks(*ops.quantize_blocks(w, 4 if i < layers else 8))
        q, scale = ops.quantize_rows(w)
        return q.float() * scale[:, None]

    if exact and not all(torch.equal(values(i, w).to(w.dtype), w) for i, w in enumerate(_linear_weights(model))):
        return None
    if done is None:
        model.specdec_float_fingerprint = fingerprint(model)
    if not exact:  # (exact: every value is already its own quantization, a tied output layer stays tied)
        before = _linear_weights(model)
        changed = [(i, v) for i, w in enumerate(before) if not torch.equal(v := values(i, w).to(w.dtype), w)]
        if any(i == len(before) - 1 for i, _ in changed):  # a tied output layer whose values stay keeps its tie
            _untie(model)
        now = _linear_weights(model)  # the output layer's own weight where it was untied
        for i, v in changed:
            now[i].copy_(v)
    setattr(model, _ATTR, weights)
    setattr(outer, _ATTR, weights)
    return outer


@torch.no_grad()
def panels(model) -> tuple[list[tuple], torch.Tensor]:
    """The weights as the fused CPU ops read them: each decoder layer's ``(qkv, o, gate_up, down)`` packed by
    ``ops.pack_linear_weight`` (Wq, Wk, Wv and Wgate, Wup concatenated) and the output layer's packing, in the
    model's float dtype, as int8 rows (``"q8"``), or as 4-bit blocks and the output layer in 8-bit blocks (``"q4"``;
    ``"q4a8"``: in the layouts for int8 activations). Those :func:`cast` packed from the float32 values, while the
    weights are the same tensors since."""
    kept = getattr(model, "specdec_exact_panels", None)
    if kept is not None and kept[0] == tensors_key(model):
        return kept[1]
    k = kind(model)
    layer_dtype = {"q8": torch.int8, "q4": torch.uint8, "q4a8": torch.uint8}.get(k)
    a8 = k == "q4a8"
    pack = (lambda w: ops.pack_linear_weight(w, layer_dtype, int8_activations=a8))
    layers = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        layers.append((pack(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0)), pack(a.o_proj.weight),
                       pack(torch.cat([m.gate_proj.weight, m.up_proj.weight], 0)), pack(m.down_proj.weight)))
    head = model.get_output_embeddings().weight
    if k in _BLOCKS:
        return layers, ops.pack_linear_weight(head, torch.int8, blocks=True, int8_activations=a8)
    return layers, pack(head)


def cast(model, dtype: torch.dtype):
    """Cast a model quantized in float32 to ``dtype`` (bfloat16: what a CPU's activations run in), keeping the
    packed weights of :func:`panels` made from the float32 values: bfloat16 cannot hold every ``d * q + m``, so
    quantizing again after the cast would not give back the same blocks (a GGUF file's own). Returns ``model``."""
    packed = panels(model)
    model.to(dtype)
    model.specdec_exact_panels = (tensors_key(model), packed)
    return model


def kind(model) -> Optional[str]:
    """The quantized weights :func:`quantize` gave ``model`` (:data:`WEIGHTS`), or None for float weights."""
    return getattr(model, _ATTR, None)


def weight_bytes(model) -> int:
    """Bytes of linear weights a one-token step reads: the decoder layers' projections and the output layer as the
    lean model's fused op holds them (int8 plus a float32 scale per row for ``"q8"``; for ``"q4"`` / ``"q4a8"``
    4-bit blocks of 32 with two float16 per block for the layers, 8-bit blocks with one for the output layer; else
    the model's dtype)."""
    total, k = 0, kind(model)
    layers = len(_layer_weights(model))
    for i, w in enumerate(_linear_weights(model)):
        rows, cols = w.shape
        if k in _BLOCKS:
            total += rows * cols // ops.BLOCK * ((ops.BLOCK // 2 + 4) if i < layers else (ops.BLOCK + 2))
        elif k == "q8":
            total += rows * (cols + 4)
        else:
            total += w.numel() * w.element_size()
    return total
