"""GGUF files (llama.cpp's format, how Ollama and most local-model packages ship weights) as model directories.

transformers reads a GGUF file (``from_pretrained(dir, gguf_file=name)``, with the ``gguf`` package) by
dequantizing every tensor. Left to itself it parses the file's metadata (the tokenizer's 49k tokens and merges, element
by element) three times and builds ``gguf``'s tensor-name map once per module, about 35 s for SmolLM2-135M on one
core; :func:`gguf_model_dir` hands its loader one reader and one map per conversion (about 6 s), and does it once per
file and keeps the result as an ordinary Hugging Face directory (``config.json``,
``model.safetensors`` in float32: a dequantized block's values are exact in float32, tokenizer files and chat
template) under ``<cache>/gguf-<key>/`` (``SPECDEC_CACHE_DIR``, else ``~/.cache/specdec_ext``); the key is a hash of
the file's resolved path, size and modification time, so a replaced file is converted again. Later loads read
the directory (about 0.2 s for SmolLM2-135M).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Union

from ..engine.profile import cache_dir

SUFFIX = ".gguf"
_MAGIC = b"GGUF"


def is_gguf(path: Union[str, Path, None]) -> bool:
    """True for a path whose name ends in ``.gguf`` (any case)."""
    return path is not None and str(path).lower().endswith(SUFFIX)


def _key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


def gguf_model_dir(path: Union[str, Path], cache: Optional[Path] = None, log=None) -> Path:
    """A Hugging Face model directory holding ``path``'s model, dequantized to float32 (converted on first use, then
    read from the cache). ``log``: where the one progress line of a conversion goes (default stderr).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: one line naming the file: not a GGUF file (bad magic), a damaged file, an architecture or a
            quantization transformers' GGUF loader does not read.
        ImportError: the ``gguf`` package (or ``accelerate``, which transformers' loader needs) is not installed."""
    src = Path(path)
    if not src.is_file():
        raise FileNotFoundError(f"{src}: no such GGUF file")
    with open(src, "rb") as f:
        if f.read(4) != _MAGIC:
            raise ValueError(f"{src}: not a GGUF file (it does not start with the GGUF magic bytes)")
    out = (cache or cache_dir()) / f"gguf-{_key(src)}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    for pkg in ("gguf", "accelerate"):
        if importlib.util.find_spec(pkg) is None:
            raise ImportError(f"{src}: reading GGUF files needs the {pkg!r} package: pip install gguf accelerate")
    log = log or (lambda msg: print(msg, file=sys.stderr, end="", flush=True))
    log(f"[specdec] converting {src.name} to float32 safetensors in {out} (once) ...")
    t0 = time.perf_counter()
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")  # per process: two converting at once do not clash
    shutil.rmtree(tmp, ignore_errors=True)
    with _quiet():
        model, tokenizer = _read(src)
        cfg = model.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config  # the weights are dequantized: a plain float32 model from here on
        model.hf_quantizer = None
        cfg._name_or_path = src.stem
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    (tmp / "gguf_source.json").write_text(json.dumps({"file": src.name, "bytes": src.stat().st_size}, indent=1))
    try:
        shutil.rmtree(out, ignore_errors=True)
        tmp.replace(out)
    except OSError:  # another process put its conversion there first: the same bytes
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "model.safetensors").is_file():
            raise
    log(f" {time.perf_counter() - t0:.0f} s\n")
    return out


_SHARED = threading.Lock()


@contextlib.contextmanager
def _one_reader_per_file():
    """While transformers' loader runs: ``gguf.GGUFReader`` returns one reader per file and ``gguf.get_tensor_name_map``
    one map per (architecture, layer count), where the loader would build them again for the tokenizer, the config,
    the weights and each module. Both are read-only to the loader; the originals are back on exit (the loader imports
    them from ``gguf`` inside its functions, so it finds these while they are set)."""
    import gguf

    with _SHARED:
        reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers, maps = {}, {}

        def one_reader(path, mode="r"):
            key = (os.fspath(path), mode)
            if key not in readers:
                readers[key] = reader(path, mode)
            return readers[key]

        def one_map(arch, n_blocks):
            if (arch, n_blocks) not in maps:
                maps[arch, n_blocks] = name_map(arch, n_blocks)
            return maps[arch, n_blocks]

        gguf.GGUFReader, gguf.get_tensor_name_map = one_reader, one_map
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _read(src: Path):
    """transformers' GGUF loader on ``src``: ``(model in float32, tokenizer)``; its errors as one ValueError."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _one_reader_per_file():
            tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
            model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    except ImportError:
        raise
    except Exception as e:  # the loader raises ValueError, KeyError, NotImplementedError, struct errors, ...
        cause = " ".join(str(e).split())[:240] or type(e).__name__
        raise ValueError(f"{src}: transformers' GGUF loader could not read it ({type(e).__name__}: {cause}); "
                         "expected an intact GGUF file of an architecture and quantization it supports "
                         "(Llama, Qwen2, ..., F32/F16/BF16/Q4_0/Q4_1/Q8_0/K-quants)") from None
    return model, tok


@contextlib.contextmanager
def _quiet():
    """transformers' notes and per-tensor progress bars off (its GGUF reader's bar is a plain tqdm on stderr): noise in
    a one-off conversion."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def resolve(path: Union[str, Path, None]) -> Union[str, Path, None]:
    """``path`` itself, or for a ``.gguf`` file the directory :func:`gguf_model_dir` makes of it."""
    return gguf_model_dir(path) if is_gguf(path) else path
