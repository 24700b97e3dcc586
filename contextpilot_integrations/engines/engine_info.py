"""What an engine says about its cache: its page, its pool and its tokenizer, read once.

The send decision (:mod:`..core.gain`) is right only in the engine's units and pages: a
reuse counts in whole pages (:func:`~..core.gain.page_margin`), and a label or an
annotation costs what the engine's tokenizer makes of it. Given an engine (an
:class:`~.client.OpenAICompatClient`, a :class:`~.router.RoutingClient`'s targets, the
adapters' ``engine=``), the pilot reads them from the engine by default: once per engine
URL and pilot, off the pilot's lock, within :data:`DISCOVERY_TIMEOUT` seconds, and only
what its user left unset (:func:`~..pilot.wiring.fill_engine_settings`):

- SGLang: the page is ``page_size`` and the pool ``max_total_num_tokens`` of
  ``GET /server_info`` (``/get_server_info`` before 0.5); the tokenizer its
  ``POST /tokenize`` (``{"model", "prompt"}``).
- vLLM: the page is ``block_size`` of the ``vllm:cache_config_info`` gauge of ``GET /metrics``
  (``cache_hit_alignment_tokens`` where it is set), the pool its ``kv_cache_size_tokens``,
  at most (``num_gpu_blocks`` - 1) x ``block_size`` (one block is its null block); the
  tokenizer its ``POST /tokenize`` (``{"model", "prompt"}``: the model it serves).
- llama-server: ``GET /props`` answers, so its cache is per token (page 1); the pool is
  ``n_ctx`` x ``total_slots`` (the most its slots hold: each keeps its last prompt only);
  the tokenizer its ``POST /tokenize`` (``{"content"}``).

``/tokenize`` is asked only of a server that said which engine it is (nothing is posted to
an unknown one). An engine that does not say (or cannot be reached: asked again after
:data:`RETRY_UNREACHABLE_S`) leaves the estimates (four characters a token, pages unknown),
and the log says so once per URL (``INFO``); the user's call never fails for it. The
tokenizer learned this way falls back to the estimate for a text the engine does not count
(:class:`~.tokens.EngineTokenCounter` ``fallback``). Off: ``discover=False`` where the engine
is given, or ``CONTEXTPILOT_DISCOVER_ENGINE=0`` (:data:`DISCOVER_ENV`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import httpx

from ..core.gain import estimate_tokens
from ..core.usage import MAX_TOKENS
from ..pilot.wiring import EngineSettings, claim_engine, fill_engine_settings, read_engine_again
from .deadline import deadline, deadline_transport
from .tokens import EngineTokenCounter, TokenizeEndpoint, engine_root, redact_url

__all__ = [
    "DISCOVERY_TIMEOUT",
    "DISCOVER_ENV",
    "EngineInfo",
    "alearn_engine",
    "aread_engine_info",
    "discovery_on",
    "forget_engines",
    "know_engine",
    "learn_engine",
    "learn_engine_in_background",
    "read_engine_info",
]

_log = logging.getLogger(__name__)

DISCOVER_ENV = "CONTEXTPILOT_DISCOVER_ENGINE"
"""``0`` (or ``false``, ``no``, ``off``): pilots read nothing from their engines unless a
``discover=True`` says so where the engine is given. Hosted APIs (``engine="openai"``) are
read only with ``discover=True``."""

DISCOVERY_TIMEOUT = 3.0
"""Seconds the whole reading may take (every request of it, the ``/tokenize`` probe included)."""

RETRY_UNREACHABLE_S = 60.0
"""An engine that could not be reached is asked again after this many seconds (one that
answered, even that it does not say, is not asked again)."""

COUNTER_TIMEOUT = 5.0
"""Seconds the learned tokenizer may take to count a text (then the estimate counts it)."""

MAX_INFO_BYTES = 4 * 1024 * 1024
"""A longer answer of an info endpoint is not read (SGLang's ``/server_info``: ~40 KB;
vLLM's ``/metrics``: ~50 KB)."""

PROBE_TEXT = "How many tokens does the engine make of this sentence?"

_OFF = frozenset({"0", "false", "no", "off"})
_KINDS = ("sglang", "vllm", "llamacpp")


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What one engine said about its cache (``None``: it did not say)."""

    page_tokens: int | None
    """Its page: the tokens a reuse is counted in (SGLang ``--page-size``, vLLM's block)."""
    cache_tokens: int | None
    """Its KV pool in tokens."""
    tokenizer: TokenizeEndpoint | None
    """Its ``POST /tokenize``, checked to answer: an :class:`~.tokens.EngineTokenCounter`
    (estimates a text the engine does not count), ready to be the pilot's ``token_counter``."""
    kind: str
    """``"sglang"``, ``"vllm"``, ``"llamacpp"``; ``"unknown"`` (it answered but did not say
    which), ``"unreachable"`` (it did not answer)."""
    source: dict[str, str]
    """Per field (``page_tokens``, ``cache_tokens``, ``tokenizer``): the endpoint and field it
    came from, or why it is missing."""


class _Said(NamedTuple):
    kind: str
    page: int | None
    cache: int | None
    source: dict[str, str]


# ---- what each engine's info endpoint says ------------------------------------------------------
def _count(value: object) -> int | None:
    """A positive count of tokens from JSON or a metric label (``"32"``), else ``None``."""
    if isinstance(value, str) and value.isdigit() and len(value) <= 18:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 < value <= MAX_TOKENS else None


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def find_key(data: Any, key: str, depth: int = 3) -> Any:
    """The first value of ``key`` in nested JSON, shallowest first (SGLang has moved fields of
    ``/server_info`` into ``internal_states`` and back between versions)."""
    if isinstance(data, Mapping):
        if data.get(key) is not None:
            return data[key]
        children: Any = data.values()
    elif isinstance(data, list):
        children = data
    else:
        return None
    if depth <= 0:
        return None
    for child in children:
        found = find_key(child, key, depth - 1)
        if found is not None:
            return found
    return None


def _sglang(body: bytes, path: str) -> _Said | None:
    info = _json(body)
    page = _count(find_key(info, "page_size")) if isinstance(info, dict) else None
    if page is None:
        return None
    cache = _count(find_key(info, "max_total_num_tokens"))
    source = {"page_tokens": f"GET {path}: page_size"}
    source["cache_tokens"] = (
        f"GET {path}: max_total_num_tokens" if cache else f"not said: no max_total_num_tokens in {path}"
    )
    return _Said("sglang", page, cache, source)


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _vllm(body: bytes, path: str) -> _Said | None:
    pages: list[int] = []
    caches: list[int] = []
    aligned = False
    text = body.decode("utf-8", errors="replace")
    for line in text.splitlines():
        if not line.startswith("vllm:cache_config_info{"):
            continue
        labels = dict(_LABEL.findall(line[: line.rfind("}") + 1]))
        block = _count(labels.get("block_size"))
        if block is None:
            continue
        alignment = _count(labels.get("cache_hit_alignment_tokens"))
        aligned = aligned or alignment is not None
        pages.append(alignment or block)
        sizes = [size for size in (_count(labels.get("kv_cache_size_tokens")),) if size is not None]
        blocks = _count(labels.get("num_gpu_blocks"))
        if blocks is not None and blocks > 1:
            sizes.append((blocks - 1) * block)  # one block is vLLM's null block
        if sizes:
            caches.append(min(sizes))
    if not pages:
        if not text.startswith("vllm:") and "\nvllm:" not in text:
            return None
        # vLLM's metrics without the gauge: it says which engine it is, not its cache
        missing = f"not said: no vllm:cache_config_info in GET {path}"
        return _Said("vllm", None, None, {"page_tokens": missing, "cache_tokens": missing})
    # one line per engine of a data-parallel server: the coarsest page, the smallest pool
    field = "cache_hit_alignment_tokens" if aligned else "block_size"
    source = {"page_tokens": f"GET {path}: vllm:cache_config_info {field}"}
    source["cache_tokens"] = (
        f"GET {path}: vllm:cache_config_info kv_cache_size_tokens, at most (num_gpu_blocks - 1) x block_size"
        if caches
        else f"not said: neither kv_cache_size_tokens nor num_gpu_blocks in GET {path}"
    )
    return _Said("vllm", max(pages), min(caches) if caches else None, source)


def _llamacpp(body: bytes, path: str) -> _Said | None:
    props = _json(body)
    settings = props.get("default_generation_settings") if isinstance(props, dict) else None
    context = _count(settings.get("n_ctx")) if isinstance(settings, dict) else None
    if context is None or not isinstance(props, dict):
        return None
    slots = _count(props.get("total_slots")) or 1
    source = {
        "page_tokens": f"GET {path}: llama-server (its cache is per token)",
        "cache_tokens": f"GET {path}: n_ctx x total_slots (the most its slots hold; each keeps its last prompt)",
    }
    return _Said("llamacpp", 1, min(context * slots, MAX_TOKENS), source)


_Parse = Callable[[bytes, str], "_Said | None"]
_PROBES: dict[str, tuple[tuple[str, _Parse], ...]] = {
    "sglang": (("/server_info", _sglang), ("/get_server_info", _sglang)),
    "vllm": (("/metrics", _vllm),),
    "llamacpp": (("/props", _llamacpp),),
}


def _probes(engine: str | None) -> list[tuple[str, _Parse]]:
    """Every engine's endpoints, the named engine's first (a wrong name costs a 404 or two)."""
    kinds = sorted(_KINDS, key=lambda kind: kind != engine)
    return [probe for kind in kinds for probe in _PROBES[kind]]


# ---- reading them --------------------------------------------------------------------------------
class _Reading:
    """One reading's findings, request by request (shared by the sync and async readers)."""

    def __init__(self) -> None:
        self.said: _Said | None = None
        self.answered = False
        self.notes: list[str] = []

    @property
    def tokenize_body(self) -> str | None:
        """The ``/tokenize`` body this engine reads, if its kind says (llama-server: ``{"content"}``)."""
        return "llamacpp" if self.said is not None and self.said.kind == "llamacpp" else None

    def take(self, path: str, status: int | None, body: bytes | None, parse: _Parse) -> bool:
        """One answer (``status`` ``None``: none came); whether to stop asking."""
        if status is None:
            self.notes.append(f"GET {path}: no answer")
            return True  # unreachable or out of time: the next request would fare no better
        self.answered = True
        said = parse(body, path) if status == 200 and body is not None else None
        if said is None:
            self.notes.append(f"GET {path}: {status}" + (" (not it)" if status == 200 else ""))
            return False
        self.said = said
        return True

    def info(self, tokenizer: EngineTokenCounter | None, wanted: bool) -> EngineInfo:
        said = self.said
        why = "not said: " + ("; ".join(self.notes) if self.answered else "the engine did not answer")
        source = dict(said.source) if said is not None else {}
        source.setdefault("page_tokens", why)
        source.setdefault("cache_tokens", why)
        if tokenizer is not None:
            body = "{content}" if tokenizer.body_kind == "llamacpp" else "{model, prompt}"
            source["tokenizer"] = f"POST /tokenize {body}"
        elif not wanted:
            source["tokenizer"] = "not asked: the pilot has its token counter"
        elif said is not None:
            source["tokenizer"] = "not said: POST /tokenize answered no tokens"
        elif self.answered:  # a server of no engine we know: nothing is sent to it
            source["tokenizer"] = "not asked: the server did not say which engine it is"
        else:
            source["tokenizer"] = "not said: the engine did not answer"
        kind = said.kind if said is not None else ("unknown" if self.answered else "unreachable")
        return EngineInfo(said.page if said else None, said.cache if said else None, tokenizer, kind, source)


def _checked(timeout: float) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (0 < timeout < math.inf):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def _counter(root: str, model: str, headers: Mapping[str, str] | None) -> EngineTokenCounter:
    return EngineTokenCounter(root, model, timeout=COUNTER_TIMEOUT, headers=headers, fallback=estimate_tokens)


def read_engine_info(
    url: str,
    engine: str | None = None,
    *,
    model: str = "default",
    headers: Mapping[str, str] | None = None,
    timeout: float = DISCOVERY_TIMEOUT,
    tokenizer: bool = True,
) -> EngineInfo:
    """What the engine at ``url`` says of its page, pool and tokenizer (see the module's table).

    Args:
        url: the server (``http://127.0.0.1:30000``; a trailing ``/v1`` is dropped).
        engine: ``"sglang"``, ``"vllm"`` or ``"llamacpp"`` is asked first (others: every
            engine's endpoints in turn, until one says).
        model: the model name SGLang's and vLLM's ``/tokenize`` read (vLLM refuses one it
            does not serve).
        headers: sent with every request (``Authorization`` for a server with an API key).
        timeout: seconds the whole reading may take.
        tokenizer: check ``/tokenize`` too (``False``: ``tokenizer`` is ``None``).

    Never raises for the engine: what it does not say, or every field if it does not
    answer, is ``None``, and :attr:`EngineInfo.source` says why.
    """
    root = engine_root(url)
    seconds = _checked(timeout)
    reading = _Reading()
    counter: EngineTokenCounter | None = None
    with (
        deadline(seconds),
        httpx.Client(headers=dict(headers or {}), timeout=seconds, transport=deadline_transport()) as http,
    ):
        for path, parse in _probes(engine):
            status, body = _get(http, root + path)
            if reading.take(path, status, body, parse):
                break
        if tokenizer and reading.said is not None:
            counter = _counter(root, model, headers)
            if counter.probe(PROBE_TEXT, timeout=seconds, first=reading.tokenize_body) is None:
                counter.close()
                counter = None
    return reading.info(counter, tokenizer)


def _get(http: httpx.Client, url: str) -> tuple[int | None, bytes | None]:
    """An info endpoint's status and body (``None``: no answer; the body only for a 200
    within :data:`MAX_INFO_BYTES`)."""
    try:
        with http.stream("GET", url) as response:
            if response.status_code != 200:
                return response.status_code, None
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > MAX_INFO_BYTES:
                    return response.status_code, None
            return response.status_code, bytes(body)
    except httpx.HTTPError:
        return None, None


async def aread_engine_info(
    url: str,
    engine: str | None = None,
    *,
    model: str = "default",
    headers: Mapping[str, str] | None = None,
    timeout: float = DISCOVERY_TIMEOUT,
    tokenizer: bool = True,
) -> EngineInfo:
    """Async variant of :func:`read_engine_info` (the same arguments; nothing blocks the event loop)."""
    root = engine_root(url)
    seconds = _checked(timeout)
    reading = _Reading()
    found: list[EngineTokenCounter] = []

    async def read() -> None:
        async with httpx.AsyncClient(headers=dict(headers or {}), timeout=seconds) as http:
            for path, parse in _probes(engine):
                status, body = await _aget(http, root + path)
                if reading.take(path, status, body, parse):
                    break
            if tokenizer and reading.said is not None:
                counter = _counter(root, model, headers)
                if await counter.aprobe(http, PROBE_TEXT, timeout=seconds, first=reading.tokenize_body) is None:
                    counter.close()
                else:
                    found.append(counter)

    try:
        if sys.version_info >= (3, 11):  # no inner task: a caller's cancellation is never lost (3.11's wait_for)
            async with asyncio.timeout(seconds):
                await read()
        else:  # pragma: no cover - Python 3.10
            await asyncio.wait_for(read(), seconds)
    except asyncio.TimeoutError:
        reading.notes.append("out of time")
    return reading.info(found[0] if found else None, tokenizer)


async def _aget(http: httpx.AsyncClient, url: str) -> tuple[int | None, bytes | None]:
    try:
        async with http.stream("GET", url) as response:
            if response.status_code != 200:
                return response.status_code, None
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_INFO_BYTES:
                    return response.status_code, None
            return response.status_code, bytes(body)
    except httpx.HTTPError:
        return None, None


# ---- giving it to a pilot, once per engine -------------------------------------------------------
def know_engine(pilot: EngineSettings, info: EngineInfo) -> tuple[str, ...]:
    """Give ``pilot`` what ``info`` says, where its user left it unset (under its lock; see
    :func:`~..pilot.wiring.fill_engine_settings`). Returns the names set."""
    counter = info.tokenizer if isinstance(info.tokenizer, EngineTokenCounter) else None
    return fill_engine_settings(
        pilot, page_tokens=info.page_tokens, cache_tokens=info.cache_tokens, token_counter=counter
    )


def discovery_on(discover: bool | None) -> bool:
    """``discover`` if given, else the environment's (:data:`DISCOVER_ENV`; default on)."""
    if discover is not None:
        return bool(discover)
    return os.environ.get(DISCOVER_ENV, "").strip().lower() not in _OFF


_told_lock = threading.Lock()
_told: OrderedDict[str, None] = OrderedDict()
"""Engine roots whose missing fields were logged (once per process; bounded)."""
_MAX_TOLD = 1_024


def _unset(pilot: EngineSettings) -> list[str]:
    unset = [name for name in ("page_tokens", "cache_tokens") if getattr(pilot, name) is None]
    return unset + (["token_counter"] if pilot.token_counter is estimate_tokens else [])


def _claim(pilot: EngineSettings | None, url: str, discover: bool | None, engine: str | None) -> str | None:
    """The engine's root if this caller is to read it for ``pilot`` now (off, read before, being
    read, or nothing left unset: ``None``). A hosted API (``engine="openai"``) says nothing
    of its cache: read only when ``discover`` is ``True``."""
    if pilot is None or not discovery_on(discover) or not _unset(pilot):
        return None
    if engine == "openai" and discover is not True:
        return None
    root = engine_root(url)
    return root if claim_engine(pilot, root, time.monotonic()) else None


def _again_after(pilot: EngineSettings, root: str, seconds: float) -> None:
    read_engine_again(pilot, root, time.monotonic() + seconds)


def _settle(pilot: EngineSettings, root: str, info: EngineInfo) -> None:
    """Fill the pilot, and say once per engine what it still estimates."""
    filled = know_engine(pilot, info)
    if info.kind == "unreachable":
        _again_after(pilot, root, RETRY_UNREACHABLE_S)
    missing = _unset(pilot)
    where = redact_url(root)
    if not missing:
        _log.debug("%s: the pilot weighs with the engine's %s (%s)", where, ", ".join(filled), info.source)
        return
    with _told_lock:
        if root in _told:
            return
        _told[root] = None
        while len(_told) > _MAX_TOLD:
            _told.popitem(last=False)
    _log.info(
        "%s %s its %s (%s): the send decision weighs with estimates there (four characters a token, pages "
        "unknown). Give them to ContextPilot(page_tokens=..., cache_tokens=..., token_counter=...) to be exact; "
        "discover=False or %s=0 stops asking%s.",
        where,
        "could not be reached (or did not answer in time) to read" if info.kind == "unreachable" else "does not say",
        ", ".join(_NAMES[name] for name in missing),
        "; ".join(f"{name}: {info.source[_FIELDS[name]]}" for name in missing),
        DISCOVER_ENV,
        f" (asked again in {RETRY_UNREACHABLE_S:.0f} s)" if info.kind == "unreachable" else "",
    )


_NAMES = {"page_tokens": "page size", "cache_tokens": "KV pool", "token_counter": "tokenizer"}
_FIELDS = {"page_tokens": "page_tokens", "cache_tokens": "cache_tokens", "token_counter": "tokenizer"}


def learn_engine(
    pilot: EngineSettings | None,
    url: str,
    *,
    engine: str | None = None,
    model: str = "default",
    headers: Mapping[str, str] | None = None,
    discover: bool | None = None,
    timeout: float = DISCOVERY_TIMEOUT,
) -> EngineInfo | None:
    """Once per pilot and engine URL: read what the engine says (:func:`read_engine_info`)
    and give ``pilot`` what its user left unset (:func:`know_engine`). Call it off the
    pilot's lock; it takes at most ``timeout`` seconds and never raises for the engine.

    Returns what was read now, or ``None``: off (``discover`` / :data:`DISCOVER_ENV`),
    read before (or being read), or nothing left to learn."""
    root = _claim(pilot, url, discover, engine)
    if pilot is None or root is None:
        return None
    return _read_claimed(pilot, root, engine, model, headers, timeout)


def _read_claimed(
    pilot: EngineSettings,
    root: str,
    engine: str | None,
    model: str,
    headers: Mapping[str, str] | None,
    timeout: float,
) -> EngineInfo | None:
    try:
        info = read_engine_info(
            root, engine, model=model, headers=headers, timeout=timeout, tokenizer="token_counter" in _unset(pilot)
        )
        _settle(pilot, root, info)
    except Exception as exc:  # never the user's call's failure: the estimates stay
        _again_after(pilot, root, RETRY_UNREACHABLE_S)
        _log.info("%s: the engine's page and tokenizer were not read (%r); estimates stay", redact_url(root), exc)
        return None
    except BaseException:  # interrupted: it may be read again
        _again_after(pilot, root, 0.0)
        raise
    return info


def learn_engine_in_background(
    pilot: EngineSettings | None,
    url: str,
    *,
    engine: str | None = None,
    model: str = "default",
    headers: Mapping[str, str] | None = None,
    discover: bool | None = None,
    timeout: float = DISCOVERY_TIMEOUT,
) -> threading.Thread | None:
    """:func:`learn_engine` on a thread of its own (a daemon), for callers that must not wait
    for it (a framework's call, sync or async): the pilot weighs with what the engine says
    from the request after. Returns the thread, or ``None`` when there is nothing to read."""
    root = _claim(pilot, url, discover, engine)
    if pilot is None or root is None:
        return None
    thread = threading.Thread(
        target=_read_claimed,
        args=(pilot, root, engine, model, headers, timeout),
        name="contextpilot-engine-info",
        daemon=True,
    )
    thread.start()
    return thread


async def alearn_engine(
    pilot: EngineSettings | None,
    url: str,
    *,
    engine: str | None = None,
    model: str = "default",
    headers: Mapping[str, str] | None = None,
    discover: bool | None = None,
    timeout: float = DISCOVERY_TIMEOUT,
) -> EngineInfo | None:
    """Async variant of :func:`learn_engine` (cancelled, the engine may be read again later)."""
    root = _claim(pilot, url, discover, engine)
    if pilot is None or root is None:
        return None
    try:
        info = await aread_engine_info(
            root, engine, model=model, headers=headers, timeout=timeout, tokenizer="token_counter" in _unset(pilot)
        )
        _settle(pilot, root, info)
    except asyncio.CancelledError:
        _again_after(pilot, root, 0.0)
        raise
    except Exception as exc:  # never the user's call's failure: the estimates stay
        _again_after(pilot, root, RETRY_UNREACHABLE_S)
        _log.info("%s: the engine's page and tokenizer were not read (%r); estimates stay", redact_url(root), exc)
        return None
    return info


def forget_engines(pilot: EngineSettings) -> None:
    """Let ``pilot`` read its engines again (e.g. after a restart with another page size)."""
    read_engine_again(pilot, None, 0.0)
