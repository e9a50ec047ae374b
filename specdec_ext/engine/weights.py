"""Quantized weights of a target (or draft): the linear layers held as int8 with a scale per output feature, or in
4-bit blocks as a GGUF Q4_1 file stores them.

A one-token step reads every weight once, so on a CPU its time is the time to read them: SmolLM2-135M's decoder
layers and output layer hold 134M weights, 270 MB in bfloat16, 135 MB in int8, 84 MB with 4-bit layers (llama.cpp
reads its Q4_1 file's ~90 MB). ``quantize(model, kind)`` quantizes the model's linear weights and holds them, in
place, only as the lean model's fused decoder-layer op reads them (``ops.pack_linear_weight``, ``csrc/cpu/layer_cpu.cpp``
and ``blocks_cpu.cpp``): its projections and output layer become ``engine.packed.PackedLinear`` modules, no float
copy of a matrix is kept, and transformers' own forward of the model computes the same function through them:

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

A tied input embedding whose output layer quantizes to itself (a GGUF file's Q8_0 ``token_embd``, as with
``quantize(..., exact=True)``, which changes nothing or returns None) reads its rows from those blocks
(``engine.packed.PackedEmbedding``), shared with a distilled draft; otherwise it stays float. The real pair's loaded
tensors: 92 MiB for the target (its GGUF file: 94 MiB), 109 MiB with the distilled and feature drafts. Decode
steps and verifications run the fused op; prefills multiply each layer's weights unpacked just before its products
(``engine.model.UNPACK_ABOVE``), except with int8 activations, whose every forward is the fused op's. The model keeps
its float weights' fingerprint (``engine.models.fingerprint``), so the drafts and heads made for it still load.

Speculative decoding stays lossless for this target: every forward of a round computes the quantized model's
function, so greedy tokens equal the quantized model's own plain decoding and sampled tokens follow its
distribution (tests/test_weights.py). Quantization changes the model: its text is not the float model's.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import ops
from .models import fingerprint
from .packed import PackedEmbedding, PackedLinear
from .subset_head import SubsetLMHead

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


def projections(layer) -> tuple:
    """A decoder layer's linear projections in the four matrices the fused op reads: ``(module, names)`` for Wq, Wk,
    Wv (concatenated), Wo, Wgate, Wup (concatenated) and Wdown."""
    a, m = layer.self_attn, layer.mlp
    return ((a, ("q_proj", "k_proj", "v_proj")), (a, ("o_proj",)), (m, ("gate_proj", "up_proj")), (m, ("down_proj",)))


def joined(parent, names: tuple) -> torch.Tensor:
    """The weights of ``parent``'s linear layers ``names``, concatenated along the out features."""
    ws = [getattr(parent, n).weight for n in names]
    return torch.cat(ws, 0) if len(ws) > 1 else ws[0]


def _held(model):
    """The packings a quantized model holds (:func:`quantize`), or None."""
    return getattr(_decoder(model), "specdec_packed", None)


def fits_blocks(model) -> bool:
    """Whether ``"q4"`` can hold ``model``: every linear layer's in features a multiple of 32."""
    return all(w.shape[1] % ops.BLOCK == 0 for w in _linear_weights(_decoder(model)))


