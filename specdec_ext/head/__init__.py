"""The runtime acceptance head: the module and its checkpoint I/O (``module``) and the draft-confidence
and acceptance-history features it reads (``features``). Training lives in ``specdec_ext.training``."""

from .module import AcceptanceHead

__all__ = ["AcceptanceHead"]
