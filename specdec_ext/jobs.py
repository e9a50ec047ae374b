"""Batch generation jobs: prompts from a file or data set, batches of N rows, one JSON record per prompt
appended to a JSONL output, resumable (prompts whose id is already in the output are skipped).

What ``specdec generate --prompts SOURCE --out results.jsonl --batch-size N`` runs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from tqdm.auto import tqdm

from .engine.tensor_parallel import from_rank0, is_main_process
from .prompts import encode_prompt


def done_ids(out_path: Path) -> set:
    """Ids of the records already in ``out_path`` (a JSONL file; missing: none)."""
    if not out_path.exists():
        return set()
    ids = set()
    for i, line in enumerate(out_path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                ids.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError):
                raise ValueError(f"{out_path}:{i}: not a record of this job (a JSON object with an 'id'); "
                                 "choose another --out or remove the file") from None
    return ids


def run_job(gen, tokenizer, records: Sequence[tuple[str, str]], out_path, batch_size: int = 8,
            max_new_tokens: int = 128, temperature: float = 0.0, top_k: Optional[int] = None,
            top_p: Optional[float] = None, seed: int = 0, chat: bool = False, progress: bool = True,
            log: Callable[[str], None] = print) -> dict:
    """Generate a completion for every ``(id, prompt)`` of ``records`` not yet in ``out_path``, ``batch_size``
    rows at a time (left-padded), and append one record per prompt:
    ``{"id", "prompt", "completion", "new_tokens", "accepted_lengths", "batch_ms", "batch_tokens_per_s"}``.
    The prompt at position j of ``records`` samples with seed ``seed + j``, so a resumed job writes what
    an uninterrupted one would. Under ``torchrun`` with a tensor-parallel target, every rank runs the job and
    rank 0 alone reads and writes ``out_path``. The cost tables the policy needs are measured (or read from the
    cache) before the clock starts (``SpeculativeGenerator.prepare``). Returns a summary: prompts done now,
    skipped, tokens, seconds, decoding tokens/s (tokens over the generate() calls' wall time) and
    ``profile_seconds``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out_path = Path(out_path)
    write = is_main_process()  # a tensor-parallel target: every rank generates, rank 0 writes what rank 0 read
    skip = from_rank0(done_ids(out_path) if write else None)
    todo = [(j, rid, text) for j, (rid, text) in enumerate(records) if str(rid) not in skip]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    profile_s = gen.prepare(max(1, min(batch_size, len(todo)))) if todo else 0.0  # cost tables, before the clock
    t0 = time.time()
    tokens, decode_s = 0, 0.0
    bar = tqdm(total=len(todo), desc="generate", unit="prompt", disable=not progress)
    if write:
        out_path.parent.mkdir(parents=True, exist_ok=True)
    with (out_path if write else Path(os.devnull)).open("a", encoding="utf-8") as f:
        for i in range(0, len(todo), batch_size):
            chunk = todo[i : i + batch_size]
            encoded = [encode_prompt(tokenizer, text, chat) for _, _, text in chunk]
            for (_, rid, _), ids in zip(chunk, encoded):
                if not ids:
                    raise ValueError(f"prompt {rid!r} is empty (it has no token)")
            T = max(len(e) for e in encoded)
            ids = torch.tensor([[pad] * (T - len(e)) + e for e in encoded])
            mask = torch.tensor([[0] * (T - len(e)) + [1] * len(e) for e in encoded])
            out = gen.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=[seed + j for j, _, _ in chunk],
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
            st = out.stats
            for b, (_, rid, text) in enumerate(chunk):
                new = out.new_tokens[b]
                rec = {"id": rid, "prompt": text, "completion": tokenizer.decode(new, skip_special_tokens=True),
                       "new_tokens": len(new), "accepted_lengths": st.row_accepted_lengths(b),
                       "batch_ms": round(st.wall_ms, 2), "batch_tokens_per_s": round(st.tokens_per_s, 2)}
                f.write(json.dumps(rec) + "\n")
            f.flush()
            tokens += st.new_tokens
            decode_s += st.wall_ms / 1e3
            bar.update(len(chunk))
            bar.set_postfix(tokens_per_s=f"{tokens / max(1e-9, decode_s):.1f}")  # decoding speed
    bar.close()
    summary = {"done": len(todo), "skipped": len(skip & {str(r) for r, _ in records}), "new_tokens": tokens,
               "seconds": round(time.time() - t0, 1), "tokens_per_s": round(tokens / max(1e-9, decode_s), 1),
               "profile_seconds": round(profile_s, 1), "out": str(out_path)}
    log(f"[generate] {summary['done']} prompts ({summary['skipped']} already in {out_path}), {tokens} tokens in "
        f"{summary['seconds']} s, {summary['tokens_per_s']} tokens/s; set-up before decoding (cost profile, "
        f"warm-up) {summary['profile_seconds']} s")
    return summary
