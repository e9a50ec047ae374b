"""specdec_ext: speculative decoding and SpecDec++ for PyTorch.

Fused, lossless verification ops (``specdec_ext.ops``, CPU and CUDA kernels registered as
``torch.ops.specdec_ext.*``), a generation engine over Hugging Face causal LMs
(``SpeculativeGenerator``) with candidate-length policies (``specdec_ext.policies``), and the
SpecDec++ acceptance head (``AcceptanceHead``) with its training pipeline.
"""

from . import ops
from .engine import GenerationOutput, GenerationStats, SpeculativeGenerator
from .engine.lookup import PromptLookup
from .head import AcceptanceHead
from .policies import AdaEDL, Autoregressive, Confidence, FixedK, Heuristic, SpecDecPP, make_policy

__version__ = "0.1.0"

__all__ = ["ops", "SpeculativeGenerator", "PromptLookup", "GenerationOutput", "GenerationStats", "AcceptanceHead", "Autoregressive",
           "FixedK", "Heuristic", "Confidence", "AdaEDL", "SpecDecPP", "make_policy", "__version__"]
