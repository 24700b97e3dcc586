"""Send the same RAG workload to a real server twice: retrieval order vs. ContextPilot.

Used by ``contextpilot-integrations demo --engine URL`` and the backend benchmark: the
server's own ``cached_tokens`` and the time to first token are what is compared.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from tqdm.auto import tqdm

from ..blocks import Block
from ..engines.client import OpenAICompatClient
from ..pilot import ContextPilot
from ..prepared import PreparedRequest

__all__ = ["EngineRun", "compare_on_engine", "flush_engine_cache"]

SYSTEM_PROMPT = "Answer the question using the context documents."


@dataclass(frozen=True, slots=True)
class EngineRun:
    """One pass over the workload, as the server reported it."""

    name: str
    ttft_s: tuple[float, ...]
    prompt_tokens: int
    cached_tokens: int

    @property
    def mean_ttft_s(self) -> float:
        return statistics.fmean(self.ttft_s) if self.ttft_s else 0.0

    @property
    def p90_ttft_s(self) -> float:
        if not self.ttft_s:
            return 0.0
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]

    @property
    def cached_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def flush_engine_cache(base_url: str) -> bool:
    """Ask the server to drop its prefix cache (SGLang's ``/flush_cache``); False if it cannot."""
    try:
        return httpx.post(base_url.rstrip("/") + "/flush_cache", timeout=30).status_code < 300
    except httpx.HTTPError:
        return False


def _send(name: str, client: OpenAICompatClient, prepared: Sequence[PreparedRequest], progress: bool) -> EngineRun:
    ttfts: list[float] = []
    prompt = cached = 0
    for request in tqdm(prepared, desc=name, unit="req", leave=False, disable=not progress):
        result = client.chat(request, system_prompt=SYSTEM_PROMPT, max_tokens=1, temperature=0)
        ttfts.append(result.ttft_s)
        prompt += result.prompt_tokens or 0
        cached += result.cached_tokens or 0
    return EngineRun(name, tuple(ttfts), prompt, cached)


def compare_on_engine(
    base_url: str,
    requests: Sequence[tuple[Sequence[Block], str]],
    *,
    model: str = "default",
    progress: bool = True,
    timeout: float = 300.0,
) -> tuple[EngineRun, EngineRun]:
    """Retrieval order (one request at a time, input order) vs. ContextPilot's offline plan.

    The server's cache is flushed before each pass where it supports ``/flush_cache``.
    """
    baseline_pilot = ContextPilot("retrieval")
    flush_engine_cache(base_url)
    with OpenAICompatClient(base_url, baseline_pilot, model=model, timeout=timeout) as client:
        prepared = [baseline_pilot.prepare(blocks, query) for blocks, query in requests]
        baseline = _send("retrieval order", client, prepared, progress)
    pilot = ContextPilot()
    flush_engine_cache(base_url)
    with OpenAICompatClient(base_url, pilot, model=model, timeout=timeout) as client:
        ours = _send("contextpilot", client, pilot.plan(list(requests)), progress)
    return baseline, ours
