"""The package's layers import one way (README, Layout): ops <- head <- policies <- engine <- training <-
zoo, benchmark, jobs <- cli. Every import of every module, at the top or inside a function, is read
from the source with `ast` and must point to the same layer or a lower one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "specdec_ext"

# module (dotted, without the package name) or package prefix -> layer; the longest prefix wins
LAYERS = {
    "errors": 0, "checks": 0, "reference": 0, "ops": 0, "layer_ops": 0, "_library": 0, "_C": 0,
    "corpus": 0, "prompts": 0,  # the stdlib corpus and the prompt sets read from it: leaves
    "transfer": 0,  # pinned host buffers for copies without a wait (engine and policies)
    "head": 1,
    "policies": 2,
    "engine": 3,
    "training": 4,
    "zoo": 5, "benchmark": 5, "batch_bench": 5, "serving": 5, "jobs": 5, "hf": 5, "llamacpp": 5,
    "benchmark_cli": 6, "cli": 6, "cli_models": 6, "__init__": 6,
}


def layer(module: str) -> int:
    best = None
    for prefix, rank in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, rank)
    if best is None:
        raise AssertionError(f"specdec_ext.{module} has no layer in tests/test_layers.py: give it one")
    return best[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, source: str | None = None) -> list[str]:
    """The specdec_ext modules that ``path`` imports (relative imports resolved); ``source``: its text."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if name == "__init__":
        package = []
    out = []
    for node in ast.walk(ast.parse(source if source is not None else path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = base + (node.module.split(".") if node.module else [])
                names = [".".join(target + [a.name]) for a in node.names] if not node.module else []
                out.extend(names or [".".join(target)])
            elif node.module and node.module.split(".")[0] == "specdec_ext":
                out.append(".".join(node.module.split(".")[1:]) or "__init__")
        elif isinstance(node, ast.Import):
            out.extend(".".join(a.name.split(".")[1:]) or "__init__" for a in node.names
                       if a.name.split(".")[0] == "specdec_ext")
    return out


SOURCES = sorted(p for p in PKG.rglob("*.py") if "pair" not in p.relative_to(PKG).parts)


def test_every_module_has_a_layer():
    assert len(SOURCES) > 20
    for p in SOURCES:
        layer(module_name(p))


@pytest.mark.parametrize("path", SOURCES, ids=[module_name(p) for p in SOURCES])
def test_imports_point_down(path):
    me = module_name(path)
    for target in imports_of(path):
        assert layer(target) <= layer(me), f"specdec_ext.{me} (layer {layer(me)}) imports specdec_ext.{target} " \
                                           f"(layer {layer(target)}): imports must point down"


def test_the_check_catches_an_upward_import():
    """Negative control: an engine module that imports the training package is flagged."""
    fake = PKG / "engine" / "generator.py"
    found = imports_of(fake, "from ..training.head_data import HeadDataset\nfrom . import runner\n")
    assert found == ["training.head_data", "engine.runner"]
    assert layer(found[0]) > layer(module_name(fake))


MODULES = {module_name(p) for p in SOURCES}


def resolve(target: str) -> str:
    """The module an import names: ``engine.runner.CausalLMRunner`` -> ``engine.runner``, ``zoo.load_pair`` -> ``zoo``."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MODULES:
            return ".".join(parts[:n])
    return "__init__"


def import_graph(sources=None) -> dict[str, set[str]]:
    """module -> the modules it imports (at the top or inside a function), self-imports left out;
    ``sources``: {module: source text} to check instead of the package's files."""
    if sources is None:
        sources = {module_name(p): p for p in SOURCES}
    graph = {}
    for name, src in sources.items():
        path = src if isinstance(src, Path) else PKG / (name.replace(".", "/") + ".py")
        text = None if isinstance(src, Path) else src
        graph[name] = {resolve(t) for t in imports_of(path, text)} - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as a list of nodes (first repeated at the end), or [] when there is none."""
    state, stack = {}, []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def package_of(module: str) -> str:
    return module.split(".")[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        out.setdefault(package_of(mod), set()).update(package_of(t) for t in targets if package_of(t) != package_of(mod))
    return out


def test_no_import_cycle_between_modules():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_between_packages():
    cycle = find_cycle(package_graph(import_graph()))
    assert not cycle, "import cycle between packages: " + " -> ".join(cycle)


def test_the_cycle_checks_catch_a_cycle():
    """Negative controls: two engine modules that import each other (one inside a function), and two packages
    whose modules import across them both ways, are flagged."""
    graph = import_graph({"engine.generator": "from .profile import cached_profile\n",
                          "engine.profile": "def f():\n    from .generator import SpeculativeGenerator\n"})
    assert find_cycle(graph) == ["engine.generator", "engine.profile", "engine.generator"]
    graph = import_graph({"prompts": "from .zoo.train import x\n", "zoo.train": "from ..prompts import load_prompts\n"})
    assert find_cycle(graph) == ["prompts", "zoo.train", "prompts"]
    assert find_cycle(package_graph({"a.x": {"b.y"}, "b.z": {"a.w"}})) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []
