"""The simulator's count beside the engine's, for the very requests the engine served.

An engine comparison reports what the server computed; this predicts the same number with
:class:`~.simulate.RadixCacheSimulator`, from the same requests in the same order, so the
two can be checked against each other. What makes the prediction match a real engine:

- tokens: the engine's own tokenizer and chat template (its ``/tokenize`` endpoint, which
  SGLang and vLLM serve), so the system prompt, the template's role markers, labels,
  annotation and history are all counted as the engine counts them;
- pages: the cache holds whole pages of ``page_size`` tokens (SGLang ``--page-size``,
  vLLM ``--block-size``) and a request reuses whole pages only; a hit leaves at least one
  prompt token to compute (both engines cap a match at the prompt's length less one);
- generation: the answer's tokens are cached after the prompt, all but the last (its KV
  is never computed), so the next turn of a chat reuses them;
- capacity: the engine's KV pool in tokens (SGLang ``max_total_num_tokens`` from
  ``/server_info``, vLLM ``num_gpu_blocks`` of ``/metrics``, less the null block),
  least-recently-used whole leaves evicted first.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import httpx

from ..engines.engine_info import find_key
from ..engines.tokens import TokenizeEndpoint
from .simulate import BlockSpec, RadixCacheSimulator

__all__ = ["CacheShape", "EngineTokenizer", "cache_shape", "predict_cached"]

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class CacheShape:
    """An engine's prefix cache: page size and KV pool, in tokens."""

    page_size: int
    capacity_tokens: int


def cache_shape(base_url: str, engine: str) -> CacheShape | None:
    """Read the page size and KV pool from a running SGLang or vLLM; ``None`` if it does not say."""
    base = base_url.rstrip("/")
    try:
        if engine == "sglang":
            info = httpx.get(base + "/server_info", timeout=30).json()
            page, pool = find_key(info, "page_size"), find_key(info, "max_total_num_tokens")
            return CacheShape(int(page), int(pool)) if page and pool else None
        if engine == "vllm":
            metrics = httpx.get(base + "/metrics", timeout=30).text
            line = next((m for m in metrics.splitlines() if m.startswith("vllm:cache_config_info{")), "")
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            page, blocks = int(labels.get("block_size") or 0), int(labels.get("num_gpu_blocks") or 0)
            return CacheShape(page, (blocks - 1) * page) if page and blocks > 1 else None  # one null block
    except (httpx.HTTPError, ValueError):
        return None
    return None


class EngineTokenizer(TokenizeEndpoint):
    """The engine's own token ids for chat messages and answers (``POST /tokenize``, see
    :class:`~..engines.tokens.TokenizeEndpoint`), remembered per request: the passes of a
    comparison send the same prompts again. At most ``MAX_REMEMBERED``, the least recently used
    forgotten first."""

    MAX_REMEMBERED = 20_000

    def __init__(self, base_url: str, model: str) -> None:
        super().__init__(base_url, model, timeout=60.0)
        self._seen: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()  # a digest of the body -> its ids
        self._seen_lock = threading.Lock()

    def messages(self, messages: Sequence[Mapping[str, str]]) -> tuple[int, ...]:
        """The prompt's ids, chat template and generation prompt included."""
        return self._remembered([dict(m) for m in messages], super().messages, messages)

    def text(self, text: str) -> tuple[int, ...]:
        """A generated answer's ids, no special tokens added."""
        return self._remembered(text, super().text, text)

    def _remembered(self, request: object, tokenize: Callable[[_T], tuple[int, ...]], given: _T) -> tuple[int, ...]:
        """``tokenize(given)``, remembered under ``request`` (its JSON form)."""
        key = hashlib.blake2b(json.dumps([self.model, request], sort_keys=True).encode(), digest_size=16).digest()
        with self._seen_lock:
            ids = self._seen.get(key)
            if ids is not None:
                self._seen.move_to_end(key)
                return ids
        ids = tokenize(given)  # I/O: off the lock
        with self._seen_lock:
            self._seen[key] = ids
            while len(self._seen) > self.MAX_REMEMBERED:
                self._seen.popitem(last=False)
        return ids


def predict_cached(requests: Sequence[tuple[Sequence[int], Sequence[int]]], shape: CacheShape) -> list[int]:
    """Cached prompt tokens of each request, in send order, on a fresh cache of ``shape``.

    Args:
        requests: (prompt ids, generated ids) of each request, in the order served.
    """
    page = shape.page_size
    cache = RadixCacheSimulator(shape.capacity_tokens)
    cached = []
    for n, (prompt, generated) in enumerate(requests):
        kept = [*prompt, *generated[:-1]]  # the last generated token's KV is never computed
        pages: list[BlockSpec] = [(tuple(kept[i : i + page]), page) for i in range(0, len(kept) // page * page, page)]
        reusable = max(0, len(prompt) - 1) // page  # a hit leaves at least one prompt token to compute
        served = cache.request(f"p{n}", pages[:reusable], pages[reusable:])
        cached.append(served.hit_tokens)
    return cached
