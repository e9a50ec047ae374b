"""The bundled target/draft pair (and its acceptance head), trained by this project on the Python
standard library (``zoo/train.py``), shipped in ``zoo/pair/`` and loadable in one call."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

PAIR_DIR = Path(__file__).parent / "pair"


@dataclass
class ModelPair:
    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: object
    head: Optional[object]


def pair_available(path: Path = PAIR_DIR) -> bool:
    return (path / "target" / "config.json").exists() and (path / "draft" / "config.json").exists()


def load_models(target: str | Path, draft: Optional[str | Path] = None, head: Optional[str | Path] = None,
                target_dtype: torch.dtype = torch.float32, draft_dtype: torch.dtype = torch.float32,
                device: str = "cpu", device_map: Optional[str] = None) -> ModelPair:
    """Load local Hugging Face model directories (no network): target, optional draft and head.

    ``device_map="auto"`` spreads the target over the available GPUs with accelerate.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..head import AcceptanceHead

    kw = {"device_map": device_map} if device_map else {}
    t = AutoModelForCausalLM.from_pretrained(target, dtype=target_dtype, local_files_only=True, **kw).eval()
    if not device_map:
        t = t.to(device)
    d = None
    if draft is not None:
        d = AutoModelForCausalLM.from_pretrained(draft, dtype=draft_dtype, local_files_only=True).to(device).eval()
    h = AcceptanceHead.from_pretrained(str(head)).eval() if head is not None else None
    if h is not None and d is not None:
        h.check_draft(d.get_output_embeddings().weight.shape[1])
    tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
    return ModelPair(t, d, tok, h)


def load_pair(target_dtype: torch.dtype = torch.float32, draft_dtype: torch.dtype = torch.float32,
              device: str = "cpu", with_head: bool = True, path: Path = PAIR_DIR) -> ModelPair:
    """The bundled pair: ``ModelPair(target, draft, tokenizer, head)``.

    Raises FileNotFoundError when this checkout has no trained pair (train it with ``specdec zoo train``)."""
    if not pair_available(path):
        raise FileNotFoundError(f"no bundled pair in {path}: train it with `specdec zoo train` (see README)")
    head_dir = path / "head"
    head = head_dir if with_head and (head_dir / "config.json").exists() else None
    if with_head and head is None:
        raise FileNotFoundError(f"the bundled pair in {path} has no acceptance head yet (`specdec zoo train` makes it)")
    return load_models(path / "target", path / "draft", head, target_dtype, draft_dtype, device)
