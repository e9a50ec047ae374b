"""How the bundled pair's weights are stored: xz-compressed in the package, unpacked once into the user's cache.

The repository ships ``target/model.safetensors.xz`` and ``draft/model.safetensors.xz`` (Python's ``lzma``,
preset 9: the target's 56 MiB of bf16 weights take 39 MiB) so that the tree fits the places it has to travel.
``zoo_meta.json["weights"]`` records, per file, the sha256 and size of the unpacked bytes. The first
:func:`pair_dir` unpacks both into ``<cache>/pair-<sha256 prefix>/`` (``SPECDEC_CACHE_DIR`` or
``~/.cache/specdec_ext``) with a progress line, checks each against its sha256, and later calls find them
there by size without unpacking again. A pair directory that holds unpacked weights itself (as
``specdec zoo train`` leaves its output) is used as it is.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

from ..engine.profile import cache_dir

WEIGHTS = ("target/model.safetensors", "draft/model.safetensors")
XZ = ".xz"
_CHUNK = 1 << 22


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _meta(pair: Path) -> dict:
    p = pair / "zoo_meta.json"
    return json.loads(p.read_text()) if p.exists() else {}


def pack_weights(pair: Path, preset: int = 9, log=print) -> dict:
    """Compress each unpacked ``model.safetensors`` of ``WEIGHTS`` in ``pair`` to ``model.safetensors.xz`` and record
    its sha256 and size in ``pair/zoo_meta.json["weights"]``; the unpacked files stay. Returns that record."""
    meta = _meta(pair)
    record = meta.get("weights", {})
    for rel in WEIGHTS:
        raw = pair / rel
        if not raw.exists():
            continue
        t0 = time.perf_counter()
        tmp = raw.with_name(raw.name + XZ + ".tmp")
        with open(raw, "rb") as src, lzma.open(tmp, "wb", preset=preset) as dst:
            shutil.copyfileobj(src, dst, _CHUNK)
        tmp.replace(raw.with_name(raw.name + XZ))
        record[rel] = {"sha256": _sha256(raw), "bytes": raw.stat().st_size}
        log(f"[zoo] {rel}{XZ}: {raw.stat().st_size / 2**20:.1f} MiB -> "
            f"{raw.with_name(raw.name + XZ).stat().st_size / 2**20:.1f} MiB in {time.perf_counter() - t0:.0f} s")
    meta["weights"] = record
    (pair / "zoo_meta.json").write_text(json.dumps(meta, indent=2))
    return record


def has_unpacked(pair: Path) -> bool:
    return all((pair / rel).is_file() for rel in WEIGHTS)


def pair_dir(pair: Path, cache: Optional[Path] = None, log=None) -> Path:
    """A directory with ``target/`` and ``draft/`` that ``from_pretrained`` loads: ``pair`` itself when it holds
    unpacked weights, else the cache directory the packed weights are unpacked into (once).

    Raises FileNotFoundError when ``pair`` has neither unpacked nor packed weights, or ``zoo_meta.json`` lacks a
    packed file's sha256; ValueError naming the file when its unpacked bytes do not match the recorded sha256."""
    if has_unpacked(pair):
        return pair
    record = _meta(pair).get("weights", {})
    missing = [rel + XZ for rel in WEIGHTS if not (pair / (rel + XZ)).is_file() or rel not in record]
    if missing:
        raise FileNotFoundError(f"{pair}: no model weights for {', '.join(missing)} (neither unpacked nor packed with "
                                "their sha256 in zoo_meta.json); train the pair with `specdec zoo train`")
    key = hashlib.sha256("".join(record[rel]["sha256"] for rel in WEIGHTS).encode()).hexdigest()[:16]
    out = (cache or cache_dir()) / f"pair-{key}"
    log = log or (lambda msg: print(msg, file=sys.stderr, end="", flush=True))
    for rel in WEIGHTS:
        model_dir = (out / rel).parent
        model_dir.mkdir(parents=True, exist_ok=True)
        for f in (pair / rel).parent.iterdir():  # config and tokenizer files, small: refreshed on every call
            if f.is_file() and not f.name.startswith("model.safetensors"):
                dst = model_dir / f.name
                if not dst.exists() or dst.stat().st_size != f.stat().st_size:
                    shutil.copyfile(f, dst)
        dst = out / rel
        if dst.is_file() and dst.stat().st_size == record[rel]["bytes"]:
            continue
        _unpack(pair / (rel + XZ), dst, record[rel], log)
    return out


def _unpack(src: Path, dst: Path, want: dict, log) -> None:
    t0 = time.perf_counter()
    log(f"[specdec] unpacking the bundled {dst.parent.name}'s weights ({want['bytes'] / 2**20:.0f} MiB) into {dst.parent} ...")
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
    h = hashlib.sha256()
    try:
        with lzma.open(src, "rb") as fin, open(tmp, "wb") as fout:
            for block in iter(lambda: fin.read(_CHUNK), b""):
                h.update(block)
                fout.write(block)
    except (lzma.LZMAError, EOFError) as e:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"{src}: not a readable xz file ({e}); restore it (git checkout) or retrain the pair "
                         "with `specdec zoo train`") from None
    if h.hexdigest() != want["sha256"]:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"{src}: unpacked sha256 {h.hexdigest()[:16]}... does not match zoo_meta.json's "
                         f"{want['sha256'][:16]}...; restore the file (git checkout) or retrain with `specdec zoo train`")
    tmp.replace(dst)
    log(f" {time.perf_counter() - t0:.1f} s\n")
