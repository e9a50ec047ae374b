"""The `specdec` command as a user meets it: every user error is one line on stderr and exit status 2
(no traceback unless --debug), help texts show defaults, prompt files are parsed, output goes to stdout."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from specdec_ext import SpeculativeGenerator, cli
from specdec_ext.zoo import pair_available
from support import bundled

needs_pair = pytest.mark.skipif(not pair_available(), reason="the bundled pair is not in this checkout")


def run(argv, capsys):
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(code, err, text):
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("specdec: error: "), err
    assert text in lines[0], lines[0]
    assert "Traceback" not in err


def test_missing_target_directory(capsys, tmp_path):
    code, _, err = run(["train-head", "--target", str(tmp_path / "nope"), "--draft", str(tmp_path / "d"),
                        "--prompts", "humaneval", "--out", str(tmp_path / "h")], capsys)
    assert_one_line_error(code, err, f"--target {tmp_path / 'nope'}: does not exist")
    assert "zoo train" not in err  # the hint about the bundled pair is for the bundled pair only


def test_draft_that_is_not_a_model(capsys, tmp_path):
    (tmp_path / "notamodel").mkdir()
    code, _, err = run(["generate", "--target", str(bundled("target")), "--draft", str(tmp_path / "notamodel"),
                        "--policy", "fixed", "--prompt", "x"], capsys)
    assert_one_line_error(code, err, "has no config.json: not a Hugging Face model directory")


@needs_pair
def test_missing_head_directory(capsys, tmp_path):
    code, _, err = run(["generate", "--target", str(bundled("target")), "--draft", str(bundled("draft")),
                        "--head", str(tmp_path / "nohead"), "--prompt", "x", "--max-new-tokens", "2"], capsys)
    assert_one_line_error(code, err, f"--head {tmp_path / 'nohead'}: no acceptance head there")


@needs_pair
def test_target_without_tokenizer_asks_for_one(capsys, tmp_path):
    t = tmp_path / "target"
    t.mkdir()
    for f in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(bundled("target") / f, t / f)
    code, _, err = run(["generate", "--target", str(t), "--draft", str(bundled("draft")), "--policy", "fixed",
                        "--prompt", "x"], capsys)
    assert_one_line_error(code, err, "pass --tokenizer DIR")
    code, out, err = run(["generate", "--target", str(t), "--draft", str(bundled("draft")), "--policy", "fixed",
                          "--tokenizer", str(bundled("target")), "--prompt", "def f(x):", "--max-new-tokens", "3"],
                         capsys)
    assert code == 0 and out.startswith("def f(x):")


@needs_pair
@pytest.mark.parametrize("content,text", [('{"prompt": "a"}\n{"prompt": \n', ":2: not valid JSON"),
                                          ('{"text": "a"}\n', ":1: no 'prompt' key")])
def test_bad_prompt_file_names_the_file_and_line(capsys, tmp_path, content, text):
    f = tmp_path / "prompts.jsonl"
    f.write_text(content)
    code, _, err = run(["generate", "--policy", "fixed", "--file", str(f)], capsys)
    assert_one_line_error(code, err, str(f) + text)


@needs_pair
def test_empty_prompts(capsys, tmp_path):
    code, _, err = run(["generate", "--policy", "fixed", "--prompt", ""], capsys)
    assert_one_line_error(code, err, "the prompt is empty")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    code, _, err = run(["generate", "--policy", "fixed", "--file", str(empty)], capsys)
    assert_one_line_error(code, err, "holds no prompt")


@needs_pair
def test_prompt_file_is_parsed_and_only_text_goes_to_stdout(capsys, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n" + json.dumps({"prompt": "import os"}) + "\n")
    code, out, err = run(["generate", "--policy", "fixed", "--file", str(f), "--max-new-tokens", "3"], capsys)
    assert code == 0, err
    assert out.startswith("def add(a, b):") and "import os" in out and "{" not in out  # not the raw JSON
    assert err.count("tokens/s") == 2  # the statistics go to stderr, once per prompt


@needs_pair
def test_bench_without_llama_cpp_skips_its_arms_in_one_line_and_times_decode_and_prefill_apart(capsys, tmp_path,
                                                                                                monkeypatch):
    from specdec_ext import llamacpp
    from specdec_ext.benchmark import load_results

    monkeypatch.setattr(llamacpp, "missing", lambda: "llama.cpp arms skipped: not installed (pip install X)")
    code, out, err = run(["bench", "--prompts", "1", "--max-new-tokens", "6", "--ks", "2", "--thresholds", "0.7",
                          "--no-hf", "--no-fp32-plain", "--no-adaptive", "--no-paper", "--no-lookup", "--llama-cpp",
                          "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert out.count("llama.cpp arms skipped: not installed (pip install X)") >= 1
    data = load_results(tmp_path / "bench-humaneval.json.gz")
    assert data["meta"]["llama_cpp"] == {"skipped": "llama.cpp arms skipped: not installed (pip install X)"}
    assert "--llama-cpp" in data["meta"]["command"]
    rates = data["meta"]["decode_prefill"]["plain"]
    assert rates["decode_tokens_per_s"] > 0 and rates["prefill_tokens_per_s"] > 0
    assert not any(r["method"].startswith("llama.cpp") for r in data["summary"])
    assert data["meta"]["memory"]["tensors_MiB"]["target"] > 0


@needs_pair
def test_generate_with_prompt_lookup_prints_what_plain_decoding_prints(capsys, tmp_path):
    """`specdec generate --draft ngram`: prompt lookup, no draft model, SpecDec++'s stop rule over the copies by
    default; greedy, the text is plain decoding's. Other commands refuse it in one line."""
    prompt = "def add(a, b):\n    return a + b\n\n\ndef add3(a, b, c):\n"
    texts = {}
    for policy in ("autoregressive", "specdecpp"):
        code, out, err = run(["generate", "--draft", "ngram", "--policy", policy, "--threshold", "0.7", "--prompt",
                              prompt, "--max-new-tokens", "24"], capsys)
        assert code == 0, err
        texts[policy] = out
    code, out, err = run(["generate", "--lookup", "--threshold", "0.7", "--prompt", prompt, "--max-new-tokens", "24"],
                         capsys)  # the draft model with prompt lookup beside it
    assert code == 0 and "copy-or-draft" in err, err
    assert texts["specdecpp"] == texts["autoregressive"] == out and out.startswith(prompt)
    code, _, err = run(["bench", "--draft", "ngram", "--prompts", "1"], capsys)
    assert_one_line_error(code, err, "--draft ngram (prompt lookup) is taken by `specdec generate`")
    code, _, err = run(["generate", "--draft", "eagle", "--prompt", prompt], capsys)
    assert_one_line_error(code, err, "--draft eagle: the feature draft of a named pair")


