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