@torch.no_grad()
def quantize(model, weights: str, name: str = "target", exact: bool = False):
    """Quantize ``model``'s linear weights, in place, as ``weights`` (module docstring) and hold them only packed:
    each decoder layer's ``nn.Linear`` projections and the output layer become :class:`~.packed.PackedLinear`
    modules over ``ops.pack_linear_weight``'s panels (the float matrices are dropped), and an input embedding tied to
    an output layer the quantization gives back exactly (a GGUF file's Q8_0 ``token_embd``) a
    :class:`~.packed.PackedEmbedding` over the same blocks. ``weights``: ``"q8"`` (int8, one float32 scale per output
    feature) or ``"q4"`` (decoder layers in 4-bit blocks of 32 with a float16 scale and minimum, GGUF's Q4_1; the
    output layer in 8-bit blocks of 32, Q8_0), or ``"q4a8"`` (those weights, multiplied by int8 activations). A
    feature draft's decoder is quantized, its ``fc`` stays float; a draft's ``SubsetLMHead`` holds its rows packed.
    Cast the model to bfloat16 afterwards if wanted: the packed weights stay as made from the values given (a GGUF
    file's blocks from its float32 values). Returns ``model``.
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
    if done == weights:
        return outer
    blocks = _linear_weights(model) if weights in _BLOCKS else []
    odd = next((w for w in blocks if w.shape[1] % ops.BLOCK), None)
    if odd is not None and exact:
        return None
    if odd is not None:
        raise ValueError(f"weights={weights!r} needs every linear layer's in features a multiple of {ops.BLOCK} (the "
                         f"{name} model has one of {odd.shape[1]}); use weights='q8'")
    packs = []  # (module, names, their weights concatenated and packed), per layer: QKV, O, gate/up, down
    for layer in model.model.layers:
        for parent, names in projections(layer):
            w = joined(parent, names)
            packed = _pack(weights, w)
            if exact and not _gives_back(packed, w):
                return None
            packs.append((parent, names, packed))
    out, emb = model.get_output_embeddings(), model.get_input_embeddings()
    tied = getattr(emb, "weight", None) is out.weight
    head = _pack(weights, out.weight, head=True)
    keeps_head = (exact or tied) and _gives_back(head, out.weight)  # (only a tied embedding reads the head's blocks)
    if exact and not keeps_head:
        return None
    model.specdec_float_fingerprint = fingerprint(model)
    setattr(model, _ATTR, weights)
    setattr(outer, _ATTR, weights)
    for parent, names, packed in packs:
        _hold(weights, parent, names, packed)
    held = PackedLinear(head, out.in_features, out.weight.shape[0], getattr(out, "bias", None))
    if isinstance(out, SubsetLMHead):  # a draft's head over a vocabulary subset: its rows packed
        out.hold(held)
    else:  # a tied embedding whose values the head's blocks give back reads them (a GGUF file's Q8_0 token_embd)
        model.set_output_embeddings(held)
        if tied and keeps_head:
            model.set_input_embeddings(PackedEmbedding(head, out.out_features, out.in_features, emb.weight.dtype))
        elif tied:
            model.config.tie_word_embeddings = False
    model.specdec_packed = ([tuple(packed for _, _, packed in packs[i: i + 4]) for i in range(0, len(packs), 4)],
                            head)
    for m in {outer, model}:  # a checkpoint would hold no matrices: the packings are not persistent buffers
        m.save_pretrained = functools.partial(_no_checkpoint, name, weights)
    return outer


def _no_checkpoint(name: str, weights: str, *args, **kwargs):
    raise ValueError(f"save_pretrained: the {name} model's weights are held only packed (weights={weights!r}), which "
                     "a checkpoint does not store; save the float model before quantizing it (or keep its GGUF file)")


def _pack(kind_: str, w: torch.Tensor, head: bool = False) -> torch.Tensor:
    """``w`` packed as the fused op reads weights of kind ``kind_`` (the output layer in 8-bit blocks for q4)."""
    if kind_ in _BLOCKS:
        return ops.pack_linear_weight(w, torch.int8 if head else torch.uint8, blocks=True,
                                      int8_activations=kind_ in INT8_ACTIVATIONS)
    return ops.pack_linear_weight(w, torch.int8)


def _gives_back(packed: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the values ``packed`` stands for are ``w``'s own (in ``w``'s dtype): its quantization changes
    nothing."""
    return torch.equal(ops.unpack_linear_weight(packed, w.shape[0], torch.float32).to(w.dtype), w)


def _hold(kind_: str, parent, names: tuple, together: torch.Tensor) -> None:
    """Replace ``parent``'s linear layers ``names`` by :class:`PackedLinear` modules holding views of ``together``,
    their weights concatenated and packed (their own packing where an out width is not a multiple of the panel's 16
    rows)."""
    linears = [getattr(parent, n) for n in names]
    aligned = all(m.out_features % ops.PANEL == 0 for m in linears[:-1])
    start = 0
    for n, m in zip(names, linears):
        end = -(-(start + m.out_features) // ops.PANEL)  # the panels holding rows start .. start + out - 1
        packed = together[start // ops.PANEL: end] if aligned else _pack(kind_, m.weight)
        setattr(parent, n, PackedLinear(packed, m.in_features, m.out_features, m.bias))
        start += m.out_features


def held_packed(model) -> bool:
    """Whether ``model``'s linear weights are held only packed (:func:`quantize`): no float matrix to multiply."""
    return _held(model) is not None


@torch.no_grad()
def panels(model) -> tuple[list[tuple], torch.Tensor]:
    """The weights as the fused CPU ops read them: each decoder layer's ``(qkv, o, gate_up, down)`` packed by
    ``ops.pack_linear_weight`` (Wq, Wk, Wv and Wgate, Wup concatenated) and the output layer's packing. A quantized
    model's are those it holds (int8 rows for ``"q8"``, 4-bit blocks and the output layer in 8-bit blocks for
    ``"q4"``; ``"q4a8"``: in the layouts for int8 activations); a float model's are packed here, in its dtype."""
    held = _held(model)
    if held is not None:
        return held
    layers = [tuple(ops.pack_linear_weight(joined(p, names)) for p, names in projections(layer))
              for layer in model.model.layers]
    return layers, ops.pack_linear_weight(model.get_output_embeddings().weight)


def kind(model) -> Optional[str]:
    """The quantized weights :func:`quantize` gave ``model`` (:data:`WEIGHTS`), or None for float weights."""
    return getattr(model, _ATTR, None)


def weight_bytes(model) -> int:
    """Bytes of linear weights a one-token step reads: the decoder layers' projections and the output layer as the
    lean model's fused op holds them (a quantized model's packed tensors: int8 plus a float32 scale per row for
    ``"q8"``; for ``"q4"`` / ``"q4a8"`` 4-bit blocks of 32 with two float16 per block for the layers, 8-bit blocks
    with one for the output layer; else the model's dtype)."""
    held = _held(model)
    if held is not None:
        layers, head = held
        return sum(t.numel() * t.element_size() for t in (*(t for layer in layers for t in layer), head))
    return sum(w.numel() * w.element_size() for w in _linear_weights(_decoder(model)))
