"""Where each block of a prompt ends in the engine's token ids, from the engine's ``/tokenize``.

Mapping the engine's KV events or a short cached-token report onto blocks needs each
block's token ids; this tokenizes each distinct rendered block once and remembers it.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import httpx

from ..core.annotations import render_block
from ..core.prepared import PreparedRequest
from .deadline import deadline, deadline_transport, time_left
from .kv_mapping import block_token_ends

__all__ = ["BlockTokenizer"]


class BlockTokenizer:
    """Token ids of rendered blocks, from the engine's own ``/tokenize`` endpoint, cached.

    A block's rendered text depends on the block alone (byte-identical prefixes), so each
    distinct block is tokenized once; :meth:`block_ends` then locates the blocks of a
    prompt in the token ids the engine returned for it (:func:`.kv_mapping.block_token_ends`).
    SGLang tokenizes a list of texts in one call; vLLM one text per call. Anything that
    goes wrong yields ``None`` (no block ends: the conservative mapping), never an error.

    Args:
        base_url: the engine (``/v1`` is stripped).
        engine: ``"sglang"`` or ``"vllm"`` (others have no usable endpoint: ``None``).
        max_entries: distinct block texts remembered (least recently used forgotten first).
    """

    def __init__(
        self,
        base_url: str,
        engine: str,
        *,
        model: str = "default",
        headers: dict[str, str] | None = None,
        timeout: float = 10.0,
        max_entries: int = 8_192,
    ) -> None:
        root = base_url.rstrip("/")
        self.url = (root[: -len("/v1")] if root.endswith("/v1") else root) + "/tokenize"
        self.engine = engine
        self.model = model
        self.headers = dict(headers or {})
        self.timeout = timeout
        self.max_entries = max_entries
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self._http: httpx.Client | None = None

    def tokens(self, text: str) -> tuple[int, ...] | None:
        """The cached token ids of a rendered block (``None`` if not tokenized yet)."""
        with self._lock:
            return self._cache.get(text)

    def block_ends(
        self, prepared: PreparedRequest, prompt_ids: Sequence[int], http: httpx.Client | None = None
    ) -> list[int] | None:
        """Where each of the request's blocks ends in the prompt's token ids (``None``:
        unknown). ``http``: the caller's client (default: one of this tokenizer's own, made
        on first use; :meth:`close` closes it)."""
        texts = _block_texts(prepared)
        if not texts or self.engine not in ("sglang", "vllm"):
            return None
        try:
            missing = self._missing(texts)
            if missing and http is None:
                http = self._own_client()
            with deadline(self.timeout):  # within the caller's deadline, if it ends sooner
                for batch in self._batches(missing):
                    assert http is not None
                    response = http.post(self.url, json=self._body(batch), headers=self.headers, timeout=self.timeout)
                    self._store(batch, response)
        except (httpx.HTTPError, ValueError):
            return None
        return self._ends(texts, prompt_ids)

    def close(self) -> None:
        """Close the client :meth:`block_ends` made for itself (if any)."""
        with self._lock:
            http, self._http = self._http, None
        if http is not None:
            http.close()

    def _own_client(self) -> httpx.Client:
        with self._lock:
            if self._http is None:
                self._http = httpx.Client(timeout=self.timeout, transport=deadline_transport())
                # a chat model that owns this tokenizer has no close(): the client goes with it
                weakref.finalize(self, self._http.close)
            return self._http

    async def ablock_ends(
        self, prepared: PreparedRequest, prompt_ids: Sequence[int], http: httpx.AsyncClient
    ) -> list[int] | None:
        texts = _block_texts(prepared)
        if not texts or self.engine not in ("sglang", "vllm"):
            return None
        left = time_left()
        try:
            missing = self._missing(texts)
            await asyncio.wait_for(
                self._afetch(missing, http), self.timeout if left is None else min(left, self.timeout)
            )
        except (httpx.HTTPError, ValueError, asyncio.TimeoutError):  # out of time: block ends unknown
            return None
        return self._ends(texts, prompt_ids)

    async def _afetch(self, missing: list[str], http: httpx.AsyncClient) -> None:
        for batch in self._batches(missing):
            response = await http.post(self.url, json=self._body(batch), headers=self.headers, timeout=self.timeout)
            self._store(batch, response)

    def _missing(self, texts: list[str]) -> list[str]:
        with self._lock:
            return list(dict.fromkeys(text for text in texts if text not in self._cache))

    def _batches(self, texts: list[str]) -> list[list[str]]:
        if not texts:
            return []
        return [texts] if self.engine == "sglang" else [[text] for text in texts]

    def _body(self, texts: list[str]) -> dict[str, Any]:
        prompt: str | list[str] = texts if self.engine == "sglang" else texts[0]
        return {"model": self.model, "prompt": prompt, "add_special_tokens": False}

    def _store(self, texts: list[str], response: httpx.Response) -> None:
        response.raise_for_status()
        tokens = response.json().get("tokens")
        if self.engine == "sglang" and isinstance(tokens, list) and tokens and isinstance(tokens[0], int):
            tokens = [tokens]  # one text answered flat
        if self.engine == "vllm":
            tokens = [tokens]
        if not isinstance(tokens, list) or len(tokens) != len(texts):
            raise ValueError("the engine's /tokenize answered an unexpected shape")
        for ids in tokens:
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ValueError("the engine's /tokenize answered malformed token ids")
        with self._lock:
            for text, ids in zip(texts, tokens, strict=True):
                self._cache[text] = tuple(ids)
                self._cache.move_to_end(text)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)

    def _ends(self, texts: list[str], prompt_ids: Sequence[int]) -> list[int] | None:
        with self._lock:
            ids = [self._cache.get(text) for text in texts]
        if any(block is None for block in ids):
            return None  # forgotten meanwhile (a tiny cache): conservative
        return block_token_ends(prompt_ids, [block for block in ids if block is not None])


def _block_texts(prepared: PreparedRequest) -> list[str]:
    return [render_block(block, prepared.templates, prepared.labels) for block in prepared.blocks]
