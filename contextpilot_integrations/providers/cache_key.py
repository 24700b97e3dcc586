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
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from ..blocks import Block

__all__ = ["KEY_BUCKETS", "ROUTING_TOKENS", "leading_block_ids", "prompt_cache_key"]

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
