"""Out-of-domain prompt sets, code the bundled pair never saw (it was trained on the standard library alone), for
``specdec bench --dataset FILE.jsonl``. Three sources, each its own set:

- ``headers``: function headers with their docstrings from third-party Python packages, in HumanEval's form (a
  signature and a docstring, the body left to the model): every top-level function whose docstring has at least 40
  characters and whose header and docstring together fit in 200-900 characters.
- ``tests``: test functions from the test suites of third-party Python packages (``tests/test_*.py``): a
  ``def test_...`` line and the first statements of its body, 120-600 characters; the model continues the test.
- ``javascript``: JavaScript functions from the packages npm bundles (``node_modules`` beside the npm that Node.js
  ships): a top-level ``function`` with the comment above it, its header and its first line, 120-700 characters.

Per source, from each package as installed on the machine that ran it (versions recorded per prompt where known),
with a fixed seed, at most ``--per-package`` prompts per package and ``--count`` in all. Each record: ``id``,
``prompt`` (ending in a newline), and ``source`` (package, version, file, line).

    python bench/make_ood_prompts.py --source headers --out bench/data/thirdparty_headers.jsonl
    python bench/make_ood_prompts.py --source tests --out bench/data/thirdparty_tests.jsonl
    python bench/make_ood_prompts.py --source javascript --per-package 3 --out bench/data/javascript.jsonl
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import random
import re
import sys
from pathlib import Path

PACKAGES = ("anyio", "click", "filelock", "fire", "fsspec", "h11", "httpx", "huggingface_hub", "markdown_it",
            "matplotlib", "psutil", "rich", "safetensors", "termcolor", "tqdm", "accelerate", "PIL", "fontTools")
DISTRIBUTIONS = {"PIL": "pillow", "fontTools": "fonttools", "markdown_it": "markdown-it-py"}


def headers(package: str) -> list[dict]:
    """Every top-level function of ``package``'s modules with a docstring, as a prompt and its source."""
    found = []
    skip = ("tests", "testing", "_vendor", "vendor")
    for file, version, lines, tree in _modules(package, "*.py"):
        if "test" in Path(file).name or any(p in skip for p in Path(file).parts):
            continue
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node, clean=False)
            if not doc or len(doc.strip()) < 40 or not node.body or not isinstance(node.body[0], ast.Expr):
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            prompt = "\n".join(lines[start - 1: node.body[0].end_lineno]) + "\n"
            if 200 <= len(prompt) <= 900:
                found.append({"prompt": prompt, "source": {"package": package, "version": version, "file": file,
                                                            "line": start}})
    return found


def _modules(package: str, pattern: str):
    """Each module of ``package`` (as installed) whose path matches ``pattern`` and that parses: (its path from the
    package's parent, the package's version, its lines, its syntax tree), in path order."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return
    root = Path(list(spec.submodule_search_locations)[0])
    version = _version(package)
    for path in sorted(root.rglob(pattern)):
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        yield str(path.relative_to(root.parent)), version, text.splitlines(), tree


TEST_PACKAGES = ("sympy", "scipy", "networkx", "numpy", "libcst", "IPython", "mpmath", "jsonschema")
NPM_MODULES = Path("/usr/lib/node_modules/npm/node_modules")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(DISTRIBUTIONS.get(package, package))
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def tests(package: str, lines_max: int = 3) -> list[dict]:
    """Every top-level ``test_*`` function of ``package``'s ``tests/test_*.py`` files: its header (decorators
    included) and up to ``lines_max`` statements of its body, as a prompt of 120-600 characters."""
    found = []
    for file, version, lines, tree in _modules(package, "tests/test_*.py"):
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_") or len(node.body) < 2:
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            body = [b for b in node.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
            if not body:
                continue
            end = body[min(lines_max, len(body)) - 1].end_lineno
            prompt = "\n".join(lines[start - 1: end]) + "\n"
            if 120 <= len(prompt) <= 600:
                found.append({"prompt": prompt, "source": {"package": package, "version": version, "file": file,
                                                            "line": start}})
    return found


_JS_FUNCTION = re.compile(r"^(async\s+)?function\s*\*?\s*[A-Za-z_$][\w$]*\s*\(")


def javascript(module: Path) -> list[dict]:
    """Every top-level ``function`` of ``module``'s ``.js`` files (a line that starts with it and whose next line is
    indented): the comment block right above it (``//`` lines or a ``/* ... */`` block), its header line and the
    first line of its body, as a prompt of 120-700 characters."""
    version = "unknown"
    try:
        version = json.loads((module / "package.json").read_text(encoding="utf-8")).get("version", "unknown")
    except (OSError, ValueError):
        pass
    found = []
    for path in sorted(module.rglob("*.js")):
        if "node_modules" in path.relative_to(module).parts or path.name.endswith(".min.js"):
            continue
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for i, line in enumerate(lines[:-1]):
            if not _JS_FUNCTION.match(line) or not line.rstrip().endswith("{") or not lines[i + 1][:1].isspace():
                continue
            start = i
            if i and lines[i - 1].strip().endswith("*/"):  # a block comment ending right above
                while start > 0 and "/*" not in lines[start - 1]:
                    start -= 1
                start -= 1
            while start > 0 and lines[start - 1].lstrip().startswith("//"):
                start -= 1
            prompt = "\n".join(lines[start: i + 2]) + "\n"
            if 120 <= len(prompt) <= 700:
                found.append({"prompt": prompt, "source": {"package": module.name, "version": version,
                                                            "file": str(path.relative_to(module.parent)),
                                                            "line": start + 1}})
    return found


def npm_modules() -> list[Path]:
    """npm's bundled packages (scoped ones one level down)."""
    out = []
    for p in sorted(NPM_MODULES.iterdir()) if NPM_MODULES.is_dir() else []:
        out += sorted(q for q in p.iterdir() if q.is_dir()) if p.name.startswith("@") else [p]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", choices=("headers", "tests", "javascript"), default="headers")
    ap.add_argument("--count", type=int, default=80)
    ap.add_argument("--per-package", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    chosen = []
    sources = {"headers": [(p, headers) for p in PACKAGES], "tests": [(p, tests) for p in TEST_PACKAGES],
               "javascript": [(m, javascript) for m in npm_modules()]}[args.source]
    for package, collect in sources:
        found = collect(package)
        rng.shuffle(found)
        chosen += found[: args.per_package]
        print(f"{getattr(package, 'name', package)}: {len(found)} functions, {min(len(found), args.per_package)} taken",
              file=sys.stderr)
    rng.shuffle(chosen)
    chosen = chosen[: args.count]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for i, rec in enumerate(chosen):
            prefix = "ood" if args.source == "headers" else args.source  # the headers set kept its first ids
            f.write(json.dumps({"id": f"{prefix}{i:03d}", **rec}) + "\n")
    print(f"{len(chosen)} prompts -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
