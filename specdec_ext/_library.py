"""The compiled ops library: found beside the package and loaded, which registers ``torch.ops.specdec_ext.*``."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Optional

import torch


def library_path() -> Optional[Path]:
    """The compiled ops library (``specdec_ext/_C*.so``; Python-free: C++ programs link it beside libtorch,
    see the README), or None on an install without a compiler."""
    found = sorted(Path(__file__).parent.glob("_C*.so"))
    return found[0] if found else None


try:  # loading the compiled library registers torch.ops.specdec_ext.*
    _LIB = library_path()
    if _LIB is None:
        raise OSError("no compiled library")
    torch.ops.load_library(str(_LIB))
    HAS_EXTENSION = True
except (OSError, RuntimeError):  # pragma: no cover - exercised only on installs without a compiler
    HAS_EXTENSION = False


@functools.lru_cache(maxsize=1)
def build_id() -> Optional[str]:
    """A digest of the loaded library's bytes (None without one): what a measurement of the kernels' speed is keyed
    by, beside the machine (a rebuilt kernel is measured again, ``engine/profile.py``)."""
    if not HAS_EXTENSION:
        return None
    return hashlib.sha1(_LIB.read_bytes()).hexdigest()[:16]
