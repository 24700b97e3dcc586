"""The same workload on a real server: without ContextPilot against with it, every pass on
a clean cache.

Used by ``contextpilot-integrations demo|simulate --engine URL`` (or ``--engine-cmd CMD``)
and the engine benchmark. For each mode (offline, online, chat) it runs four passes,
without ContextPilot, ContextPilot, ContextPilot, without (A B B A, so drift cancels),
each starting from an empty cache; or two (A B, ``--engine-passes 2``) where a pass is
long: token counts do not drift, only times do. The baseline is what an application without
ContextPilot sends: the documents' texts in retrieval order, no labels, no annotation,
every block resent in chat. Which engine serves is read from its ``/v1/models``
(``owned_by``): SGLang is emptied with ``/flush_cache``, vLLM with ``/reset_prefix_cache``
(served with ``VLLM_SERVER_DEV_MODE=1``); an engine that cannot flush, such as
llama-server, is restarted from ``--engine-cmd`` for every pass. A server that can do
neither is refused: its passes could share a cache and the comparison would flatter
whichever ran second. What is compared is what the server reports: its prompt and cached
token counts (computed = prompt - cached), and time to first token. Beside each, on SGLang
and vLLM, the simulator's prediction for the very same requests (:mod:`.engine_predict`):
the engine's tokens, page size and KV pool, so that the two can be checked against each other.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm.auto import tqdm

from ..core.annotations import DEFAULT_TEMPLATES
from ..core.blocks import Block
from ..core.prepared import PreparedRequest, resolve_history
from ..core.usage import check_usage
from ..engines.client import OpenAICompatClient, redact_url
from ..engines.tokens import EngineTokenCounter
from ..errors import ContextPilotError, EngineError
from ..pilot import BatchRequest, ContextPilot
from .engine_predict import CacheShape, EngineTokenizer, cache_shape, predict_cached
from .replay import SYSTEM_PROMPT, arrival_order
from .server_process import ServerProcess
from .trace import TraceRequest, turns_in_order

__all__ = [
    "EngineComparison",
    "EngineComparisonError",
    "EnginePass",
    "engine_identity",
    "engine_unreachable",
    "flush_engine_cache",
    "plain_prompt",
]

BASELINE = "retrieval order"
"""The pass without ContextPilot (the JSON key stays ``retrieval_order``)."""
ORDERS = {4: (BASELINE, "contextpilot", "contextpilot", BASELINE), 2: (BASELINE, "contextpilot")}
"""The passes of each mode, by ``--engine-passes``: A B B A (drift in time cancels) or A B."""


class EngineComparisonError(ContextPilotError):
    """The comparison cannot be run fairly, or the server failed; the message says why."""


FLUSH_PATHS = {"sglang": "/flush_cache", "vllm": "/reset_prefix_cache"}
"""Where each engine empties its prefix cache (vLLM: only with ``VLLM_SERVER_DEV_MODE=1``)."""


def flush_engine_cache(base_url: str, engine: str | None = None) -> bool:
    """Ask the server to drop its prefix cache (SGLang's ``/flush_cache``, vLLM's
    ``/reset_prefix_cache``; ``engine=None``: try both); False if it cannot."""
    paths = [FLUSH_PATHS[engine]] if engine in FLUSH_PATHS else list(FLUSH_PATHS.values())
    for path in paths:
        try:
            if httpx.post(base_url.rstrip("/") + path, timeout=30).status_code < 300:
                return True
        except httpx.HTTPError:
            pass
    return False


def engine_unreachable(base_url: str, timeout: float = 10.0) -> str | None:
    """Why nothing answers at ``base_url`` (a message naming it), or None when a server does:
    any HTTP answer to ``GET /v1/models``, even an error page, means one is there."""
    where = redact_url(base_url)
    try:
        httpx.get(base_url.rstrip("/") + "/v1/models", timeout=timeout)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        reason = str(exc) or type(exc).__name__
        return f"cannot reach the engine at {where}: {reason} (is the server running, and is the URL right?)"
    return None


def engine_identity(base_url: str) -> tuple[str, str | None]:
    """Which engine serves (``sglang``, ``vllm``, ``llamacpp``; else ``openai``) and its model
    name, from ``/v1/models`` (``owned_by``, ``id`` when it serves exactly one model)."""
    try:
        models = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30).json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return "openai", None
    owners = {str(m.get("owned_by", "")).lower() for m in models if isinstance(m, dict)}
    kind = next((engine for engine in ("sglang", "vllm", "llamacpp") if engine in owners), "openai")
    model = models[0].get("id") if len(models) == 1 and isinstance(models[0], dict) else None
    return kind, model if isinstance(model, str) else None


@dataclass
class EnginePass:
    """One pass over a mode's workload, as the server reported it."""

    mode: str
    name: str
    ttft_s: list[float] = field(default_factory=list)
    prompt_ms: list[float] = field(default_factory=list)
    """The engine's own prefill time of each request, where it reports one (llama-server)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    wall_s: float = 0.0
    served: list[str] = field(default_factory=list)
    """The trace ids of the requests served, in send order."""
    first_cached_tokens: int | None = None
    """What the engine reported cached for the pass's first request (0 on an empty cache)."""
    sent: list[tuple[list[dict[str, str]], str]] = field(default_factory=list, repr=False)
    """Each request's messages and the answer, in send order (what the simulator replays)."""
    simulated_prompt_tokens: int | None = None
    simulated_cached_tokens: int | None = None
    """The simulator's prediction for the same requests (None: the engine does not say its cache shape)."""

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the engine computed: prompt - cached."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def cached_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


