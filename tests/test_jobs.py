"""Batch jobs from files (`specdec generate --prompts FILE --out results.jsonl --batch-size N`) and chat
templates: one record per prompt, resumable with the same output as an uninterrupted run."""

from __future__ import annotations

import json

import pytest

from specdec_ext import SpeculativeGenerator, cli
from specdec_ext.jobs import run_job
from specdec_ext.prompts import encode_prompt, load_prompt_records
from specdec_ext.zoo import PAIR_DIR, pair_available
from models import make_pair
from support import DigitTokenizer

RECORDS = [(f"p{i}", " ".join(str(2 + (i * 7 + j) % 40) for j in range(3 + i % 4))) for i in range(7)]


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def gen():
    target, draft = make_pair("llama")
    return SpeculativeGenerator(target, draft, policy="fixed", k=3)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_job_writes_one_record_per_prompt_and_resumes(gen, tmp_path, temperature):
    whole = tmp_path / "whole.jsonl"
    run_job(gen, DigitTokenizer(), RECORDS, whole, batch_size=3, max_new_tokens=10, temperature=temperature,
            progress=False, log=lambda *a: None)
    recs = read(whole)
    assert [r["id"] for r in recs] == [r for r, _ in RECORDS]
    for r in recs:
        assert r["new_tokens"] == len(r["completion"].split()) and 1 <= r["new_tokens"] <= 10  # EOS may end a row
        assert r["accepted_lengths"] and all(0 <= a <= 3 for a in r["accepted_lengths"])
        assert r["batch_tokens_per_s"] > 0
    # an interrupted job (its first 2 records written, with another batch size) resumes where it stopped
    part = tmp_path / "part.jsonl"
    run_job(gen, DigitTokenizer(), RECORDS[:2], part, batch_size=2, max_new_tokens=10, temperature=temperature,
            progress=False, log=lambda *a: None)
    summary = run_job(gen, DigitTokenizer(), RECORDS, part, batch_size=4, max_new_tokens=10, temperature=temperature,
                      progress=False, log=lambda *a: None)
    assert summary["done"] == 5 and summary["skipped"] == 2
    again = read(part)
    key = lambda r: (r["id"], r["completion"])  # noqa: E731
    assert sorted(map(key, again)) == sorted(map(key, recs))  # same seeds per prompt: same completions


