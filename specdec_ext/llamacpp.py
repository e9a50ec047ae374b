"""llama.cpp as a measured arm of ``specdec bench --llama-cpp``: the same GGUF file, its weights read as stored.

A CPU user with a GGUF file compares us with llama.cpp. The arm runs the bench's prompts (their token ids, so both
engines read the same tokens) through ``llama-cpp-python`` greedily, at the bench's thread count, plain and with
its prompt-lookup decoding (``LlamaPromptLookupDecoding``), and times the prompt's prefill (to the first token)
apart from the decode steps. It runs in a child process (:func:`run`): where llama.cpp's AMX weight repack crashes
the process (it does on some Xeons: ``extra buffer types``, chosen by default on AMX CPUs), the arm runs again with
the repack off (``use_extra_bufts = False``, as llama.cpp's ``--no-extra-bufts``) and says so.

    python -m specdec_ext.llamacpp MODEL.gguf --threads 2 --max-new-tokens 64 [--lookup 10] [--no-repack] < ids.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional

INSTALL = "pip install 'specdec_ext[llama-cpp]', i.e. llama-cpp-python, built from source: a C++ compiler and cmake"


def missing() -> Optional[str]:
    """Why the arm cannot run here (one line naming the install), or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama.cpp arms skipped: the llama-cpp-python package is not installed ({INSTALL})"
    return None


def run(model: str, prompts: list, max_new_tokens: int, threads: int, lookup: int = 0, eos: Optional[int] = None,
        timeout_s: float = 3600.0) -> dict:
    """Greedy generations of ``prompts`` (lists of token ids) by llama.cpp on the GGUF file ``model``, in a child
    process. ``lookup``: tokens its prompt-lookup decoding proposes a round (0: plain decoding).

    Returns ``{"records": [{"tokens", "wall_s", "prefill_s", "decode_s"} per prompt], "repack": "on" | "off",
    "note": why the repack is off, or "", "memory": the child's resident memory growth (MiB) from after importing
    llama.cpp to after loading the file (``resident_growth_after_load_MiB``) and to after the prompts
    (``resident_growth_at_end_MiB``; its KV cache of 4,096 positions included), where /proc tells it}``. Times in
    seconds.

    Raises RuntimeError (one line, with the child's last line of stderr) where it fails with the repack off too."""
    note = ""
    for repack in (True, False):
        cmd = [sys.executable, "-m", "specdec_ext.llamacpp", str(model), "--threads", str(threads),
               "--max-new-tokens", str(max_new_tokens), "--lookup", str(lookup)]
        cmd += ([] if eos is None else ["--eos", str(eos)]) + ([] if repack else ["--no-repack"])
        proc = subprocess.run(cmd, input=json.dumps(prompts), capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        if proc.returncode == 0:
            lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
            memory = next((line["memory"] for line in lines if "memory" in line), {})
            records = [line for line in lines if "memory" not in line]
            return {"records": records, "repack": "on" if repack else "off", "note": note, "memory": memory}
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        why = (f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exit status {proc.returncode}")
        if not repack:
            raise RuntimeError(f"llama.cpp failed on {model} ({why}; last line: {last})")
        note = f"llama.cpp's AMX weight repack failed here ({why}); run with the repack off (--no-extra-bufts)"
    raise AssertionError("unreachable")


def _load(model: str, threads: int, lookup: int, repack: bool):
    import llama_cpp

    if not repack:  # llama.cpp's --no-extra-bufts: no repacked copy of the weights (AMX, AArch64 kernels)
        default = llama_cpp.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama_model_default_params = params
        import llama_cpp.llama as high

        high.llama_cpp.llama_model_default_params = params
    kw = {}
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
    return llama_cpp.Llama(model_path=model, n_ctx=4096, n_batch=512, n_threads=threads, n_threads_batch=threads,
                           verbose=False, **kw)


def _main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--lookup", type=int, default=0)
    ap.add_argument("--eos", type=int, default=None)
    ap.add_argument("--no-repack", action="store_true")
    args = ap.parse_args(argv)
    prompts = json.loads(sys.stdin.read())
    import llama_cpp  # noqa: F401 (imported before the memory the model's loading adds is measured)

    from .benchmark import resident_mib

    before = resident_mib()
    llm = _load(args.model, args.threads, args.lookup, not args.no_repack)
    loaded = resident_mib()
    for ids in prompts:
        out, first = [], None
        t0 = time.perf_counter()
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter()
            out.append(int(tok))
            if tok == args.eos or len(out) >= args.max_new_tokens:
                break
        t1 = time.perf_counter()
        print(json.dumps({"tokens": out, "wall_s": t1 - t0, "prefill_s": first - t0, "decode_s": t1 - first}),
              flush=True)
    end = resident_mib()
    if before is not None:
        print(json.dumps({"memory": {"resident_growth_after_load_MiB": loaded - before,
                                     "resident_growth_at_end_MiB": end - before}}), flush=True)


if __name__ == "__main__":
    _main()