def test_cuda_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = run(["generate", "--device", "cuda", "--policy", "fixed", "--prompt", "x"], capsys)
    assert_one_line_error(code, err, "--device cuda: this torch build or machine has no CUDA device")


@pytest.mark.parametrize("argv,text", [(["--repeats", "0"], "--repeats: expected an integer >= 1"),
                                       (["--draft-context", "0"], "--draft-context: expected a token count >= 1"),
                                       (["--length-spread", "128"], "--length-spread: expected tokens in 0 .. "),
                                       (["--length-spread", "4", "--static-batches"], "and not with --static-batches"),
                                       (["--admission", "grouped", "--static-batches"],
                                        "--admission: static batches admit no requests")])
def test_batch_bench_refuses_bad_settings(capsys, tmp_path, argv, text):
    code, _, err = run(["bench", "--batch-sizes", "2", "--prompts", "2", "--out", str(tmp_path), *argv], capsys)
    assert_one_line_error(code, err, text)


@pytest.mark.parametrize("argv", [["--repeats", "2"], ["--static-batches"], ["--draft-context", "64"],
                                  ["--length-spread", "8"], ["--admission", "grouped"]])
def test_batch_bench_options_need_batch_sizes(capsys, tmp_path, argv):
    code, _, err = run(["bench", "--prompts", "2", "--out", str(tmp_path), *argv], capsys)
    assert_one_line_error(code, err, f"{argv[0]}: only with --batch-sizes")


@pytest.mark.parametrize("argv,text", [(["--hf-static", "--no-hf"], "--hf-static: transformers' methods are skipped"),
                                       (["--auto-copies", "-1"], "--auto-copies: expected a count >= 0, got -1")])
def test_bench_refuses_bad_arms(capsys, tmp_path, argv, text):
    code, _, err = run(["bench", "--prompts", "2", "--out", str(tmp_path), *argv], capsys)
    assert_one_line_error(code, err, text)


