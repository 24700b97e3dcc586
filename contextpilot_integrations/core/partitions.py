"""Cache partitions: requests an engine never lets share KV, named the way it tells them apart.

An engine keeps separate caches for requests that must not share a prefix, whatever their
text: vLLM hashes a request's ``cache_salt`` into its first block and its LoRA adapter into
every block; SGLang keys its radix tree by ``extra_key`` (the LoRA adapter appended) and
``cache_salt``. Two tenants that retrieve the same documents then share nothing at the
engine, so the index must not predict it: every request carries its partition
(:attr:`~.prepared.PreparedRequest.partition`), and index keys of different partitions never
match (:func:`~.gain.in_partition`).

A partition is named by :func:`cache_partition` from the same fields the engine reads, so a
retrieval step told the partition and a model call that reads it from its own request body
(:func:`partition_of_body`) name it alike. A salt is a tenant's secret: only a digest of it
is ever kept, counted or shared.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from typing import Any

from .validation import check_partition

__all__ = ["cache_partition", "partition_of_body"]


def cache_partition(*, salt: str | None = None, extra_key: str | None = None, adapter: str | None = None) -> str | None:
    """The partition of requests sent with these engine fields; ``None`` (the engine's
    default partition) when none is set.

    Args:
        salt: the request's ``cache_salt`` (vLLM, SGLang): kept only as a digest.
        extra_key: SGLang's ``extra_key``.
        adapter: the LoRA adapter serving it (SGLang's ``lora_path``; on vLLM the adapter's
            name, sent as ``model``).

    Raises:
        TypeError, ValueError: a field that is not a str, or a name too long for a partition.
    """
    parts = []
    for name, value in (("adapter", adapter), ("key", extra_key), ("salt", salt)):
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str or None, got {type(value).__name__}")
        if name == "salt":
            value = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        parts.append(f"{name}={value}")
    if not parts:
        return None
    partition = ";".join(parts)
    check_partition(partition)  # printable, and at most MAX_PARTITION_CHARS
    return partition


def partition_of_body(body: Mapping[str, Any], adapters: Collection[str] = ()) -> str | None:
    """The partition an OpenAI-compatible request body is served in: its ``cache_salt``, its
    ``extra_key`` and its LoRA adapter (``lora_path``, or a ``model`` that is one of the
    engine's ``adapters``). ``None``
    when the body names none. Fields of the wrong type are left to the engine to refuse."""

    def text(key: str) -> str | None:
        value = body.get(key)
        return value if isinstance(value, str) and value else None

    adapter = text("lora_path")
    model = text("model")
    if adapter is None and model is not None and model in adapters:
        adapter = model
    return cache_partition(salt=text("cache_salt"), extra_key=text("extra_key"), adapter=adapter)
