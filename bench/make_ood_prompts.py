"""An out-of-domain prompt set: function headers with their docstrings from third-party Python packages, code the
bundled pair never saw (it was trained on the standard library alone), in HumanEval's form (a signature and a
docstring, the body left to the model), for ``specdec bench --dataset FILE.jsonl``.

From each package below, as installed beside the project (the versions are recorded per prompt), every top-level
function whose docstring has at least 40 characters and whose header and docstring together fit in 200-900
characters; then, with a fixed seed, at most ``--per-package`` of them per package and ``--count`` in all. Each
record: ``id``, ``prompt`` (the ``def`` line(s) and the docstring, as in the source, ending in a newline), and
``source`` (package, version, file, line).

    python bench/make_ood_prompts.py --out bench/data/thirdparty_headers.jsonl
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import random
import sys
from pathlib import Path

PACKAGES = ("anyio", "click", "filelock", "fire", "fsspec", "h11", "httpx", "huggingface_hub", "markdown_it",
            "matplotlib", "psutil", "rich", "safetensors", "termcolor", "tqdm", "accelerate", "PIL", "fontTools")
DISTRIBUTIONS = {"PIL": "pillow", "fontTools": "fonttools", "markdown_it": "markdown-it-py"}


def headers(package: str) -> list[dict]:
    """Every top-level function of ``package``'s modules with a docstring, as a prompt and its source."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(list(spec.submodule_search_locations)[0])
    version = importlib.metadata.version(DISTRIBUTIONS.get(package, package))
    found = []
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts[-1] or any(p in ("tests", "testing", "_vendor", "vendor") for p in path.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = text.splitlines()
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node, clean=False)
            if not doc or len(doc.strip()) < 40 or not node.body or not isinstance(node.body[0], ast.Expr):
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            prompt = "\n".join(lines[start - 1: node.body[0].end_lineno]) + "\n"
            if 200 <= len(prompt) <= 900:
                found.append({"prompt": prompt, "source": {"package": package, "version": version,
                                                            "file": str(path.relative_to(root.parent)),
                                                            "line": start}})
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=80)
    ap.add_argument("--per-package", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    chosen = []
    for package in PACKAGES:
        found = headers(package)
        rng.shuffle(found)
        chosen += found[: args.per_package]
        print(f"{package}: {len(found)} functions, {min(len(found), args.per_package)} taken", file=sys.stderr)
    rng.shuffle(chosen)
    chosen = chosen[: args.count]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for i, rec in enumerate(chosen):
            f.write(json.dumps({"id": f"ood{i:03d}", **rec}) + "\n")
    print(f"{len(chosen)} prompts -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
