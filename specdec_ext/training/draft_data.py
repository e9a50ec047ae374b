"""Data for distilling a draft from a target, made offline: prompts drawn from what ships on the machine, and the
target's own continuations of them.

Prompts (never the prompt sets the benchmarks evaluate on: HumanEval and ``bench/data``):

- ``code``: function and method headers (decorators, signature, docstring) of the standard library's training split
  (``corpus.split_files()["train"]``), and the first lines of its modules;
- ``docs``: paragraphs of Python's documentation sources (Debian's ``python3.11-doc``,
  ``/usr/share/doc/python3.11/html/_sources``), continued as text;
- ``chat``: user turns asking for an example of a documented function (``.. function:: name(...)`` entries of the
  same documentation), in the tokenizer's chat template where it has one.

:func:`generate_continuations` decodes the target over them in shards with the engine's continuous batching
(greedy for most prompts, T = 1 for one in four), so the draft learns the text the target itself writes, which is
what it will be asked to predict. Each shard is a ``.pt`` file written once; a rerun skips the shards it finds
(resumable after an interruption).
"""

from __future__ import annotations

import ast
import random
import re
from pathlib import Path
from typing import Callable, Optional

import torch

DOCS_ROOT = Path("/usr/share/doc/python3.11/html/_sources")
SAMPLED_EVERY = 4  # one prompt in SAMPLED_EVERY is continued at temperature 1, the rest greedily


def code_prompts() -> list[str]:
    """Function and method headers with docstrings, and module beginnings, of the standard library's training
    split (the bundled corpus's split: its held-out files are the ``stdlib`` evaluation prompts)."""
    from ..corpus import read_source, split_files

    out = []
    for path in split_files()["train"]:
        src = read_source(path)
        try:
            tree = ast.parse(src)
        except (SyntaxError, ValueError):
            continue
        lines = src.splitlines(keepends=True)
        head = "".join(lines[:24]).strip()
        if len(head) > 80:
            out.append(head + "\n")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node) and node.body:
                doc = node.body[0]
                start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
                text = "".join(lines[start: doc.end_lineno])
                if len(text) < 4000:
                    indent = len(text) - len(text.lstrip(" "))
                    out.append("\n".join(ln[indent:] for ln in text.split("\n")))
    return out


def _doc_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.rst.txt")) if root.is_dir() else []


def docs_prompts(root: Path = DOCS_ROOT) -> list[str]:
    """Paragraphs of 200-1,500 characters from Python's documentation sources (empty where they are not installed)."""
    out = []
    for path in _doc_files(root):
        for para in path.read_text(encoding="utf-8", errors="replace").split("\n\n"):
            para = para.strip()
            if 200 <= len(para) <= 1500 and not para.startswith(("..", "=", "-", "*")):
                out.append(para)
    return out


_FUNCTION = re.compile(r"^\.\. (?:function|method|class):: ([A-Za-z_][\w.]*)\(", re.M)
_MODULE = re.compile(r"^\.\. module:: ([\w.]+)", re.M)
_ASKS = ("Write a short Python example that uses `{}`.", "How do I use `{}` in Python? Show an example.",
         "Explain what `{}` does, with a code example.")


def chat_prompts(root: Path = DOCS_ROOT) -> list[str]:
    """User requests for an example of each documented function, method or class (``module.name``)."""
    out = []
    for path in _doc_files(root / "library"):
        text = path.read_text(encoding="utf-8", errors="replace")
        mod = _MODULE.search(text)
        for i, m in enumerate(_FUNCTION.finditer(text)):
            name = m.group(1)
            if mod and "." not in name:
                name = f"{mod.group(1)}.{name}"
            out.append(_ASKS[i % len(_ASKS)].format(name))
    return out


def draft_prompts(tokenizer, limit: int, seed: int = 0, max_prompt_tokens: int = 256) -> list[dict]:
    """``limit`` prompts as ``{"kind", "ids"}`` records, drawn without replacement from the three kinds (about 60%
    code, 20% docs, 20% chat where the documentation is installed; all code otherwise), shuffled with ``seed``; a
    prompt is cut to its last ``max_prompt_tokens`` tokens."""
    from ..prompts import encode_prompt

    rng = random.Random(seed)
    pools = {"code": code_prompts(), "docs": docs_prompts(), "chat": chat_prompts()}
    share = {"code": 0.6, "docs": 0.2, "chat": 0.2} if pools["docs"] and pools["chat"] else {"code": 1.0}
    chat = getattr(tokenizer, "chat_template", None) is not None
    records = []
    for kind, frac in share.items():
        pool = pools[kind]
        rng.shuffle(pool)
        for text in pool[: int(round(limit * frac))]:
            ids = encode_prompt(tokenizer, text, chat=chat and kind == "chat")
            records.append({"kind": kind, "ids": ids[-max_prompt_tokens:]})
    rng.shuffle(records)
    return records[:limit]


def generate_continuations(target, tokenizer, work: Path, prompts: int = 3072, max_new_tokens: int = 96,
                           batch_size: int = 64, shard: int = 256, seed: int = 0,
                           progress: Optional[Callable] = None) -> list[Path]:
    """The target's continuations of :func:`draft_prompts` in shards of ``shard`` prompts under ``work/data/``:
    ``shard-NNNN.pt`` holds ``{"prompt": [ids...], "new": [ids...], "kind": [...], "temperature": [...]}``. Existing
    shards are kept (a rerun resumes). Returns the shard paths in order.

    Raises ValueError for ``prompts`` or ``max_new_tokens`` < 1."""
    from ..engine.generator import SpeculativeGenerator

    if prompts < 1 or max_new_tokens < 1:
        raise ValueError(f"prompts and max_new_tokens must be >= 1, got {prompts} and {max_new_tokens}")
    out = Path(work) / "data"
    out.mkdir(parents=True, exist_ok=True)
    records = draft_prompts(tokenizer, prompts, seed)
    gen = SpeculativeGenerator(target, None, policy="autoregressive")
    paths = []
    starts = range(0, len(records), shard)
    bar = progress(total=len(records), desc="target continuations", unit="prompt") if progress else None
    for n, lo in enumerate(starts):
        path = out / f"shard-{n:04d}.pt"
        part = records[lo: lo + shard]
        if not path.exists():
            temps = [1.0 if (lo + i) % SAMPLED_EVERY == 0 else 0.0 for i in range(len(part))]
            served = gen.generate_continuous([r["ids"] for r in part], batch_size=batch_size,
                                             max_new_tokens=max_new_tokens, temperature=temps, seed=seed + lo,
                                             eos_token_id=tokenizer.eos_token_id)
            blob = {"prompt": [r["ids"] for r in part], "new": [list(map(int, t)) for t in served.new_tokens],
                    "kind": [r["kind"] for r in part], "temperature": temps}
            tmp = path.with_suffix(".tmp")
            torch.save(blob, tmp)
            tmp.replace(path)
        paths.append(path)
        if bar is not None:
            bar.update(len(part))
    if bar is not None:
        bar.close()
    return paths


def load_sequences(paths: list[Path], max_len: int = 320) -> list[tuple[list[int], int]]:
    """``(tokens, prompt_length)`` of every shard's prompt and continuation, the prompt cut from the left so that the
    sequence has at most ``max_len`` tokens."""
    seqs = []
    for p in paths:
        blob = torch.load(p)
        for prompt, new in zip(blob["prompt"], blob["new"]):
            keep = max(1, max_len - len(new))
            prompt = prompt[-keep:]
            seqs.append(((prompt + new)[:max_len], len(prompt)))
    return seqs