def test_debug_shows_the_traceback(capsys, tmp_path):
    with pytest.raises(Exception, match="does not exist"):
        cli.main(["--debug", "train-head", "--target", str(tmp_path / "nope"), "--draft", "d", "--prompts", "humaneval",
                  "--out", str(tmp_path)])


@pytest.mark.parametrize("cmd", ["generate", "demo", "bench", "train-head"])
def test_help_shows_every_default(capsys, cmd):
    with pytest.raises(SystemExit):
        cli.main([cmd, "--help"])
    text = capsys.readouterr().out
    assert "(default:" in text
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "cmd").choices[cmd]
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{cmd} {action.option_strings} has no help text"


def test_bench_readme_exists():
    from pathlib import Path

    assert (Path(__file__).resolve().parents[1] / "bench" / "README.md").is_file()


def test_generate_refuses_unknown_keyword_arguments():
    from models import make_pair

    target, draft = make_pair("llama")
    gen = SpeculativeGenerator(target, draft, policy="fixed", k=2)
    ids = torch.tensor([[3, 4, 5]])
    for kw in ({"treshold": 0.9}, {"do_sample": True}, {"repetition_penalty": 1.5}, {"max_length": 3}):
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            gen.generate(ids, max_new_tokens=3, **kw)
    with pytest.raises(ValueError, match="empty prompt"):
        gen.generate(torch.tensor([[]]), max_new_tokens=3)


def test_head_for_another_draft_of_the_same_size_is_refused():
    from models import make_pair, noisy_copy
    from specdec_ext import AcceptanceHead
    from specdec_ext.engine.models import fingerprint

    target, draft = make_pair("llama")
    other = noisy_copy(draft, 0.5, seed=7)
    head = AcceptanceHead(draft.config.hidden_size, 1, input_position="proposal", features=("token_prob",),
                          draft_fingerprint=fingerprint(draft))
    SpeculativeGenerator(target, draft, policy="specdecpp", head=head)
    with pytest.raises(ValueError, match="trained for the draft .* fingerprint"):
        SpeculativeGenerator(target, other, policy="specdecpp", head=head)
    with pytest.warns(UserWarning, match="fingerprint"):
        SpeculativeGenerator(target, other, policy="specdecpp", head=head, allow_other_draft=True)
    assert fingerprint(draft) == fingerprint(draft.to(torch.bfloat16).float())  # dtype does not change it


