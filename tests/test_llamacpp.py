"""llama.cpp as a bench arm (specdec_ext/llamacpp.py): skipped in one line without the package, a crash of its AMX
weight repack retried with the repack off, and, where llama-cpp-python and the real pair's GGUF file are here, a
greedy run of the file."""

from __future__ import annotations

import json
import signal
import subprocess
from types import SimpleNamespace

import pytest

from specdec_ext import llamacpp


def test_without_the_package_the_arm_is_skipped_naming_the_install(monkeypatch):
    monkeypatch.setattr(llamacpp.importlib.util, "find_spec", lambda name: None)
    why = llamacpp.missing()
    assert why is not None and "llama-cpp-python" in why and "pip install" in why and "\n" not in why


def test_a_crashed_repack_runs_again_with_the_repack_off(monkeypatch):
    calls = []

    def fake_run(cmd, input, capture_output, text, timeout, env):
        calls.append(cmd)
        if "--no-repack" not in cmd:
            return SimpleNamespace(returncode=-signal.SIGSEGV, stdout="", stderr="ggml: repack\n")
        line = json.dumps({"tokens": [1, 2], "wall_s": 0.2, "prefill_s": 0.1, "decode_s": 0.1})
        return SimpleNamespace(returncode=0, stdout=line + "\n", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    res = llamacpp.run("m.gguf", [[5, 6]], 2, 2)
    assert res["repack"] == "off" and "SIGSEGV" in res["note"] and res["records"][0]["tokens"] == [1, 2]
    assert len(calls) == 2 and "--no-repack" in calls[1]
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: SimpleNamespace(returncode=1, stdout="",
                                                                             stderr="error: bad file\n"))
    with pytest.raises(RuntimeError, match="llama.cpp failed on m.gguf .exit status 1; last line: error: bad file"):
        llamacpp.run("m.gguf", [[5, 6]], 2, 2)


def _real_file():
    from specdec_ext.zoo.named import target_file

    try:
        return target_file("smollm2-135m")
    except FileNotFoundError:
        return None


@pytest.mark.skipif(llamacpp.missing() is not None or _real_file() is None,
                    reason="llama-cpp-python or the smollm2-135m GGUF file is not installed")
def test_llama_cpp_decodes_the_real_file_greedily():
    ids = [[1, 504, 3575, 30, 216]]
    plain = llamacpp.run(str(_real_file()), ids, 6, 2)
    lookup = llamacpp.run(str(_real_file()), ids, 6, 2, lookup=4)
    assert len(plain["records"]) == 1 and len(plain["records"][0]["tokens"]) == 6
    assert lookup["records"][0]["tokens"] == plain["records"][0]["tokens"]  # its lookup decoding is greedy-exact
    assert plain["records"][0]["prefill_s"] > 0 and plain["records"][0]["decode_s"] > 0
    assert plain["memory"]["resident_growth_at_end_MiB"] >= plain["memory"]["resident_growth_after_load_MiB"] > 0


def test_bench_puts_llama_cpp_beside_our_arms(capsys, tmp_path, monkeypatch):
    """`specdec bench --llama-cpp` (llama.cpp's run faked: the arm's plumbing, not llama.cpp): its two arms join the
    table, their texts are not held to ours, and every arm's decode and prefill rates are recorded; a target that is
    not a GGUF file is refused in one line."""
    from specdec_ext import cli
    from specdec_ext.benchmark import load_results
    from specdec_ext.zoo import pair_available

    if not pair_available():
        pytest.skip("the bundled pair is not in this checkout")
    seen = []

    def fake_run(model, prompts, max_new_tokens, threads, lookup=0, eos=None):
        seen.append((model, lookup))
        return {"records": [{"tokens": [7] * max_new_tokens, "wall_s": 0.5, "prefill_s": 0.1, "decode_s": 0.4}
                            for _ in prompts], "repack": "off", "note": "repack failed here",
                "memory": {"resident_growth_after_load_MiB": 100.0, "resident_growth_at_end_MiB": 200.0}}

    monkeypatch.setattr(llamacpp, "missing", lambda: None)
    monkeypatch.setattr(llamacpp, "run", fake_run)
    monkeypatch.setattr("specdec_ext.benchmark_cli._gguf", lambda args, pair: tmp_path / "t.gguf")
    argv = ["bench", "--prompts", "1", "--max-new-tokens", "5", "--ks", "2", "--thresholds", "0.7", "--no-hf",
            "--no-fp32-plain", "--no-adaptive", "--no-paper", "--no-lookup", "--llama-cpp", "--llama-cpp-lookup", "6",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert seen == [(str(tmp_path / "t.gguf"), 0), (str(tmp_path / "t.gguf"), 6)] and "repack failed here" in out
    data = load_results(tmp_path / "bench-humaneval.json.gz")
    rows = {r["method"]: r for r in data["summary"]}
    assert rows["llama.cpp plain"]["tokens_per_s"] == pytest.approx(10.0) and not rows["llama.cpp plain"]["greedy_checked"]
    rates = data["meta"]["decode_prefill"]
    assert rates["llama.cpp prompt lookup"]["decode_tokens_per_s"] == pytest.approx(4 / 0.4)
    assert rates["plain"]["prefill_tokens_per_s"] > 0
    memory = data["meta"]["memory"]  # what the loaded pair holds, beside what llama.cpp's process grew by
    assert memory["tensors_MiB"]["total"] >= memory["tensors_MiB"]["target"] > 0
    assert all(isinstance(memory[k], float) for k in ("resident_growth_after_load_MiB", "resident_growth_at_end_MiB"))
    assert data["meta"]["llama_cpp"]["llama.cpp plain"]["resident_growth_at_end_MiB"] == 200.0
    monkeypatch.undo()
    monkeypatch.setattr(llamacpp, "missing", lambda: None)
    code = cli.main(argv)
    assert code == 2 and "--llama-cpp runs the target's GGUF file" in capsys.readouterr().err
