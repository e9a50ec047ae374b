"""A transformers model's linear layers through oneDNN with weights packed once (CPU).

At the few rows of a decoding step or a verification, torch's ``F.linear`` in float32 runs MKL's sgemm, which on
some processors is far from the hardware's speed. On the 2-core AMD EPYC (AVX2) of the benchmarks, the bundled
target's LM head (``[M, 512] x [512, 8192]``) took 4.6 ms through ``F.linear`` at M = 4 rows and 0.9 ms with its
weight packed for oneDNN (``torch.ops.mkldnn._reorder_linear_weight`` once, then
``torch.ops.mkldnn._linear_pointwise``); the layers' projections 1.3-1.7x less at M = 4-16; at M >= 600 (a
prefill) the two are level. End to end (128 HumanEval prompts, 48 tokens, greedy, continuous batching at B = 4,
one process, the arms interleaved): plain decoding 1.50x faster, fixed K = 2 1.28x, the same tokens in every
request (``bench/target_linear.py`` of commit 465d27a).

:class:`PackedLinears` holds the packed weights of every ``torch.nn.Linear`` of a model (kept per model while its
weights stay the same tensors at the same version), and :meth:`PackedLinears.applied` routes those layers' calls to
them for the duration of a forward: each layer gets an instance ``forward`` that is removed afterwards, so the model
object is the same outside the call (hooks still run; a layer that already has an instance ``forward``, as
accelerate's offloading hooks set, is left alone). The function computed is the same up to rounding (fp32: about
1e-5 relative). ``engine.runner.CausalLMRunner`` uses it for the target (and for a draft without the lean runner of
``engine/fast_llama.py``, which packs its own weights).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

from .tensor_parallel import tp_size

# Packing duplicates the weights: by default a model is packed only if its linear weights take at most this many bytes
# (the bundled target: 118 MB); CausalLMRunner(packed=True) packs any size.
AUTO_MAX_BYTES = 2 << 30

# model -> (fingerprint of its weights, {layer: its forward with the packed weight})
_PACKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can run linear layers with packed weights here: a CPU tensor of float32, or of bfloat16 on a
    CPU whose oneDNN has a bf16 path (AVX512BW/VL/DQ, AVX-NE-CONVERT or AMX; an AVX2-only CPU has none), and a torch
    built with oneDNN (mkldnn)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    if not (hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` reordered for oneDNN (an opaque mkldnn tensor, as large as ``weight``)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 4)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for a weight packed by :func:`pack`; ``x`` ``[..., in]`` of the weight's dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _layers(model) -> list:
    """The model's plain ``torch.nn.Linear`` layers that can take packed weights (a subclass, a layer with an instance
    ``forward`` or a weight that is not a plain tensor is left to its own forward)."""
    return [m for m in model.modules()
            if type(m) is torch.nn.Linear and "forward" not in m.__dict__ and type(m.weight.data) is torch.Tensor]


def _fingerprint(layers: list) -> tuple:
    return tuple((m.weight.data_ptr(), m.weight._version, m.weight.dtype) for m in layers)


def wanted(model, packed: Optional[bool]) -> bool:
    """Whether a runner of ``model`` packs its linear layers: ``packed`` True / False as given (True where oneDNN cannot
    is a ValueError), None: on a single CPU device in float32, or in bfloat16 where oneDNN has a bf16 path
    (:func:`available`), not split over processes (tensor parallelism) or devices, and linear weights of at most
    :data:`AUTO_MAX_BYTES` (packing copies them). bfloat16 packed since 2026-11-25: on a 2-core Intel Xeon with AMX,
    bundled bf16 target, 1.09-1.17x end to end for plain decoding and 1.01-1.15x for fixed K = 2 at B = 1-64
    (``git show 4214d06:docs/results/target_linear_bf16_amx.json``, by that tree's ``bench/target_linear.py``)."""
    p = next(model.parameters())
    if packed is not None:
        if packed and not available(p.device, p.dtype):
            raise ValueError(f"packed linear layers need a CPU float32/bfloat16 model and a torch with oneDNN (bfloat16: "
                             f"a CPU with oneDNN's bf16 path); got {p.dtype} on {p.device}")
        return bool(packed)
    if not available(p.device, p.dtype):
        return False
    if getattr(model, "hf_device_map", None) or tp_size(model) > 1:
        return False
    return sum(m.weight.numel() * m.weight.element_size() for m in _layers(model)) <= AUTO_MAX_BYTES


class PackedLinears:
    """The packed weights of ``model``'s linear layers (:func:`_layers`) and the forwards that use them
    (``forwards``: layer -> forward), made once per model and weights."""

    def __init__(self, model):
        layers = _layers(model)
        key = _fingerprint(layers)
        hit = _PACKED.get(model)
        if hit is None or hit[0] != key:
            with torch.no_grad():
                hit = (key, {m: _forward(m, pack(m.weight)) for m in layers})
            _PACKED[model] = hit
        self.forwards: dict = hit[1]

    @contextlib.contextmanager
    def applied(self):
        """Within the block, each packed layer computes with its packed weight (an input of another dtype or device
        falls back to ``F.linear``); on leaving, even by an exception, the layers are as before."""
        patched = []
        try:
            for m, forward in self.forwards.items():
                m.forward = forward
                patched.append(m)
            yield
        finally:
            for m in patched:
                m.__dict__.pop("forward", None)


def _forward(layer: torch.nn.Linear, packed: torch.Tensor):
    weight, bias = layer.weight, layer.bias
    dtype = weight.dtype

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != dtype or x.device.type != "cpu":
            return F.linear(x, weight, bias)
        return linear(x, packed, bias)

    return forward