@needs_pair
def test_train_head_data_in_shards_then_merged(capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n"}) + "\n" for i in range(5)))
    base = ["train-head", "--target", str(bundled("target")), "--draft", str(bundled("draft")), "--prompts",
            str(prompts), "--out", str(tmp_path / "head"), "--work-dir", str(tmp_path / "work"), "--max-new-tokens", "6",
            "--data-only"]
    code, _, err = run(base[:-1] + ["--shard", "0/2"], capsys)
    assert_one_line_error(code, err, "--shard generates a share of the training data: use it with --data-only")
    code, _, err = run(base + ["--shard", "2/2"], capsys)
    assert_one_line_error(code, err, "--shard: expected I/N with 0 <= I < N")
    for i in range(2):
        code, out, err = run(base + ["--shard", f"{i}/2"], capsys)
        assert code == 0, err
        assert json.loads(out)["data"].endswith(f"head_data_greedy.shard-{i}-of-2.safetensors")
    code, out, err = run(base, capsys)
    assert code == 0, err
    assert "merged 2 shards" in err and json.loads(out)["responses"] == 5


@needs_pair
def test_attention_implementation_flag_reaches_both_models(monkeypatch):
    """--attn-implementation: auto gives the bundled pair the CPU decode-attention kernel, as load_pair does (the batch
    benchmark of the README ran with it only after this flag; before, the CLI loaded SDPA); a named one is passed on."""
    from specdec_ext import ops
    from specdec_ext.zoo import load_models

    seen = []
    monkeypatch.setattr("specdec_ext.zoo.load_models",
                        lambda *a, **k: seen.append(k["attn_implementation"]) or load_models(*a, **k))
    parser = cli.build_parser()
    for flag, want in (([], "specdec_decode" if ops.HAS_EXTENSION else None), (["--attn-implementation", "sdpa"], "sdpa")):
        pair = cli._models(parser.parse_args(["generate", *flag, "--prompt", "x"]), need_head=False)
        assert seen[-1] == want and pair.target.config._attn_implementation == (want or "sdpa")
        assert pair.draft.config._attn_implementation == (want or "sdpa")


@pytest.mark.skipif(not pair_available(), reason="no bundled pair")
def test_draft_dtype_flag_defaults_to_the_targets_rule():
    """--draft-dtype auto (the default) loads the draft as load_pair does (default_draft_dtype: bf16 where the
    hardware has bf16 matrix instructions); a named dtype is loaded as named."""
    from specdec_ext.zoo import default_draft_dtype

    parser = cli.build_parser()
    for flag, want in (([], default_draft_dtype("cpu")), (["--draft-dtype", "float32"], torch.float32),
                       (["--draft-dtype", "bfloat16"], torch.bfloat16)):
        pair = cli._models(parser.parse_args(["generate", *flag, "--prompt", "x"]), need_head=False)
        assert pair.draft.dtype == want, flag


@needs_pair
def test_bench_runs_end_to_end_and_records_auto_and_its_costs(capsys, tmp_path, monkeypatch):
    """`specdec bench` on one prompt with the bundled pair: every arm ran, and the results' JSON records the command,
    what auto chose (its arms, the rounds it played, its measured cost fit and its own cost) and the profile the
    cost-aware arms started from; the Markdown table says so too."""
    from specdec_ext.benchmark import load_results
    from specdec_ext.policies.costs import CostModel

    monkeypatch.setattr(SpeculativeGenerator, "costs", lambda self, policy=None: CostModel([8.0, 8.5, 9.0], 1.0, 0.1,
                                                                                         0.5))
    code, out, err = run(["bench", "--prompts", "1", "--max-new-tokens", "8", "--ks", "2", "--thresholds", "0.7",
                          "--no-hf", "--no-fp32-plain", "--no-adaptive", "--no-paper", "--lookup-ks", "3", "--out", str(tmp_path)],
                         capsys)
    assert code == 0, err
    data = load_results(tmp_path / "bench-humaneval.json.gz")
    assert {r["method"] for r in data["summary"]} == {"plain", "fixed K=2", "specdec++ h=0.7", "specdec++ auto",
                                                       "lookup K=3", "lookup heuristic", "lookup auto", "copy or draft, auto",
                                                       "oracle"}
    assert "--lookup-ks 3 " in data["meta"]["command"]
    assert data["meta"]["command"].endswith("--no-adaptive --no-paper")
    chosen = data["meta"]["auto_selection"]["specdec++ auto"]
    assert chosen["arms"] == ["h=0.4", "h=0.5", "h=0.6", "h=0.7", "h=0.8", "goodput", "plain"] and chosen["played"]
    assert chosen["selection_us_per_round"] > 0 and set(chosen["cost_fit_ms"]) == {"round", "draft_step",
                                                                                   "verified_token"}
    assert data["meta"]["cost_model"]["verify_ms"] == [8.0, 8.5, 9.0]
    assert "the stop rule it chose by measured goodput" in out and "settled on" in out
    assert (tmp_path / "humaneval-auto-arms.png").is_file()


@needs_pair
def test_chat_errors_are_one_line(capsys):
    code, _, err = run(["generate", "--chat", "hello", "--max-new-tokens", "4"], capsys)
    assert_one_line_error(code, err, "--chat: this tokenizer has no chat template")
    code, _, err = run(["generate", "--chat", "hello", "--prompt", "x"], capsys)
    assert_one_line_error(code, err, "--chat MESSAGE is the prompt: drop --prompt/--file/--prompts")


def test_train_draft_and_train_head_errors_are_one_line(capsys, tmp_path):
    code, _, err = run(["train-draft", "--target", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "d")], capsys)
    assert_one_line_error(code, err, "none.gguf: no such GGUF file")
    code, _, err = run(["train-draft", "--target", str(tmp_path), "--out", str(tmp_path / "d")], capsys)
    assert_one_line_error(code, err, "has no config.json")
    code, _, err = run(["train-head", "--prompts", "humaneval", "--out", str(tmp_path / "h")], capsys)
    assert_one_line_error(code, err, "train-head needs --pair NAME, or --target and --draft")


def test_the_module_runs_as_a_program_and_exits_with_mains_status(tmp_path):
    """``python -m specdec_ext.cli`` (what the ``specdec`` script runs): a usage error exits with status 2 and its one
    line on stderr (the other CLI tests call ``cli.main`` in the process)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "specdec_ext.cli", "generate", "--policy", "fixed", "--prompts",
                        str(tmp_path / "p.jsonl")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--prompts writes a batch job: give --out results.jsonl" in r.stderr, r.stderr[-2000:]
