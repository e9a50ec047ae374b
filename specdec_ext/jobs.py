"""Batch generation jobs: prompts from a file or data set, batches of N rows, one JSON record per prompt
appended to a JSONL output, resumable (prompts whose id is already in the output are skipped).

What ``specdec generate --prompts SOURCE --out results.jsonl --batch-size N`` runs. A batch's records reach the
file in one append of whole lines; a process killed in the middle of it (the kernel may stop a write between
pages) leaves at most an unfinished last line, which the next run cuts before it appends. Stopped by SIGINT or
SIGTERM (``handle_signals=True``, as the CLI runs it), a job finishes the append in progress, or drops the batch it
is generating, and raises :class:`JobInterrupted`: never a broken line, never a record twice, and a rerun resumes.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from tqdm.auto import tqdm

from .engine.tensor_parallel import from_rank0, is_main_process
from .prompts import encode_prompt


class JobInterrupted(Exception):
    """A batch job stopped by a signal (``run_job(handle_signals=True)``) with whole records written: ``signum``,
    ``written`` (records this run appended), ``total`` (records in the file), ``out`` (its path)."""

    def __init__(self, signum: int, written: int, total: int, out: Path):
        self.signum, self.written, self.total, self.out = signum, written, total, out
        super().__init__(f"stopped by {signal.Signals(signum).name}: {written} records written to {out} by this run "
                         f"({total} in the file); the same command resumes")


def done_ids(out_path: Path, repair: bool = False) -> set:
    """Ids of the records already in ``out_path`` (a JSONL file; missing: none). ``repair``: first cut an unfinished
    last line (no newline: a run killed while appending) off the file.

    Raises ValueError for a line that is not a record of a job (naming the file and line)."""
    if not out_path.exists():
        return set()
    data = out_path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        if repair:
            with out_path.open("r+b") as f:
                f.truncate(keep)
        data = data[:keep]
    ids = set()
    for i, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if line.strip():
            try:
                ids.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError):
                raise ValueError(f"{out_path}:{i}: not a record of this job (a JSON object with an 'id'); "
                                 "choose another --out or remove the file") from None
    return ids


@contextmanager
def _signals_deferred_while_writing(enabled: bool):
    """Within it, SIGINT and SIGTERM raise :class:`_Stop` at once, or, inside ``state["writing"]``, once the append
    in progress has ended (``state["signal"]``). A no-op unless ``enabled`` and on the main thread (where Python
    runs signal handlers)."""
    state = {"writing": False, "signal": None}
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield state
        return

    def handler(signum, frame):
        state["signal"] = signum
        if not state["writing"]:
            raise _Stop(signum)

    before = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield state
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)


class _Stop(BaseException):
    """A signal inside a job (not an Exception: nothing between the handler and the job's loop catches it)."""

    def __init__(self, signum: int):
        self.signum = signum


def _append(fd: int, text: str) -> None:
    """``text`` (whole lines) appended to the file open at ``fd`` (O_APPEND), written until every byte is out."""
    data = text.encode("utf-8")
    while data:
        data = data[os.write(fd, data):]


def run_job(gen, tokenizer, records: Sequence[tuple[str, str]], out_path, batch_size: int = 8,
            max_new_tokens: int = 128, temperature: float = 0.0, top_k: Optional[int] = None,
            top_p: Optional[float] = None, seed: int = 0, chat: bool = False, progress: bool = True,
            log: Callable[[str], None] = print, handle_signals: bool = False) -> dict:
    """Generate a completion for every ``(id, prompt)`` of ``records`` not yet in ``out_path``, ``batch_size``
    rows at a time (left-padded), and append one record per prompt:
    ``{"id", "prompt", "completion", "new_tokens", "accepted_lengths", "batch_ms", "batch_tokens_per_s"}``.
    The prompt at position j of ``records`` samples with seed ``seed + j``, so a resumed job writes what
    an uninterrupted one would. Under ``torchrun`` with a tensor-parallel target, every rank runs the job and
    rank 0 alone reads and writes ``out_path``. The cost tables the policy needs are measured (or read from the
    cache) before the clock starts (``SpeculativeGenerator.prepare``). Returns a summary: prompts done now,
    skipped, tokens, seconds, decoding tokens/s (tokens over the generate() calls' wall time) and
    ``profile_seconds``. ``handle_signals``: SIGINT and SIGTERM stop the job between whole records (module
    docstring).

    Raises:
        JobInterrupted: with ``handle_signals``, after SIGINT or SIGTERM (the records written so far are whole).
        ValueError: ``batch_size`` < 1, an empty prompt, an output file that is not this kind of job's."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out_path = Path(out_path)
    write = is_main_process()  # a tensor-parallel target: every rank generates, rank 0 writes what rank 0 read
    skip = from_rank0(done_ids(out_path, repair=True) if write else None)
    todo = [(j, rid, text) for j, (rid, text) in enumerate(records) if str(rid) not in skip]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    profile_s = gen.prepare(max(1, min(batch_size, len(todo)))) if todo else 0.0  # cost tables, before the clock
    t0 = time.time()
    tokens, decode_s = 0, 0.0
    bar = tqdm(total=len(todo), desc="generate", unit="prompt", disable=not progress)
    if write:
        out_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_path if write else os.devnull, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    written = 0
    try:
        with _signals_deferred_while_writing(handle_signals) as state:
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
                lines = []
                for b, (_, rid, text) in enumerate(chunk):
                    new = out.new_tokens[b]
                    lines.append(json.dumps({
                        "id": rid, "prompt": text, "completion": tokenizer.decode(new, skip_special_tokens=True),
                        "new_tokens": len(new), "accepted_lengths": st.row_accepted_lengths(b),
                        "batch_ms": round(st.wall_ms, 2), "batch_tokens_per_s": round(st.tokens_per_s, 2)}) + "\n")
                state["writing"] = True  # a signal now waits for the whole batch's lines
                _append(fd, "".join(lines))
                state["writing"] = False
                written += len(chunk)
                if state["signal"] is not None:
                    raise _Stop(state["signal"])
                tokens += st.new_tokens
                decode_s += st.wall_ms / 1e3
                bar.update(len(chunk))
                bar.set_postfix(tokens_per_s=f"{tokens / max(1e-9, decode_s):.1f}")  # decoding speed
    except _Stop as stop:
        raise JobInterrupted(stop.signum, written, len(skip) + written, out_path) from None
    finally:
        os.close(fd)
        bar.close()
    summary = {"done": len(todo), "skipped": len(skip & {str(r) for r, _ in records}), "new_tokens": tokens,
               "seconds": round(time.time() - t0, 1), "tokens_per_s": round(tokens / max(1e-9, decode_s), 1),
               "profile_seconds": round(profile_s, 1), "out": str(out_path)}
    log(f"[generate] {summary['done']} prompts ({summary['skipped']} already in {out_path}), {tokens} tokens in "
        f"{summary['seconds']} s, {summary['tokens_per_s']} tokens/s; set-up before decoding (cost profile, "
        f"warm-up) {summary['profile_seconds']} s")
    return summary