@dataclass
class _Summary:
    name: str
    ttft: list[float]
    prompt_ms: list[float]
    prompt: int
    cached: int
    wall: float
    simulated: int | None
    """The simulator's computed tokens for the same requests, or None."""
    passes: int = 2
    """How many passes of this arm were summed (2 in A B B A, 1 in A B)."""

    @classmethod
    def of(cls, passes: Sequence[EnginePass]) -> _Summary:
        simulated = None
        if all(p.simulated_prompt_tokens is not None and p.simulated_cached_tokens is not None for p in passes):
            simulated = sum((p.simulated_prompt_tokens or 0) - (p.simulated_cached_tokens or 0) for p in passes)
        return cls(
            passes[0].name,
            [t for p in passes for t in p.ttft_s],
            [t for p in passes for t in p.prompt_ms],
            sum(p.prompt_tokens for p in passes),
            sum(p.cached_tokens for p in passes),
            statistics.fmean(p.wall_s for p in passes),
            simulated,
            len(passes),
        )

    def as_json(self) -> dict[str, Any]:
        computed = self.prompt - self.cached
        return {
            "name": self.name,
            "requests_per_pass": len(self.ttft) // self.passes,
            "mean_ttft_s": statistics.fmean(self.ttft) if self.ttft else 0.0,
            "p50_ttft_s": _percentile(self.ttft, 0.5),
            "p90_ttft_s": _percentile(self.ttft, 0.9),
            "engine_prompt_ms": sum(self.prompt_ms) / self.passes if self.prompt_ms else None,
            "prompt_tokens": self.prompt,
            "cached_tokens": self.cached,
            "computed_tokens": self.prompt - self.cached,
            "cached_ratio": self.cached / self.prompt if self.prompt else 0.0,
            "wall_s": self.wall,
            "simulator_computed_tokens": self.simulated,
            "simulator_gap": (self.simulated / computed - 1) if self.simulated is not None and computed else None,
        }


