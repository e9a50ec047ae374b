"""specdec_ext: speculative decoding and SpecDec++ for PyTorch.

Fused, lossless verification ops (``specdec_ext.ops``, CPU and CUDA kernels registered as
``torch.ops.specdec_ext.*``), a generation engine over Hugging Face causal LMs
(``SpeculativeGenerator``) with candidate-length policies (``specdec_ext.policies``), and the
SpecDec++ acceptance head (``AcceptanceHead``) with its training pipeline.

The names below load on first use (PEP 562): ``import specdec_ext.ops`` loads the ops and torch, not the engine and
transformers (a runtime that embeds only the ops pays for only them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the submodule that defines it
_LAZY = {"ops": "ops", "SpeculativeGenerator": "engine", "GenerationOutput": "engine", "GenerationStats": "engine",
         "AcceptanceHead": "head", **{name: "policies" for name in ("AdaEDL", "Autoregressive", "Confidence", "FixedK",
                                                                       "Heuristic", "SpecDecPP", "make_policy")}}

__all__ = ["ops", "SpeculativeGenerator", "GenerationOutput", "GenerationStats", "AcceptanceHead", "Autoregressive",
           "FixedK", "Heuristic", "Confidence", "AdaEDL", "SpecDecPP", "make_policy", "__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'specdec_ext' has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name]}", __name__)
    value = module if name == _LAZY[name] else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see
    from . import ops
    from .engine import GenerationOutput, GenerationStats, SpeculativeGenerator
    from .head import AcceptanceHead
    from .policies import AdaEDL, Autoregressive, Confidence, FixedK, Heuristic, SpecDecPP, make_policy
