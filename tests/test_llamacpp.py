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
