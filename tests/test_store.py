"""How the bundled pair is stored (``zoo/store.py``): xz-compressed weights with their sha256, unpacked once into
the cache and checked; a damaged file or a model directory that fails to load gives one error naming it; and the
tracked tree stays small enough to travel to a GPU machine."""

from __future__ import annotations

import json
import lzma
import subprocess
from pathlib import Path

import pytest

from models import make_target
from specdec_ext.zoo import load_models, store

ROOT = Path(__file__).resolve().parents[1]
TREE_LIMIT = 60 * 2**20  # bytes: a GPU machine takes a working tree of at most 64 MiB (untracked build files too)


def fake_pair(root: Path) -> Path:
    """A pair directory with small stand-ins for the two weights files (random bytes) and a config each."""
    for i, rel in enumerate(store.WEIGHTS):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(bytes((7 * j + i) % 251 for j in range(50_000 + i)))
        (p.parent / "config.json").write_text(json.dumps({"model": p.parent.name}))
    return root


def test_packed_weights_unpack_once_into_the_cache_and_match(tmp_path):
    pair = fake_pair(tmp_path / "pair")
    originals = {rel: (pair / rel).read_bytes() for rel in store.WEIGHTS}
    record = store.pack_weights(pair, preset=1, log=lambda m: None)
    assert set(record) == set(store.WEIGHTS) and record[store.WEIGHTS[0]]["bytes"] == 50_000
    assert json.loads((pair / "zoo_meta.json").read_text())["weights"] == record
    assert store.pair_dir(pair, tmp_path / "cache") == pair  # unpacked weights present: used as they are
    for rel in store.WEIGHTS:
        (pair / rel).unlink()
    lines = []
    out = store.pair_dir(pair, tmp_path / "cache", log=lines.append)
    assert out.parent == tmp_path / "cache" and out != pair
    for rel in store.WEIGHTS:
        assert (out / rel).read_bytes() == originals[rel]
        assert (out / rel).parent.joinpath("config.json").is_file()
    assert sum("unpacking" in m for m in lines) == 2
    lines.clear()
    assert store.pair_dir(pair, tmp_path / "cache", log=lines.append) == out  # later loads: no unpacking
    assert lines == []


def test_a_damaged_or_altered_packed_file_is_refused_by_name(tmp_path):
    pair = fake_pair(tmp_path / "pair")
    store.pack_weights(pair, preset=1, log=lambda m: None)
    for rel in store.WEIGHTS:
        (pair / rel).unlink()
    target_xz = pair / (store.WEIGHTS[0] + store.XZ)
    target_xz.write_bytes(lzma.compress(b"other weights"))  # a valid xz file whose content is not the recorded one
    with pytest.raises(ValueError, match=r"target/model\.safetensors\.xz: unpacked sha256 .* does not match"):
        store.pair_dir(pair, tmp_path / "cache", log=lambda m: None)
    assert not list((tmp_path / "cache").rglob("model.safetensors*"))  # nothing half-written left behind
    target_xz.write_bytes(b"\xfd7zXZ\x00 truncated")
    with pytest.raises(ValueError, match=r"target/model\.safetensors\.xz: not a readable xz file"):
        store.pair_dir(pair, tmp_path / "cache", log=lambda m: None)
    meta = json.loads((pair / "zoo_meta.json").read_text())
    del meta["weights"][store.WEIGHTS[1]]
    (pair / "zoo_meta.json").write_text(json.dumps(meta))
    with pytest.raises(FileNotFoundError, match=r"draft/model\.safetensors\.xz"):
        store.pair_dir(pair, tmp_path / "cache", log=lambda m: None)


def test_the_bundled_pair_records_the_sha256_of_both_packed_files():
    meta = json.loads((ROOT / "specdec_ext/zoo/pair/zoo_meta.json").read_text())
    for rel in store.WEIGHTS:
        assert (ROOT / "specdec_ext/zoo/pair" / (rel + store.XZ)).is_file()
        assert len(meta["weights"][rel]["sha256"]) == 64 and meta["weights"][rel]["bytes"] > 1_000_000


def test_a_model_directory_that_fails_to_load_is_named_in_one_line(tmp_path):
    model_dir = tmp_path / "target"
    make_target().save_pretrained(model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    with pytest.raises(ValueError, match=r"target: could not load the model \(SafetensorError: .*\)$") as info:
        load_models(model_dir, tokenizer=ROOT / "specdec_ext/zoo/pair/target")
    assert "\n" not in str(info.value)


def tracked_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")
def test_the_tracked_tree_fits_a_gpu_machine():
    size = tracked_bytes()
    assert 10 * 2**20 < size <= TREE_LIMIT, f"tracked files take {size / 2**20:.1f} MiB (limit {TREE_LIMIT / 2**20:.0f})"
