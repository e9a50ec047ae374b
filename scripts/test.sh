#!/usr/bin/env bash
# The README's test command: set up the environment, then run the whole suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
# two pytest-xdist workers where the machine has two cores or more (each runs torch at one thread, tests/conftest.py;
# tests that share a costly fixture share a worker: --dist loadgroup); SPECDEC_TEST_WORKERS=1 runs one process
workers="${SPECDEC_TEST_WORKERS:-$(python -c 'import os; print(min(2, os.cpu_count() or 1))')}"
args=()
if [ "$workers" -gt 1 ] && python -c "import xdist" >/dev/null 2>&1; then
  args=(-n "$workers" --dist loadgroup)
fi
exec python -m pytest -q -p no:cacheprovider "${args[@]}" "$@"
