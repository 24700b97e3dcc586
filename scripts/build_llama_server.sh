#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (a real prefix-caching OpenAI-compatible engine that
# runs on CPU) from the llama.cpp sources vendored in the llama-cpp-python sdist on PyPI.
# Needs python3 + pip, cmake and a C++ compiler. About 5-7 minutes on 2 cores, once:
# the binary is cached outside the repository and reused.
# Usage: scripts/build_llama_server.sh [OUT_DIR] [LLAMA_CPP_PYTHON_VERSION]
# Prints the path of the binary.
set -euo pipefail
OUT=${1:-${CONTEXTPILOT_CACHE:-$HOME/.cache/contextpilot-integrations}/llama-server}
VER=${2:-0.3.36}
if [ ! -x "$OUT/bin/llama-server" ]; then
  mkdir -p "$OUT/src"
  python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$OUT/src"
  tar -xzf "$OUT/src/llama_cpp_python-$VER.tar.gz" -C "$OUT/src" "llama_cpp_python-$VER/vendor/llama.cpp"
  SRC="$OUT/src/llama_cpp_python-$VER/vendor/llama.cpp"
  # LLAMA_USE_PREBUILT_UI=OFF: the default would download the web UI at build time
  cmake -S "$SRC" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF -DGGML_CCACHE=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >/dev/null
  cmake --build "$OUT/build" --target llama-server -j"$(nproc)" >/dev/null
  mkdir -p "$OUT/bin"
  cp "$OUT/build/bin/llama-server" "$OUT/bin/"
  rm -rf "$OUT/build" "$OUT/src"
fi
echo "$OUT/bin/llama-server"
