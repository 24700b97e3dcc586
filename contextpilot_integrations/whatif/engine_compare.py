"""The same workload on a real server: retrieval order against ContextPilot, every pass on
a clean cache.

Used by ``contextpilot-integrations demo|simulate --engine URL`` (or ``--engine-cmd CMD``)
and the engine benchmark. For each mode (offline, online, chat) it runs four passes,
retrieval order, ContextPilot, ContextPilot, retrieval order (A B B A, so drift cancels),
each starting from an empty cache: SGLang's ``/flush_cache``, or a fresh server process
started from ``--engine-cmd``. A server that can do neither is refused: its passes could
share a cache and the comparison would flatter whichever ran second. What is compared is
what the server reports: time to first token and ``cached_tokens``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
from tqdm.auto import tqdm

from ..blocks import Block
from ..engines.client import OpenAICompatClient
from ..errors import ContextPilotError, EngineError
from ..pilot import BatchRequest, ContextPilot
from ..prepared import PreparedRequest
from ..usage import check_usage
from .llama_server import ServerProcess
from .replay import SYSTEM_PROMPT, arrival_order
from .trace import TraceRequest, turns_in_order

__all__ = ["EngineComparison", "EngineComparisonError", "EnginePass", "flush_engine_cache"]


class EngineComparisonError(ContextPilotError):
    """The comparison cannot be run fairly, or the server failed; the message says why."""


def flush_engine_cache(base_url: str) -> bool:
    """Ask the server to drop its prefix cache (SGLang's ``/flush_cache``); False if it cannot."""
    try:
        return httpx.post(base_url.rstrip("/") + "/flush_cache", timeout=30).status_code < 300
    except httpx.HTTPError:
        return False


@dataclass
class EnginePass:
    """One pass over a mode's workload, as the server reported it."""

    mode: str
    name: str
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    wall_s: float = 0.0

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
    prompt: int
    cached: int
    wall: float

    @classmethod
    def of(cls, passes: Sequence[EnginePass]) -> _Summary:
        return cls(
            passes[0].name,
            [t for p in passes for t in p.ttft_s],
            sum(p.prompt_tokens for p in passes),
            sum(p.cached_tokens for p in passes),
            statistics.fmean(p.wall_s for p in passes),
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "requests_per_pass": len(self.ttft) // 2,
            "mean_ttft_s": statistics.fmean(self.ttft) if self.ttft else 0.0,
            "p50_ttft_s": _percentile(self.ttft, 0.5),
            "p90_ttft_s": _percentile(self.ttft, 0.9),
            "prompt_tokens": self.prompt,
            "cached_tokens": self.cached,
            "cached_ratio": self.cached / self.prompt if self.prompt else 0.0,
            "wall_s": self.wall,
        }


@dataclass
class EngineComparison:
    """Passes per mode on one server, and how each started from an empty cache."""

    server: str
    clean_cache: str
    passes: list[EnginePass] = field(default_factory=list)

    @classmethod
    def run(
        cls, args: argparse.Namespace, single: Sequence[TraceRequest], chat: Sequence[TraceRequest]
    ) -> EngineComparison:
        """Run every mode of ``args.engine_modes``: four passes each, A B B A."""
        for name, trace in (("single-shot", single), ("chat", chat)):
            if any(r.texts is None for r in trace):
                raise EngineComparisonError(f"the {name} trace carries no block texts: a server needs the text")
        workloads = _Workloads(args, single, chat)
        server = _Server(args.engine, args.engine_cmd)
        comparison = cls(server.name, server.how)
        progress = not (args.quiet or args.json)
        for mode in args.engine_modes:
            for name in ("retrieval order", "contextpilot", "contextpilot", "retrieval order"):
                with server.clean() as url:
                    comparison.passes.append(workloads.run(mode, name, url, progress))
        return comparison

    def summaries(self, mode: str) -> tuple[_Summary, _Summary]:
        ours = [p for p in self.passes if p.mode == mode and p.name == "contextpilot"]
        theirs = [p for p in self.passes if p.mode == mode and p.name == "retrieval order"]
        return _Summary.of(theirs), _Summary.of(ours)

    def modes(self) -> list[str]:
        return list(dict.fromkeys(p.mode for p in self.passes))

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"server": self.server, "clean_cache": self.clean_cache, "modes": {}}
        for mode in self.modes():
            baseline, ours = (s.as_json() for s in self.summaries(mode))
            ratio = baseline["mean_ttft_s"] / ours["mean_ttft_s"] if ours["mean_ttft_s"] else None
            out["modes"][mode] = {"retrieval_order": baseline, "contextpilot": ours, "mean_ttft_ratio": ratio}
        return out

    def print(self) -> None:
        print(f"\nserver {self.server}: every pass on an empty cache ({self.clean_cache}); order A B B A")
        head = f"{'mode':<9}{'':<17}{'mean TTFT':>11}{'p50':>9}{'p90':>9}{'cached / prompt tokens':>30}{'wall':>9}"
        print(head)
        print("-" * len(head))
        for mode, data in self.as_json()["modes"].items():
            for key in ("retrieval_order", "contextpilot"):
                s = data[key]
                tokens = f"{s['cached_tokens']:,} / {s['prompt_tokens']:,} ({s['cached_ratio']:.1%})"
                print(
                    f"{mode if key == 'retrieval_order' else '':<9}{s['name']:<17}{s['mean_ttft_s'] * 1e3:>9.0f}ms"
                    f"{s['p50_ttft_s'] * 1e3:>7.0f}ms{s['p90_ttft_s'] * 1e3:>7.0f}ms{tokens:>30}{s['wall_s']:>8.1f}s"
                )
            if data["mean_ttft_ratio"]:
                print(f"{'':<9}mean TTFT {data['mean_ttft_ratio']:.2f}x lower with ContextPilot")


