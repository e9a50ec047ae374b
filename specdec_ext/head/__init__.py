"""Acceptance head: module, training data, training, evaluation and checkpoint I/O."""

from .module import AcceptanceHead

__all__ = ["AcceptanceHead"]
