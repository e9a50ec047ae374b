"""The bundled pair's corpus: the running interpreter's standard library, and its tokenizer.

Files are the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` with ``site-packages`` excluded.
The held-out split is a deterministic function of each file's path relative to the stdlib root
(SHA-1 of the path), so it is the same on every machine with the same Python version.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
from pathlib import Path
from typing import Iterable

import numpy as np

EOS_TOKEN = "<|endoftext|>"
HELD_OUT_PERCENT = 2


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """All ``.py`` files of the standard library, ``site-packages`` excluded, sorted by relative path."""
    root = root or stdlib_root()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_held_out(relpath: str) -> bool:
    """Deterministic held-out membership: about ``HELD_OUT_PERCENT`` % of files."""
    digest = hashlib.sha1(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") % 100 < HELD_OUT_PERCENT


def split_files(root: Path | None = None) -> dict[str, list[Path]]:
    root = root or stdlib_root()
    out: dict[str, list[Path]] = {"train": [], "held_out": []}
    for p in stdlib_files(root):
        out["held_out" if is_held_out(p.relative_to(root).as_posix()) else "train"].append(p)
    return out


def read_source(path: Path) -> str:
    # A few stdlib files are not UTF-8 (test data); byte-level BPE handles any text, so replace bad bytes.
    return path.read_bytes().decode("utf-8", errors="replace")


def train_tokenizer(files: Iterable[Path], out_dir: Path, vocab_size: int = 8192):
    """Train a byte-level BPE tokenizer and save it so that ``AutoTokenizer.from_pretrained(out_dir)`` loads it."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    texts = (read_source(p) for p in files)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN], show_progress=False)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, unk_token=None
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out_dir)
    return tok


def encode_files(tokenizer, files: list[Path]) -> np.ndarray:
    """Token stream of all files, each followed by the EOS token, as uint16."""
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    ids: list[int] = []
    batch = 64
    for i in range(0, len(files), batch):
        enc = tokenizer([read_source(p) for p in files[i : i + batch]], add_special_tokens=False)["input_ids"]
        for seq in enc:
            ids.extend(seq)
            ids.append(eos)
    assert max(ids) < 2**16
    return np.asarray(ids, dtype=np.uint16)


def build_corpus(work_dir: Path, vocab_size: int = 8192) -> dict:
    """Tokenizer + tokenized train/held-out streams, cached under ``work_dir`` (idempotent)."""
    from transformers import AutoTokenizer

    work_dir.mkdir(parents=True, exist_ok=True)
    meta_path = work_dir / "corpus.json"
    if meta_path.exists():
        return json.loads(meta_path.read_text())
    split = split_files()
    tok_dir = work_dir / "tokenizer"
    train_tokenizer(split["train"], tok_dir, vocab_size)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    meta = {"stdlib": f"Python {platform.python_version()} standard library", "vocab_size": len(tok)}  # no machine paths
    for name, files in split.items():
        arr = encode_files(tok, files)
        np.save(work_dir / f"{name}.npy", arr)
        meta[name] = {"files": len(files), "tokens": int(arr.size), "chars": sum(p.stat().st_size for p in files)}
    meta_path.write_text(json.dumps(meta, indent=2))
    return meta
