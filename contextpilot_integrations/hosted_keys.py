"""OpenAI's ``prompt_cache_key`` for a request whose documents follow a conversation.

:func:`~.providers.prompt_cache_key` derives the key from the leading blocks of the send
order: right where the documents open the prompt (one-shot RAG). In an agent or a chat
with history, the documents come after the conversation's first turns, and the prompt's
first tokens (what OpenAI routes by) are the conversation's own start, the same in every
later turn; a key from this turn's documents would send each turn to another machine.
:func:`leading_text_key` keys such a request by that leading text instead, and
:class:`ConversationKeys` keeps a conversation on the key its first request went under.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from .blocks import CHARS_PER_TOKEN
from .providers.cache_key import KEY_BUCKETS, ROUTING_TOKENS

__all__ = ["ConversationKeys", "leading_text_key"]


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
