"""OpenAI's ``prompt_cache_key``, derived from the leading blocks of the send order.

OpenAI routes a request to a cache machine by a hash of about its first 256 tokens,
combined with ``prompt_cache_key`` when given
(https://developers.openai.com/api/docs/guides/prompt-caching). Requests that share a
prefix must therefore share the key, or they may land on machines that never saw it. The
key here is a hash of the ids of the blocks that *start* within those first tokens (the
first block always): requests that share their leading blocks share the key, whatever
follows. Hashed into a fixed number of buckets, so the key's cardinality is bounded
(OpenAI spreads a key sent by more than about 15 requests a minute across machines, so
one key for everything would not help either).

In an agent or a chat with history, the documents come after the conversation's first
turns, and the prompt's first tokens (what OpenAI routes by) are the conversation's own
start, the same in every later turn; a key from this turn's documents would send each turn
to another machine. :func:`leading_text_key` keys such a request by that leading text
instead, and :class:`ConversationKeys` keeps a conversation on the key its first request
went under.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from ..core.blocks import CHARS_PER_TOKEN, Block

__all__ = [
    "KEY_BUCKETS",
    "ROUTING_TOKENS",
    "ConversationKeys",
    "leading_block_ids",
    "leading_text_key",
    "prompt_cache_key",
]

ROUTING_TOKENS = 256
"""Tokens OpenAI hashes to route a request (the guide: "typically the first 256")."""
KEY_BUCKETS = 4096
"""Distinct keys at most: the key is ``cp-`` and a bucket number below this."""


def leading_block_ids(blocks: Sequence[Block], prefix_tokens: int = 0, window: int = ROUTING_TOKENS) -> list[str]:
    """Ids of the blocks that start within the first ``window`` tokens of the prompt
    (``prefix_tokens`` come before the blocks); the first block always."""
    ids: list[str] = []
    start = prefix_tokens
    for block in blocks:
        if ids and start >= window:
            break
        ids.append(block.id)
        start += block.token_count
    return ids


def prompt_cache_key(
    blocks: Sequence[Block],
    prefix_tokens: int = 0,
    *,
    window: int = ROUTING_TOKENS,
    buckets: int = KEY_BUCKETS,
    namespace: str = "",
) -> str | None:
    """The key for a request whose send order starts with ``blocks``; ``None`` without blocks.

    Args:
        prefix_tokens: tokens before the blocks (tools, system prompt, history).
        window: leading tokens that decide the key.
        buckets: how many distinct keys there can be.
        namespace: mixed into the hash (e.g. an application name), so two applications
            sharing an organization do not share routing.
    """
    if buckets < 1:
        raise ValueError(f"buckets must be at least 1, got {buckets}")
    ids = leading_block_ids(blocks, prefix_tokens, window)
    if not ids:
        return None
    digest = hashlib.sha256("\x1f".join([namespace, *ids]).encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") % buckets
    return f"cp-{bucket:x}"


def leading_text_key(texts: Sequence[str], *, window: int = ROUTING_TOKENS, buckets: int = KEY_BUCKETS) -> str:
    """The key of a prompt whose messages' texts (in order) are ``texts``: a bucket of the
    hash of its first ``window`` tokens (four characters each)."""
    if buckets < 1:
        raise ValueError(f"buckets must be at least 1, got {buckets}")
    leading = "\x1e".join(texts)[: window * CHARS_PER_TOKEN]
    digest = hashlib.sha256(leading.encode("utf-8")).digest()
    return f"cp-t{int.from_bytes(digest[:8], 'big') % buckets:x}"


class ConversationKeys:
    """The key each conversation was first sent under, kept for all its later requests.

    Every turn of a conversation (and every model call of an agent's turn) resends the
    turns before it: the first request's prefix is where all later ones read from, so they
    go under its key, even where their own first tokens (or documents) would give another.
    Bounded: the least recently used conversations go first. Thread-safe.
    """

    def __init__(self, max_conversations: int = 10_000) -> None:
        if max_conversations < 1:
            raise ValueError(f"max_conversations must be at least 1, got {max_conversations}")
        self.max_conversations = max_conversations
        self._keys: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    def key_for(self, conversation_id: str, first: Callable[[], str | None]) -> str | None:
        """The conversation's key; for its first request, ``first()`` (kept when not ``None``)."""
        with self._lock:
            key = self._keys.get(conversation_id)
            if key is not None:
                self._keys.move_to_end(conversation_id)
                return key
        key = first()  # outside the lock: it hashes the prompt's leading text
        if key is None:
            return None
        with self._lock:
            key = self._keys.setdefault(conversation_id, key)  # a concurrent first request wins once
            self._keys.move_to_end(conversation_id)
            while len(self._keys) > self.max_conversations:
                self._keys.popitem(last=False)
        return key
