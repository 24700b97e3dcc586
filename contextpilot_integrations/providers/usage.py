"""Cache reads and writes from any provider's usage report: :func:`read_provider_usage`.

Each provider counts differently (read from their SDK types):

- OpenAI Chat Completions ``usage``: ``prompt_tokens`` includes
  ``prompt_tokens_details.cached_tokens`` (and ``cache_write_tokens`` where the model
  reports writes); the Responses API says ``input_tokens`` / ``input_tokens_details``
  (``openai.types.CompletionUsage``, ``openai.types.responses.ResponseUsage``).
- Anthropic ``usage``: ``input_tokens`` are only the tokens after the last breakpoint;
  ``cache_read_input_tokens`` and ``cache_creation_input_tokens`` come on top
  (``anthropic.types.Usage``; total = the three together).
- Bedrock Converse ``usage``: ``inputTokens`` likewise excludes ``cacheReadInputTokens``
  and ``cacheWriteInputTokens`` (langchain-aws adds the three for its total).
- Gemini ``usageMetadata``: ``promptTokenCount`` includes ``cachedContentTokenCount``
  (``google.genai.types.GenerateContentResponseUsageMetadata``, snake case there).
- LangChain ``UsageMetadata`` (``AIMessage.usage_metadata``): ``input_tokens`` is the
  total; ``input_token_details`` has ``cache_read`` and ``cache_creation`` (or, split by
  TTL, ``ephemeral_5m_input_tokens`` / ``ephemeral_1h_input_tokens``).

:class:`ProviderUsage` puts them on one footing: ``prompt_tokens`` is every prompt token,
read and written ones included.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.usage import check_token_count
from .names import ProviderName, check_provider

__all__ = ["ProviderTotals", "ProviderUsage", "read_provider_usage"]


@dataclass(frozen=True)
class ProviderUsage:
    """One response's prompt tokens, as the provider billed them."""

    prompt_tokens: int
    """Every prompt token: uncached, read from the cache and written to it."""
    cache_read_tokens: int
    cache_write_tokens: int
    provider: ProviderName | None
    """``None`` when the report does not say (LangChain's normalized usage)."""

    def __post_init__(self) -> None:
        check_token_count("prompt_tokens", self.prompt_tokens)
        check_token_count("cache_read_tokens", self.cache_read_tokens)
        check_token_count("cache_write_tokens", self.cache_write_tokens)
        if self.cache_read_tokens + self.cache_write_tokens > self.prompt_tokens:
            raise ValueError(
                f"cache reads ({self.cache_read_tokens:,}) and writes ({self.cache_write_tokens:,}) "
                f"exceed the prompt tokens ({self.prompt_tokens:,})"
            )
        if self.provider is not None:
            check_provider(self.provider)

    @property
    def uncached_tokens(self) -> int:
        """Prompt tokens billed at the plain input price."""
        return self.prompt_tokens - self.cache_read_tokens - self.cache_write_tokens


@dataclass(frozen=True)
class ProviderTotals:
    """Usage summed over the responses of one provider (see ``PilotStats.provider_usage``)."""

    requests: int = 0
    prompt_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0

    def add(self, usage: ProviderUsage) -> ProviderTotals:
        return ProviderTotals(
            self.requests + 1,
            self.prompt_tokens + usage.prompt_tokens,
            self.cache_read_tokens + usage.cache_read_tokens,
            self.cache_write_tokens + usage.cache_write_tokens,
        )


def read_provider_usage(raw: object) -> ProviderUsage | None:
    """The usage in ``raw``: a usage object or dict of any provider above, a whole response
    (OpenAI/Anthropic ``.usage``, Bedrock ``["usage"]``, Gemini ``usage_metadata``), or a
    LangChain message (``.usage_metadata``). ``None`` when ``raw`` holds no usage.

    Raises:
        TypeError, ValueError: the report is recognized but a count is not a valid token
            count, or the cached tokens exceed the prompt tokens.
    """
    data = _as_mapping(raw)
    if data is None:
        return None
    for key in ("usage", "usage_metadata", "usageMetadata"):
        inner = data.get(key)
        if inner is not None:
            nested = _as_mapping(inner)
            if nested is not None:
                return read_provider_usage(nested)
    if "prompt_tokens" in data:  # OpenAI Chat Completions
        details = _as_mapping(data.get("prompt_tokens_details")) or {}
        return _usage(data["prompt_tokens"], details.get("cached_tokens"), details.get("cache_write_tokens"), "openai")
    if "input_tokens_details" in data:  # OpenAI Responses
        details = _as_mapping(data.get("input_tokens_details")) or {}
        reads, writes = details.get("cached_tokens"), details.get("cache_write_tokens")
        return _usage(data.get("input_tokens"), reads, writes, "openai")
    if "input_token_details" in data or ("input_tokens" in data and "total_tokens" in data):  # LangChain
        details = _as_mapping(data.get("input_token_details")) or {}
        writes = sum(
            _count(details.get(key), key)
            for key in ("cache_creation", "ephemeral_5m_input_tokens", "ephemeral_1h_input_tokens")
        )
        return _usage(data.get("input_tokens"), details.get("cache_read"), writes, None)
    if "input_tokens" in data:  # Anthropic: input tokens exclude reads and writes
        reads = _count(data.get("cache_read_input_tokens"), "cache_read_input_tokens")
        writes = _count(data.get("cache_creation_input_tokens"), "cache_creation_input_tokens")
        return _usage(_count(data["input_tokens"], "input_tokens") + reads + writes, reads, writes, "anthropic")
    if "inputTokens" in data:  # Bedrock Converse: likewise
        reads = _count(data.get("cacheReadInputTokens"), "cacheReadInputTokens")
        writes = _count(data.get("cacheWriteInputTokens"), "cacheWriteInputTokens")
        return _usage(_count(data["inputTokens"], "inputTokens") + reads + writes, reads, writes, "bedrock")
    for prompt, cached in (
        ("promptTokenCount", "cachedContentTokenCount"),
        ("prompt_token_count", "cached_content_token_count"),
    ):
        if prompt in data:  # Gemini
            return _usage(data[prompt], data.get(cached), 0, "gemini")
    return None


def _as_mapping(value: object) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        return value
    dump = getattr(value, "model_dump", None)
    if callable(dump):  # pydantic SDK objects (openai, anthropic, google-genai, LangChain)
        dumped = dump()
        return dumped if isinstance(dumped, Mapping) else None
    return None


def _count(value: object, name: str) -> int:
    return 0 if value is None else check_token_count(name, value)


def _usage(prompt: object, reads: object, writes: object, provider: ProviderName | None) -> ProviderUsage:
    counts = _count(prompt, "prompt_tokens"), _count(reads, "cache_read_tokens"), _count(writes, "cache_write_tokens")
    return ProviderUsage(*counts, provider)
