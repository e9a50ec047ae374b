"""Calls follow the imports one level finer than tests/test_layers.py: the engine's scheduler and step runner and the
policies neither reach into a private attribute of an object they were handed, nor write into one. Read from the
source with ``ast``:

- a *reach-in* is ``x._name`` (a single leading underscore) where ``x`` is not ``self``, ``cls`` or a module;
- a *write* is an assignment (``=``, ``+=``, ``del``, or a subscript's) to an attribute of an object the function or
  class was handed: a parameter other than ``self``, a name bound from one (``for b in (draft, target)``), or a
  collaborator ``self.<name>`` that ``__init__`` took from a parameter as it is (``self.gen = gen``).

Metrics and measurements come back in results (``RoundOutput``, ``ContinuousOutput``) instead; the objects a layer
makes itself (its rows, its stats) it may write.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "specdec_ext"
# torch's own private API the engine reads on purpose: a tensor's version counter (no public accessor)
TORCH_PRIVATE = {"_version"}
CHECKED = ["engine/generator.py", "engine/scheduler.py", "engine/round.py", "engine/readback.py", "engine/steps.py",
           "engine/graphs.py", "engine/admission.py", "engine/backends.py", "engine/profile.py", "policies/base.py",
           "policies/builtin.py", "policies/specdecpp.py", "policies/budget.py", "policies/costs.py",
           "policies/drift.py", "policies/goodput.py", "policies/select.py"]


def _root(node: ast.AST):
    """The chain ``a.b[c].d`` -> (root name, [attribute names from the root])."""
    names = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), names[::-1]


def _targets(node: ast.AST) -> list:
    if isinstance(node, (ast.Assign,)):
        out = []
        for t in node.targets:
            out += list(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else [t]
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    return []


def violations(source: str) -> list[str]:
    """Reach-ins and writes (module docstring) in ``source``, as lines ``"<line>: <what>"``."""
    tree = ast.parse(source)
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            modules.update(a.asname or a.name for a in node.names if node.module is None or a.name[:1].islower())
    found = []
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)] + [tree]:
        handed = set()  # self.<name> taken as it is from an __init__ parameter
        for fn in cls.body if isinstance(cls, ast.ClassDef) else []:
            if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
                for node in ast.walk(fn):
                    if isinstance(node, ast.Assign):
                        pairs = []
                        for t in node.targets:
                            if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                                pairs += list(zip(t.elts, node.value.elts))
                            else:
                                pairs.append((t, node.value))
                        for t, v in pairs:
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" \
                                    and isinstance(v, ast.Name) and v.id in params and v.id != "self":
                                handed.add(t.attr)
        functions = [n for n in (cls.body if isinstance(cls, ast.ClassDef) else ast.walk(cls))
                     if isinstance(n, (ast.FunctionDef, ast.Lambda))]
        for fn in functions:
            args = fn.args
            params = {a.arg for a in args.args + args.kwonlyargs + args.posonlyargs} - {"self", "cls"}
            if args.vararg:
                params.add(args.vararg.arg)
            bound = set(params)
            for node in ast.walk(fn):  # names bound by iterating over handed objects: for b in (draft, target)
                if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
                    it = node.iter
                    names = {n.id for n in ast.walk(it) if isinstance(n, ast.Name)}
                    if names & params:
                        bound.add(node.target.id)
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                        and node.attr not in TORCH_PRIVATE:
                    base = node.value
                    if isinstance(base, ast.Name) and base.id not in ("self", "cls") and base.id not in modules:
                        found.append(f"{node.lineno}: reaches into {base.id}.{node.attr}")
                    elif isinstance(base, ast.Attribute) and _root(base)[0] == "self" and _root(base)[1][:1] and \
                            _root(base)[1][0] in handed:
                        found.append(f"{node.lineno}: reaches into self.{'.'.join(_root(base)[1])}.{node.attr}")
                for t in _targets(node):
                    if not isinstance(t, (ast.Attribute, ast.Subscript)):
                        continue
                    root, chain = _root(t)
                    if root in bound and root not in ("self", "cls"):
                        found.append(f"{t.lineno}: writes into {root}.{'.'.join(chain) or '[...]'}")
                    elif root == "self" and len(chain) >= 2 and chain[0] in handed:
                        found.append(f"{t.lineno}: writes into self.{'.'.join(chain)}")
    return sorted(set(found), key=lambda line: int(line.split(":")[0]))


@pytest.mark.parametrize("path", CHECKED)
def test_no_reach_in_and_no_write_into_a_handed_object(path):
    assert violations((PKG / path).read_text()) == []


def test_the_check_sees_reach_ins_and_writes():
    """Negative controls: each pattern the engine's seams ruled out is found."""
    source = '''
class Scheduler:
    def __init__(self, gen, stats):
        self.gen = gen
        self.stats = GenerationStats()

    def run(self, live, draft, target):
        self.gen._draft_overhead(self, live)
        self.gen.catch_up_ms += 1.0
        self.stats.rounds += 1
        for b in (draft, target):
            b.cache.lengths[3:4] = 0
        draft.calls += 1
        rows = [r for r in live]
        rows[0].ctx = []


def rule(policy):
    kept = policy._buffers(1, None)
    return kept
'''
    found = violations(source)
    assert [line.split(": ", 1)[1] for line in found] == [
        "reaches into self.gen._draft_overhead", "writes into self.gen.catch_up_ms", "writes into b.cache.lengths",
        "writes into draft.calls", "reaches into policy._buffers"], found