@dataclass
class EngineComparison:
    """Passes per mode on one server, and how each started from an empty cache."""

    server: str
    clean_cache: str
    engine: str = "openai"
    """Which engine served (from its ``/v1/models``): sglang, vllm, llamacpp or openai."""
    passes: list[EnginePass] = field(default_factory=list)
    cache: CacheShape | None = None
    """The engine's page size and KV pool, as the simulator was given them."""
    order: tuple[str, ...] = ORDERS[4]
    """The passes of each mode, in the order they ran."""

    @classmethod
    def run(
        cls, args: argparse.Namespace, single: Sequence[TraceRequest], chat: Sequence[TraceRequest]
    ) -> EngineComparison:
        """Run every mode of ``args.engine_modes``: ``args.engine_passes`` passes each (A B B A or A B)."""
        for name, trace in (("single-shot", single), ("chat", chat)):
            if any(r.texts is None for r in trace):
                raise EngineComparisonError(f"the {name} trace carries no block texts: a server needs the text")
        workloads = _Workloads(args, single, chat)
        progress = not (args.quiet or args.json)
        passes: list[EnginePass] = []
        order = ORDERS[args.engine_passes]
        with _Server(args.engine, args.engine_cmd) as server:
            for mode in args.engine_modes:
                for name in order:
                    with server.clean() as url:
                        passes.append(workloads.run(mode, name, url, server, progress))
            shape = _simulate(passes, url, server, args.model, progress)
        return cls(server.name, server.how, server.kind, passes, shape, order)

    def summaries(self, mode: str) -> tuple[_Summary, _Summary]:
        ours = [p for p in self.passes if p.mode == mode and p.name == "contextpilot"]
        theirs = [p for p in self.passes if p.mode == mode and p.name == BASELINE]
        return _Summary.of(theirs), _Summary.of(ours)

    def modes(self) -> list[str]:
        return list(dict.fromkeys(p.mode for p in self.passes))

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "server": self.server,
            "engine": self.engine,
            "clean_cache": self.clean_cache,
            "order": " ".join("B" if name == "contextpilot" else "A" for name in self.order),
            "baseline": "without ContextPilot: the texts in retrieval order, no labels, no annotation",
            "simulator_cache": None if self.cache is None else {"page_size": self.cache.page_size,
                                                                "capacity_tokens": self.cache.capacity_tokens},
            "modes": {},
        }  # fmt: skip
        for mode in self.modes():
            baseline, ours = (s.as_json() for s in self.summaries(mode))
            ratio = baseline["mean_ttft_s"] / ours["mean_ttft_s"] if ours["mean_ttft_s"] else None
            prefill = baseline["engine_prompt_ms"], ours["engine_prompt_ms"]
            computed = baseline["computed_tokens"]
            served = [sorted(p.served) for p in self.passes if p.mode == mode]
            out["modes"][mode] = {
                "retrieval_order": baseline,
                "contextpilot": ours,
                "mean_ttft_ratio": ratio,
                "engine_prompt_ms_ratio": prefill[0] / prefill[1] if prefill[0] and prefill[1] else None,
                "computed_ratio": ours["computed_tokens"] / computed if computed else None,
                "same_requests": all(s == served[0] for s in served),
                "first_request_cached_tokens": [p.first_cached_tokens for p in self.passes if p.mode == mode],
            }
        return out

    def print(self) -> None:
        print(
            f"\nserver {self.server} ({self.engine}): every pass on an empty cache ({self.clean_cache}); order "
            + " ".join("B" if name == "contextpilot" else "A" for name in self.order)
        )
        print("baseline: without ContextPilot (the texts in retrieval order, no labels, no annotation)")
        if self.cache is not None:
            print(
                f"simulator: the same requests in the engine's tokens, pages of {self.cache.page_size} tokens, "
                f"a KV pool of {self.cache.capacity_tokens:,} tokens (gap: simulator / engine computed - 1)"
            )
        head = (
            f"{'mode':<9}{'':<17}{'mean TTFT':>11}{'p50':>9}{'p90':>9}{'prompt':>11}{'cached':>19}"
            f"{'computed':>11}{'simulator':>11}{'gap':>8}{'wall':>9}"
        )
        print(head)
        print("-" * len(head))
        for mode, data in self.as_json()["modes"].items():
            for key in ("retrieval_order", "contextpilot"):
                s = data[key]
                cached = f"{s['cached_tokens']:,} ({s['cached_ratio']:.1%})"
                simulated = s["simulator_computed_tokens"]
                gap = s["simulator_gap"]
                print(
                    f"{mode if key == 'retrieval_order' else '':<9}{s['name']:<17}{s['mean_ttft_s'] * 1e3:>9.0f}ms"
                    f"{s['p50_ttft_s'] * 1e3:>7.0f}ms{s['p90_ttft_s'] * 1e3:>7.0f}ms{s['prompt_tokens']:>11,}"
                    f"{cached:>19}{s['computed_tokens']:>11,}"
                    f"{f'{simulated:,}' if simulated is not None else '-':>11}"
                    f"{f'{gap:+.1%}' if gap is not None else '-':>8}{s['wall_s']:>8.1f}s"
                )
            if data["computed_ratio"] is not None:
                print(f"{'':<9}computed prompt tokens x{data['computed_ratio']:.2f} with ContextPilot", end="")
                ratio = data["mean_ttft_ratio"]
                print(f"; mean TTFT without / with ContextPilot {ratio:.2f}" if ratio else "")
            if data["engine_prompt_ms_ratio"]:
                without, ours = (data[key]["engine_prompt_ms"] / 1e3 for key in ("retrieval_order", "contextpilot"))
                print(f"{'':<9}the engine's own prefill time a pass: {without:.1f} s without, {ours:.1f} s with "
                      f"ContextPilot (x{data['engine_prompt_ms_ratio']:.2f} faster)")  # fmt: skip


