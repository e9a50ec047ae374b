#!/usr/bin/env bash
# The README's test command: set up the environment, then run the whole suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec python -m pytest -q -p no:cacheprovider "$@"
