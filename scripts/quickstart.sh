#!/usr/bin/env bash
# The README's main command: set up the environment, then run SpecDec++, fixed-K speculative
# decoding and plain decoding on HumanEval prompts with the bundled pair, and print completions
# and a table measured in this run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec specdec demo "$@"
