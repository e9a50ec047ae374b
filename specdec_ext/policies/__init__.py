"""Candidate-length policies: how many tokens the draft proposes per round."""

from .base import CandidateLengthPolicy, DraftStep
from .builtin import AdaEDL, Autoregressive, Confidence, FixedK, Heuristic, make_policy
from .lookup import CopyOrDraft, LookupStop
from .specdecpp import SpecDecPP

__all__ = ["CandidateLengthPolicy", "DraftStep", "Autoregressive", "FixedK", "Heuristic", "Confidence", "AdaEDL",
           "SpecDecPP", "LookupStop", "CopyOrDraft", "make_policy"]
