#!/usr/bin/env bash
# One entry point for a fresh machine (Python >= 3.10 and pip are all it needs):
#   ./run.sh demo    set up .venv, then run the main job on the bundled MultiHop-RAG sample
#   ./run.sh test    set up .venv with the test extras, then run the whole test suite
#   ./run.sh bench   set up .venv, then run the benchmark scripts
# Extra arguments go to the command run (e.g. ./run.sh test -k pilot).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
VENV="$(realpath -m "${VENV:-.venv}")"  # absolute: pip builds sdists from other directories

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
  fi
  "$VENV/bin/python" -m pip install --quiet -e ".[$1]"
}

# SGLang's radix cache runs on CPU in the tests: torch CPU (pip takes the local CPU wheel
# where PIP_FIND_LINKS offers one) and sglang without its GPU dependencies.
setup_sglang() {
  if ! "$VENV/bin/python" -c "import sglang" 2>/dev/null; then
    "$VENV/bin/python" -m pip install --quiet torch==2.13.0 orjson psutil pybase64 requests packaging \
      pillow starlette msgspec pyzmq IPython aiohttp transformers dill openai partial-json-parser
    "$VENV/bin/python" -m pip install --quiet --no-deps sglang==0.5.23 sentencepiece compressed-tensors loguru gguf
  fi
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
    setup_sglang
    # a real prefix-caching server for the end-to-end tests (built once, cached outside the repo)
    LLAMA_SERVER="$(PATH="$VENV/bin:$PATH" scripts/build_llama_server.sh | tail -n 1)"
    export LLAMA_SERVER
    "$VENV/bin/ruff" check contextpilot_integrations tests benchmarks langchain llamaindex
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