class _Server:
    """Where each pass runs: one server emptied before every pass (SGLang, vLLM), or a fresh
    process per pass started from the command (engines that cannot flush: llama-server)."""

    STARTUP_TIMEOUT = 300.0  # SGLang and vLLM take 15-20 s on an idle 2-core CPU, more when busy

    def __init__(self, url: str | None, command: str | None) -> None:
        self.url, self.command = url, command
        self.process: ServerProcess | None = None
        self.kind = "openai"
        self.model: str | None = None
        handle, name = tempfile.mkstemp(prefix="contextpilot-engine-", suffix=".log")
        os.close(handle)
        self._log = Path(name)  # the engine's output, shown when it fails to start
        if command:
            self.name, self.how = f"started from {command.split()[0]}", "a fresh server process for every pass"
        else:
            assert url is not None
            self.name, self.how = url, "its prefix cache flushed before every pass"
            self.kind, self.model = engine_identity(url)

    def __enter__(self) -> _Server:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
        self._log.unlink(missing_ok=True)

    @contextmanager
    def clean(self) -> Iterator[str]:
        if self.command:
            yield self._clean_process()
            return
        assert self.url is not None
        if not flush_engine_cache(self.url, self.kind):
            unreachable = engine_unreachable(self.url)
            if unreachable:  # it went away: say that, not that it cannot flush
                raise EngineComparisonError(unreachable)
            raise EngineComparisonError(
                f"refusing to compare: {redact_url(self.url)} did not flush its cache (POST /flush_cache or "
                "/reset_prefix_cache failed), so the passes could share a cache and whichever ran second would look "
                "faster. Use an engine that flushes (SGLang; vLLM with VLLM_SERVER_DEV_MODE=1), or give --engine-cmd "
                "so that every pass starts a fresh server (llama-server)"
            )
        yield self.url

    def _clean_process(self) -> str:
        """The running server emptied, if it can flush; else a fresh one."""
        if self.process is not None:
            if self.kind in FLUSH_PATHS and flush_engine_cache(self.process.url, self.kind):
                return self.process.url
            self.process.stop()
            self.process = None
        assert self.command is not None
        try:
            self.process = ServerProcess(self.command, self._log, startup_timeout=self.STARTUP_TIMEOUT)
        except (OSError, RuntimeError) as exc:
            raise EngineComparisonError(f"cannot start the server from --engine-cmd: {exc}") from exc
        url = self.process.url
        self.kind, self.model = engine_identity(url)
        program = next((a for a in shlex.split(self.command) if a != "env" and "=" not in a), "--engine-cmd")
        self.name = f"{self.kind}, started from {Path(program).name}"
        if self.kind in FLUSH_PATHS:
            # one request the workload does not contain, then empty: the first pass does
            # not pay the engine's first-request start-up alone
            _warm_up(url, self.model or "default")
            if flush_engine_cache(url, self.kind):
                self.how = f"one server, POST {FLUSH_PATHS[self.kind]} before every pass"
        return url


