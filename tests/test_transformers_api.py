"""transformers as it moves: the runner passes the KV cache under the keyword the installed version takes, no call
that starts in specdec_ext raises a deprecation warning (pyproject.toml makes FutureWarning and DeprecationWarning
errors for the whole suite), and the installed version lies in the range pyproject.toml allows and the README
names."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from packaging.requirements import Requirement
from packaging.version import Version

from specdec_ext import SpeculativeGenerator
from specdec_ext.engine.runner import cache_keyword
from models import make_pair

ROOT = Path(__file__).resolve().parents[1]


def _bound() -> Requirement:
    text = (ROOT / "pyproject.toml").read_text()
    line = re.search(r'"(transformers[^"]*)"', text)
    assert line, "pyproject.toml names no transformers requirement"
    return Requirement(line.group(1))


def test_the_installed_transformers_lies_in_the_bound_the_readme_names():
    spec = _bound().specifier
    assert Version(transformers.__version__) in spec, f"transformers {transformers.__version__} outside {spec}"
    lows = [s.version for s in spec if s.operator == ">="]
    highs = [s.version for s in spec if s.operator == "<"]
    assert len(lows) == 1 and len(highs) == 1, f"pyproject.toml must bound transformers on both sides, got {spec}"
    low, high = Version(lows[0]), Version(highs[0])
    tested = re.search(r"Tested with transformers (\d+\.\d+) to (\d+\.\d+)", (ROOT / "README.md").read_text())
    assert tested, "the README names no tested transformers range"
    first, last = Version(tested.group(1)), Version(tested.group(2))
    assert first == low, f"README's tested range starts at {first}, pyproject.toml's bound at {low}"
    assert last < high and Version(f"{last.major}.{last.minor + 1}") == high, \
        f"pyproject.toml allows transformers < {high}, the README says it is tested up to {last}"


def test_the_runner_passes_the_cache_under_the_current_keyword():
    target, _ = make_pair("llama")
    import inspect

    params = inspect.signature(target.forward).parameters
    assert cache_keyword(target) == ("cache" if "cache" in params else "past_key_values")
    assert cache_keyword(target) in params


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_a_call_raises_no_deprecation_warning(lean):
    target, draft = make_pair("llama")
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=3, fast_target=lean, fast_draft=lean)
    ids = torch.tensor([[0, 5, 7, 3, 9], [1, 1, 4, 6, 8]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen.generate(ids, attention_mask=(ids != 1).long(), max_new_tokens=12, temperature=0)
        gen.generate_continuous([[4, 5, 6], [7, 8]], 2, max_new_tokens=6, temperature=1.0, seed=3)
    deprecations = [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not deprecations, [f"{w.category.__name__}: {w.message}" for w in deprecations]