class _Server:
    """Where each pass runs: a fresh process per pass, or one server flushed before each."""

    def __init__(self, url: str | None, command: str | None) -> None:
        self.url, self.command = url, command
        if command:
            self.name, self.how = f"started from {command.split()[0]}", "a fresh server process for every pass"
        else:
            assert url is not None
            self.name, self.how = url, "POST /flush_cache before every pass"

    @contextmanager
    def clean(self) -> Iterator[str]:
        if self.command:
            try:
                process = ServerProcess(self.command)
            except (OSError, RuntimeError) as exc:
                raise EngineComparisonError(f"cannot start the server from --engine-cmd: {exc}") from exc
            try:
                yield process.url
            finally:
                process.stop()
            return
        assert self.url is not None
        if not flush_engine_cache(self.url):
            raise EngineComparisonError(
                f"refusing to compare: {self.url} did not flush its cache (POST /flush_cache failed), so the passes "
                "could share a cache and whichever ran second would look faster. Use an engine with /flush_cache "
                "(SGLang), or give --engine-cmd so that every pass starts a fresh server (llama-server)"
            )
        yield self.url


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

    def blocks(self, request: TraceRequest) -> list[Block]:
        limit = self.args.engine_block_chars
        texts = request.texts or ()
        return [
            Block(id=b, text=text[:limit] if limit else text) for b, text in zip(request.blocks, texts, strict=True)
        ]

    def run(self, mode: str, name: str, url: str, progress: bool) -> EnginePass:
        ours = name == "contextpilot"
        pilot = ContextPilot() if ours else ContextPilot("retrieval")  # the baseline sends its prompts plain
        record = EnginePass(mode, name)
        total = len(self.chat if mode == "chat" else self.single)
        bar = tqdm(total=total, desc=f"{mode}: {name}", unit="req", leave=False, disable=not progress)
        start = time.perf_counter()
        try:
            with OpenAICompatClient(url, pilot, model=self.args.model, timeout=600) as client:
                send = _Sender(client, record, bar, plain=not ours)
                if mode == "chat":
                    self._chat(pilot, send, ours)
                elif mode == "offline" and ours:
                    batch = [BatchRequest(self.blocks(r), r.question or "") for r in self.single]
                    for prepared in pilot.plan(batch):
                        send(prepared)
                else:
                    for index in arrival_order(self.single, self.args.arrival):
                        request = self.single[index]
                        send(pilot.prepare(self.blocks(request), request.question or ""))
        except EngineError as exc:
            raise EngineComparisonError(f"{mode}, {name}: {exc}") from exc
        finally:
            bar.close()
        record.wall_s = time.perf_counter() - start
        return record

    def _chat(self, pilot: ContextPilot, send: _Sender, deduplicate: bool) -> None:
        """Conversations interleaved by turn; each turn sends its kept history and real answers."""
        window = self.args.history_turns
        conversations = list(turns_in_order(self.chat))
        history: dict[str, list[list[dict[str, str]]]] = {name: [] for name, _ in conversations}
        depth = 0
        while True:
            row = [(name, turns[depth]) for name, turns in conversations if depth < len(turns)]
            if not row:
                return
            for name, index in row:
                request = self.chat[index]
                turns = history[name]
                kept = list(range(0 if window is None else max(0, len(turns) - window), len(turns)))
                prepared = pilot.prepare(
                    self.blocks(request),
                    request.question or "",
                    name if deduplicate else None,
                    kept_turns=kept if deduplicate else None,
                )
                answer = send(prepared, [m for turn in kept for m in turns[turn]], self.args.answer_tokens)
                user = (prepared if deduplicate else replace(prepared, labels=False)).render()
                turns.append([{"role": "user", "content": user}, {"role": "assistant", "content": answer}])
            depth += 1


@dataclass
class _Sender:
    client: OpenAICompatClient
    record: EnginePass
    bar: Any
    plain: bool = False

    def __call__(self, prepared: PreparedRequest, history: list[dict[str, str]] | None = None, answer: int = 1) -> str:
        if self.plain:  # the prompt a user sends without ContextPilot: no labels, no annotation
            prepared = replace(prepared, labels=False)
        result = self.client.chat(
            prepared, system_prompt=SYSTEM_PROMPT, history=history, max_tokens=max(1, answer), temperature=0
        )
        try:  # the client kept the answer; a comparison cannot keep a count above 100%
            check_usage(result.prompt_tokens, result.cached_tokens)
        except (TypeError, ValueError) as exc:
            raise EngineError(f"{self.client.where} reported for request {prepared.request_id!r}: {exc}") from None
        self.record.ttft_s.append(result.ttft_s)
        self.record.prompt_tokens += result.prompt_tokens or 0
        self.record.cached_tokens += result.cached_tokens or 0
        self.bar.update(1)
        return result.text
