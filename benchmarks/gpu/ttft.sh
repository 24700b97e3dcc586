#!/bin/bash
# Real time to first token on a GPU (see README.md here): CUDA llama-server built from the PyPI sdist, an
# 8B-shaped random-weight model, the demo's engine comparison (A B B A, a fresh server per
# pass) without vs with ContextPilot. Runs detached; writes into $W; touch $W/done at the end.
# env: R (repo root), W (work dir), BIN (prebuilt binary: skip the build), MODEL, SERVER_ARGS,
#      REQ, CHARS, CHAT_REQ, DEADLINE (epoch s: skip steps that would start after it)
set -u
mkdir -p "$W/out"; cd "$W"
exec >>"$W/driver.log" 2>&1
t0=$(date +%s); echo "start $t0"
if [ -z "${BIN:-}" ]; then
  tar xzf "$R/.gpu/llama-src.tgz"
  ( cmake -S src -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
      -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >cfg.log 2>&1 \
    && cmake --build build --target llama-server -j16 >build.log 2>&1; echo $? >build.rc ) &
  BIN=$W/build/bin/llama-server
fi
if [ -n "${SITE_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$R"/.gpu/whl/*.whl
  export PYTHONPATH=/tmp/site:$R
fi
if [ ! -f "$MODEL" ]; then python3 "$R/.gpu/make_gguf_8b_shape.py" "$MODEL" >model.log 2>&1; echo "model rc=$? $(( $(date +%s)-t0 ))s"; fi
python3 -c "import contextpilot_integrations.whatif.cli, sys; print('package ok', sys.version)"
wait
[ -f build.rc ] && echo "build rc=$(cat build.rc) at $(( $(date +%s)-t0 ))s" && tail -3 build.log
[ -x "$BIN" ] || { echo "no binary"; touch done; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
CMD="$BIN -m $MODEL --host 127.0.0.1 --port {port} $SERVER_ARGS"
echo "cmd: $CMD"
step() {  # name modes requests
  if [ "$(date +%s)" -gt "${DEADLINE:-99999999999}" ]; then echo "skip $1 (deadline)"; return; fi
  echo "step $1 at $(( $(date +%s)-t0 ))s"
  python3 -m contextpilot_integrations.whatif.cli demo --modes offline --capacity 0.25 --strategies retrieval,trie \
    --no-plot --engine-cmd "$CMD" --engine-requests "$3" --engine-block-chars "$CHARS" --engine-modes "$2" \
    --history-turns 1 --answer-tokens 16 >"out/$1.txt" 2>"out/$1.err"
  echo "step $1 rc=$? at $(( $(date +%s)-t0 ))s"; tail -25 "out/$1.txt"
}
step single online,offline "$REQ"
step chat chat "$CHAT_REQ"
cp driver.log out/ 2>/dev/null; cp build.log cfg.log out/ 2>/dev/null
echo "done at $(( $(date +%s)-t0 ))s"; touch done
