#!/usr/bin/env bash
# One entry point for a fresh machine (Python >= 3.10 and pip are all it needs):
#   ./run.sh demo    set up .venv, then run the main job on the bundled MultiHop-RAG sample
#   ./run.sh test    set up .venv with the test extras, then run the whole test suite
#   ./run.sh bench   set up .venv, then run the benchmark scripts
# Extra arguments go to the command run (e.g. ./run.sh test -k pilot).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
  fi
  "$VENV/bin/python" -m pip install --quiet -e ".[$1]"
}

command="${1:-demo}"
shift || true
case "$command" in
  demo)
    setup plot
    exec "$VENV/bin/contextpilot-integrations" demo "$@"
    ;;
  test)
    setup dev
    "$VENV/bin/ruff" check contextpilot_integrations tests benchmarks
    exec "$VENV/bin/python" -m pytest "$@"
    ;;
  bench)
    setup dev
    exec "$VENV/bin/python" benchmarks/bench_core.py "$@"
    ;;
  *)
    echo "usage: ./run.sh {demo|test|bench} [args...]" >&2
    exit 2
    ;;
esac
