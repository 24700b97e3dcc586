#!/usr/bin/env bash
# Here (a machine with pip): gather what the GPU machine lacks into .gpu/ (ignored by git):
# llama.cpp's sources from the llama-cpp-python sdist on PyPI (pruned to what the server
# build needs, ~10 MB), wheels for pydantic and gguf (Python 3.12, x86-64), and this
# folder's scripts. Then, on the GPU machine, from the repository root, with .gpu carried:
#   R=$PWD W=/tmp/cp MODEL=/tmp/model.gguf SITE_WHEELS=1 REQ=24 CHARS=400 CHAT_REQ=16 \
#   SERVER_ARGS="-c 32768 -np 1 -ngl 999 --cache-ram 49152 -t 8" setsid bash .gpu/ttft.sh &
# (detached: it outlives the call; collect $W/out when $W/done exists).
set -euo pipefail
cd "$(dirname "$0")/../.."
VER=${1:-0.3.36}
PY="${PYTHON:-python3}"
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >>.git/info/exclude
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mkdir -p .gpu/whl
"$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$tmp"
tar -xzf "$tmp/llama_cpp_python-$VER.tar.gz" -C "$tmp" "llama_cpp_python-$VER/vendor/llama.cpp"
src="$tmp/llama_cpp_python-$VER/vendor"
# keep scripts/: cmake needs scripts/ui-assets.cmake
(cd "$src/llama.cpp" && rm -rf models docs media tests benches examples gguf-py pocs app)
tar -czf .gpu/llama-src.tgz -C "$src" --transform 's,^llama.cpp,src,' llama.cpp
pydantic="$("$PY" -c 'import pydantic; print(pydantic.VERSION)')"  # and its exact core
core="$("$PY" -c 'import pydantic_core; print(pydantic_core.__version__)')"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/whl "pydantic==$pydantic" "pydantic-core==$core" annotated-types typing-inspection typing-extensions gguf
cp benchmarks/gpu/ttft.sh benchmarks/gpu/make_gguf_8b_shape.py .gpu/
du -sh .gpu
