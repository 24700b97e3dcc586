"""OpenAI's ``prompt_cache_key`` for a request whose documents follow a conversation.

:func:`~.providers.prompt_cache_key` derives the key from the leading blocks of the send
order: right where the documents open the prompt (one-shot RAG). In an agent or a chat
with history, the documents come after the conversation's first turns, and the prompt's
first tokens (what OpenAI routes by) are the conversation's own start, the same in every
later turn; a key from this turn's documents would send each turn to another machine.
:func:`leading_text_key` keys such a request by that leading text instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from .blocks import CHARS_PER_TOKEN
from .providers.cache_key import KEY_BUCKETS, ROUTING_TOKENS

__all__ = ["leading_text_key"]


def leading_text_key(texts: Sequence[str], *, window: int = ROUTING_TOKENS, buckets: int = KEY_BUCKETS) -> str:
    """The key of a prompt whose messages' texts (in order) are ``texts``: a bucket of the
    hash of its first ``window`` tokens (four characters each)."""
    if buckets < 1:
        raise ValueError(f"buckets must be at least 1, got {buckets}")
    leading = "\x1e".join(texts)[: window * CHARS_PER_TOKEN]
    digest = hashlib.sha256(leading.encode("utf-8")).digest()
    return f"cp-t{int.from_bytes(digest[:8], 'big') % buckets:x}"
