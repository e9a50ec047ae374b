"""The decoding loop: model runners and KV caches, verification, streaming, statistics."""

from . import attention  # registers attn_implementation="specdec_decode" with transformers
from .generator import GenerationOutput, SpeculativeGenerator
from .sampling import SamplingConfig
from .stats import GenerationStats, RoundStats

__all__ = ["SpeculativeGenerator", "GenerationOutput", "SamplingConfig", "GenerationStats", "RoundStats"]