def _simulate(passes: Sequence[EnginePass], url: str, server: _Server, model: str, progress: bool) -> CacheShape | None:
    """The simulator's prompt and cached tokens for each pass's own requests, in the engine's
    tokens and cache shape (SGLang and vLLM say theirs); the shape, or None."""
    shape = cache_shape(url, server.kind) if server.kind in FLUSH_PATHS else None
    if shape is None:
        return None
    tokenizer = EngineTokenizer(url, server.model if model == "default" and server.model else model)
    total = sum(len(p.sent) for p in passes)
    with tokenizer, tqdm(total=total, desc="simulator", unit="req", leave=False, disable=not progress) as bar:
        try:
            for one in passes:
                requests = []
                for messages, answer in one.sent:
                    requests.append((tokenizer.messages(messages), tokenizer.text(answer)))
                    bar.update(1)
                one.simulated_prompt_tokens = sum(len(prompt) for prompt, _ in requests)
                one.simulated_cached_tokens = sum(predict_cached(requests, shape))
        except EngineError:
            for one in passes:  # the engine would not tokenize: no prediction rather than a partial one
                one.simulated_prompt_tokens = one.simulated_cached_tokens = None
            return None
    return shape


def _slots_shape(url: str) -> CacheShape | None:
    """llama-server's KV cache: its slots' context (``/props``: ``n_ctx`` a slot, ``total_slots``),
    in pages of one token; ``None`` if it does not say. A slot keeps its last prompt only, so
    this is the most it can hold, not what it keeps."""
    try:
        props = httpx.get(url.rstrip("/") + "/props", timeout=30).json()
        context = int(props["default_generation_settings"]["n_ctx"])
        slots = int(props.get("total_slots") or 1)
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return CacheShape(1, context * slots) if context > 0 and slots > 0 else None


def _warm_up(url: str, model: str) -> None:
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "warm up"}]}
    with suppress(httpx.HTTPError):  # the comparison's own requests will say what is wrong
        httpx.post(url.rstrip("/") + "/v1/chat/completions", json=body, timeout=300)


class _Workloads:
    """The requests of each mode, and how each pass sends them."""

    def __init__(self, args: argparse.Namespace, single: Sequence[TraceRequest], chat: Sequence[TraceRequest]) -> None:
        self.args = args
        self.single = list(single[: args.engine_requests])
        chosen: list[TraceRequest] = []
        for _, turns in turns_in_order(chat):
            if len(chosen) >= args.engine_requests:
                break
            chosen.extend(chat[i] for i in turns)
        self.chat = chosen[: max(args.engine_requests, 1)]
        self._shapes: dict[str, CacheShape | None] = {}  # engine kind -> its cache, read once

    def blocks(self, request: TraceRequest) -> list[Block]:
        limit = self.args.engine_block_chars
        texts = request.texts or ()
        return [
            Block(id=b, text=text[:limit] if limit else text) for b, text in zip(request.blocks, texts, strict=True)
        ]

    def pilot(self, url: str, server: _Server, model: str, counter: EngineTokenCounter) -> ContextPilot:
        """The pilot as a user who knows the engine sets it up: the engine's tokenizer
        (every block, label and annotation in its tokens), and where the engine says them
        (SGLang, vLLM; read once, before the first pass) its KV pool and page size, so the
        index forgets what the pool cannot hold and no reorder is bet on less than a page;
        llama-server's slots' context (``/props``), pages of one token."""
        if server.kind not in self._shapes:
            self._shapes[server.kind] = cache_shape(url, server.kind) if server.kind in FLUSH_PATHS else None
            if server.kind == "llamacpp":
                self._shapes[server.kind] = _slots_shape(url)
        shape = self._shapes.get(server.kind)
        if shape is None:
            return ContextPilot(token_counter=counter)
        return ContextPilot(token_counter=counter, cache_tokens=shape.capacity_tokens, page_tokens=shape.page_size)

    def run(self, mode: str, name: str, url: str, server: _Server, progress: bool) -> EnginePass:
        ours = name == "contextpilot"
        record = EnginePass(mode, name)
        total = len(self.chat if mode == "chat" else self.single)
        model = server.model if self.args.model == "default" and server.model else self.args.model
        counter = EngineTokenCounter(url, model)
        pilot = self.pilot(url, server, model, counter) if ours else ContextPilot()
        bar = tqdm(total=total, desc=f"{mode}: {name}", unit="req", leave=False, disable=not progress)
        start = time.perf_counter()
        try:
            with counter, OpenAICompatClient(url, pilot, model=model, engine=server.kind, timeout=600) as client:
                send = _Sender(client, record, bar)
                if mode == "chat":
                    self._chat(pilot, send, ours)
                elif mode == "offline" and ours:
                    batch = [BatchRequest(self.blocks(r), r.question or "") for r in self.single]
                    for prepared in pilot.plan(batch):
                        assert prepared.batch_index is not None
                        send(self.single[prepared.batch_index].id, prepared)
                else:
                    for index in arrival_order(self.single, self.args.arrival):
                        request = self.single[index]
                        if ours:
                            send(request.id, pilot.prepare(self.blocks(request), request.question or ""))
                        else:
                            send(request.id, plain_prompt(self.blocks(request), request.question or ""))
        except EngineError as exc:
            raise EngineComparisonError(f"{mode}, {name}: {exc}") from exc
        finally:
            bar.close()
        record.wall_s = time.perf_counter() - start
        return record

    def _chat(self, pilot: ContextPilot, send: _Sender, ours: bool) -> None:
        """Conversations interleaved by turn; each turn sends its kept history and real
        answers. With ContextPilot, blocks an earlier kept turn carries become references."""
        window = self.args.history_turns
        conversations = list(turns_in_order(self.chat))
        history: dict[str, list[list[dict[str, str]]]] = {name: [] for name, _ in conversations}
        prepared: dict[str, list[PreparedRequest]] = {name: [] for name, _ in conversations}
        depth = 0
        while True:
            row = [(name, turns[depth]) for name, turns in conversations if depth < len(turns)]
            if not row:
                return
            for name, index in row:
                request = self.chat[index]
                turns = history[name]
                kept = list(range(0 if window is None else max(0, len(turns) - window), len(turns)))
                before = [dict(m) for turn in kept for m in turns[turn]]
                prompt: PreparedRequest | str
                if ours:
                    texts = [m["content"] for m in before]  # a kept turn may refer to one that left the window
                    if resolve_history(texts, [prepared[name][turn] for turn in kept]):
                        before = [{**m, "content": text} for m, text in zip(before, texts, strict=True)]
                    prompt = pilot.prepare(self.blocks(request), request.question or "", name, kept_turns=kept)
                    prepared[name].append(prompt)
                else:
                    prompt = plain_prompt(self.blocks(request), request.question or "")
                answer = send(request.id, prompt, before, self.args.answer_tokens)
                text = prompt.render() if isinstance(prompt, PreparedRequest) else prompt
                turns.append([{"role": "user", "content": text}, {"role": "assistant", "content": answer}])
            depth += 1


