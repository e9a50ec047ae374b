"""Candidate-length policies: how many tokens the draft proposes per round."""

from .base import CandidateLengthPolicy, DraftStep
from .builtin import AdaEDL, Autoregressive, Confidence, FixedK, Heuristic, make_policy
from .lookup import LookupStop
from .specdecpp import SpecDecPP

__all__ = ["CandidateLengthPolicy", "DraftStep", "Autoregressive", "FixedK", "Heuristic", "Confidence", "AdaEDL",
           "SpecDecPP", "LookupStop", "make_policy"]