def test_a_resumed_job_cuts_an_unfinished_last_line(gen, tmp_path):
    """A run killed inside its append leaves the last line unfinished (no newline): the next run cuts it, then
    writes that record and the rest, each once."""
    whole = tmp_path / "whole.jsonl"
    run_job(gen, DigitTokenizer(), RECORDS, whole, batch_size=2, max_new_tokens=8, progress=False, log=lambda *a: None)
    data = whole.read_bytes()
    cut = tmp_path / "cut.jsonl"
    ends = [i for i, c in enumerate(data) if c == ord("\n")]
    cut.write_bytes(data[: ends[2] + 1 + (ends[3] - ends[2]) // 2])  # three records and half of the fourth
    summary = run_job(gen, DigitTokenizer(), RECORDS, cut, batch_size=2, max_new_tokens=8, progress=False,
                      log=lambda *a: None)
    assert summary["skipped"] == 3 and summary["done"] == len(RECORDS) - 3
    key = lambda r: (r["id"], r["completion"])  # noqa: E731
    assert sorted(map(key, read(cut))) == sorted(map(key, read(whole)))


def test_job_refuses_a_foreign_output_file(gen, tmp_path):
    out = tmp_path / "x.jsonl"
    out.write_text('{"text": 1}\n')
    with pytest.raises(ValueError, match="not a record of this job"):
        run_job(gen, DigitTokenizer(), RECORDS, out, progress=False)


def test_prompt_records_keep_ids(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n" + json.dumps({"id": "b", "prompt": "y"}) + "\n")
    assert load_prompt_records(str(f)) == [("a", "x"), ("b", "y")]
    assert load_prompt_records("humaneval", limit=2)[1][0] == "HumanEval/1"


@pytest.mark.skipif(not pair_available(), reason="the bundled pair is not in this checkout")
def test_chat_template_wraps_prompts(capsys, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(PAIR_DIR / "target")
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(tok, "hi", chat=True)
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    ids = encode_prompt(tok, "def f():", chat=True)
    assert tok.decode(ids) == "<|user|>def f():\n<|assistant|>"
    assert encode_prompt(tok, "def f():") == tok("def f():")["input_ids"]  # the tokenizer's own defaults
    # on the command line: the CLI reports a tokenizer without a template in one line
    code = cli.main(["generate", "--policy", "fixed", "--prompt", "x", "--chat"])
    assert code == 2 and "no chat template" in capsys.readouterr().err


@pytest.mark.skipif(not pair_available(), reason="the bundled pair is not in this checkout")
def test_cli_batch_job(capsys, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n"
                         for i, p in enumerate(["def add(a, b):", "import os", "class A:"])))
    out = tmp_path / "r.jsonl"
    argv = ["generate", "--policy", "fixed", "--k", "2", "--prompts", str(f), "--out", str(out), "--batch-size", "2",
            "--max-new-tokens", "4"]
    assert cli.main(argv) == 0
    assert [r["id"] for r in read(out)] == ["q0", "q1", "q2"]
    assert cli.main(argv) == 0 and len(read(out)) == 3  # resumed: nothing left to do
    assert "0 prompts (3 already in" in capsys.readouterr().err
    assert cli.main(["generate", "--policy", "fixed", "--prompts", str(f)]) == 2


def _fork_cli(argv, target, draft, err):
    """``specdec generate ARGV`` in a child forked from this process (the modules already imported: no start-up of
    seconds, so the job's own 0.7 s is what the signals meet), on ``target``/``draft`` at one thread, stderr to the
    file ``err``; it waits for a byte on the pipe returned before it starts, and exits with the CLI's status.
    Returns (pid, the pipe's write end)."""
    import os
    import sys
    import traceback
    from types import SimpleNamespace

    import torch

    go, start = os.pipe()
    pid = os.fork()
    if pid:
        os.close(go)
        return pid, start
    code = 70  # the child: never returns into pytest
    try:
        os.close(start)
        fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        torch.set_num_threads(1)
        # tqdm's write lock is a multiprocessing semaphore, shared with this test's process through the fork: a
        # child killed (-9) inside a progress write would leave it held there for good; the child takes its own
        import threading

        import tqdm
        import tqdm.auto

        for bar in (tqdm.tqdm, tqdm.auto.tqdm):
            bar.set_lock(threading.RLock())
        cli._models = lambda args, need_head, lookup_ok=False: SimpleNamespace(target=target, draft=draft,
                                                                               head=None, tokenizer=DigitTokenizer())
        os.read(go, 1)
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def _lines(path):
    """The output's lines: (parsed records, whether an unfinished last line follows them)."""
    data = path.read_bytes() if path.exists() else b""
    whole, _, tail = data.rpartition(b"\n")
    return [json.loads(line) for line in whole.decode().splitlines() if line] if whole or not tail else [], bool(tail)


def test_batch_jobs_survive_signals_and_kill_9(tmp_path):
    """``specdec generate --prompts ... --out`` in a child process, stopped at random points: 2 SIGTERMs (exit status
    143, one line naming the records written, whole records only) and 4 kill -9s (whole records, at most an
    unfinished last line that the next run cuts); never a record twice; each output resumed in this process then
    holds every record of an uninterrupted run, with the same completions (greedy, fp32)."""
    import os
    import random
    import re
    import signal
    import time

    prompts = tmp_path / "p.jsonl"
    ids = [f"r{i}" for i in range(80)]
    prompts.write_text("".join(json.dumps({"id": r, "prompt": " ".join(str(2 + (i * 5 + j) % 40)
                                                                         for j in range(2 + i % 5))}) + "\n"
                               for i, r in enumerate(ids)))
    target, draft = make_pair("llama")

    def errors(out):
        return out.with_name(out.name + ".err")

    def child(out):
        argv = ["generate", "--policy", "fixed", "--k", "3", "--prompts", str(prompts), "--out", str(out),
                "--batch-size", "2", "--max-new-tokens", "12"]
        return _fork_cli(argv, target, draft, str(errors(out)))

    def go(*starts):
        for start in starts:
            os.write(start, b"\n")
            os.close(start)

    def wait(pid, out):
        """The child's exit status as subprocess reports it (-N for signal N) and its stderr's lines."""
        deadline = time.monotonic() + 300
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
            assert time.monotonic() < deadline, "the child did not end"
            time.sleep(0.01)
        return os.waitstatus_to_exitcode(done[1]), errors(out).read_text().strip().splitlines()

    whole = tmp_path / "whole.jsonl"
    pid, start = child(whole)
    go(start)
    rc, err = wait(pid, whole)
    assert rc == 0, err[-3:]
    span = float(re.search(r"tokens in ([0-9.]+) s", "\n".join(err)).group(1))  # the job's own seconds
    want = {r["id"]: r["completion"] for r in _lines(whole)[0]}
    assert sorted(want) == sorted(ids)

    rng = random.Random(0)
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=3)
    records = load_prompt_records(str(prompts))
    torn, stopped = 0, []
    signals = [signal.SIGTERM] * 2 + [signal.SIGKILL] * 4
    for first in range(0, len(signals), 2):  # two children at a time, one per core, each stopped at its own time
        trials = list(range(first, min(first + 2, len(signals))))
        procs = {t: child(tmp_path / f"t{t}.jsonl") for t in trials}
        go(*(start for _, start in procs.values()))
        began = {}  # each job's start: its output file opened, the line before its signal handler is set (jobs.py)
        deadline = time.monotonic() + 60
        while len(began) < len(trials):
            assert time.monotonic() < deadline, "a child's job did not start"
            for t in trials:
                if t not in began and (tmp_path / f"t{t}.jsonl").exists():
                    began[t] = time.perf_counter()
            time.sleep(0.001)
        for at, t in sorted((began[t] + rng.uniform(0.05, 0.75) * span, t) for t in trials):
            time.sleep(max(0.0, at - time.perf_counter()))
            os.kill(procs[t][0], signals[t])
        for trial in trials:
            sig, out = signals[trial], tmp_path / f"t{trial}.jsonl"
            rc, err = wait(procs[trial][0], out)
            recs, tail = _lines(out)
            got = [r["id"] for r in recs]
            assert len(got) == len(set(got)), f"trial {trial}: a record twice"
            assert all(want[r["id"]] == r["completion"] for r in recs)
            if sig == signal.SIGTERM:
                assert rc == 128 + signal.SIGTERM and not tail, f"trial {trial}: rc {rc}, {err[-1:]}"
                assert err[-1] == (f"specdec: stopped by SIGTERM: {len(recs)} records written to {out} by this "
                                   f"run ({len(recs)} in the file); the same command resumes")
            else:
                assert rc == -signal.SIGKILL, f"trial {trial}: rc {rc}: the job had ended before the kill"
            stopped.append(len(recs))
            torn += tail
            run_job(gen, DigitTokenizer(), records, out, batch_size=3, max_new_tokens=12, progress=False,
                    log=lambda *a: None)
            recs, tail = _lines(out)
            assert not tail and sorted(r["id"] for r in recs) == sorted(ids), f"trial {trial}: after the resume"
            assert all(want[r["id"]] == r["completion"] for r in recs)
    assert len(set(stopped)) >= 3, f"records when stopped: {stopped}"  # the signals met the job at many points
    print(f"records when stopped: {stopped}; unfinished last lines after kill -9: {torn}")