def plain_prompt(blocks: Sequence[Block], question: str) -> str:
    """The user prompt an application without ContextPilot sends: the documents' texts in
    retrieval order, then the question (same separator and question line as ours)."""
    templates = DEFAULT_TEMPLATES
    return templates.separator.join([*(block.text for block in blocks), templates.question.format(query=question)])


@dataclass
class _Sender:
    client: OpenAICompatClient
    record: EnginePass
    bar: Any

    def __call__(
        self, key: str, prompt: PreparedRequest | str, history: list[dict[str, str]] | None = None, answer: int = 1
    ) -> str:
        params: dict[str, Any] = {"max_tokens": max(1, answer), "temperature": 0}
        if isinstance(prompt, PreparedRequest):
            messages = prompt.to_messages(SYSTEM_PROMPT, history or ())  # what the client sends
            result = self.client.chat(prompt, system_prompt=SYSTEM_PROMPT, history=history, **params)
        else:
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, *(history or ())]
            messages.append({"role": "user", "content": prompt})
            result = self.client.send_messages(messages, **params)
        try:  # the client kept the answer; a comparison cannot keep a count above 100%
            check_usage(result.prompt_tokens, result.cached_tokens)
        except (TypeError, ValueError) as exc:
            raise EngineError(f"{self.client.where} reported for request {result.request_id!r}: {exc}") from None
        self.record.ttft_s.append(result.ttft_s)
        if result.prompt_ms is not None:
            self.record.prompt_ms.append(result.prompt_ms)
        self.record.prompt_tokens += result.prompt_tokens or 0
        self.record.cached_tokens += result.cached_tokens or 0
        if not self.record.served:
            self.record.first_cached_tokens = result.cached_tokens
        self.record.served.append(key)
        self.record.sent.append((messages, result.text))
        self.bar.update(1)
        return result.text
