"""Each provider's prompt-cache rules, per model: what a plan and a simulation must obey.

Facts as published by the providers (read 2026-11-25; override with your own
:class:`CacheRules` where your account or a newer model differs):

- **Anthropic** (https://platform.claude.com/docs/en/build-with-claude/prompt-caching):
  ``cache_control`` breakpoints, at most 4 per request, prefixes built in the order
  tools -> system -> messages; a cache entry is written at a breakpoint and a later
  request finds it by checking block boundaries from each of its breakpoints back at most
  20 content blocks; below a model's minimum cacheable length (512 to 4,096 tokens) the
  request succeeds and nothing is cached; TTL 5 minutes (default) or 1 hour, refreshed on
  every hit; writes cost 1.25x (5 min) or 2x (1 h) the input price, reads 0.1x.
- **Bedrock Converse** (https://docs.aws.amazon.com/bedrock/latest/userguide/prompt-caching.html):
  ``{"cachePoint": {"type": "default"}}`` blocks in ``system``/``messages``/``tools``, at
  most 4 checkpoints; a checkpoint below the model's minimum is ignored (inference still
  succeeds); Claude models look back about 20 blocks from a checkpoint, Nova models only
  match explicit checkpoints; TTL 5 minutes, reset by every hit.
- **OpenAI** (https://developers.openai.com/api/docs/guides/prompt-caching): automatic for
  prompts of 1,024 tokens or more; requests routed by a hash of about the first 256
  tokens, combined with ``prompt_cache_key``; hits are exact prefixes, reported in
  increments of 128 tokens (``cached_tokens``); in-memory caches are cleared after 5 to 10
  minutes of inactivity (at most one hour), ``prompt_cache_retention="24h"`` keeps them up
  to a day. From the GPT-5.6 family on, cache writes cost 1.25x the input price and are
  reported as ``cache_write_tokens``; a content part may carry an explicit
  ``prompt_cache_breakpoint``, matched exactly (no fall-back to a shorter prefix), and
  implicit caching places one managed breakpoint near the latest message, without 128-token
  rounding; a request takes up to four cache writes, one of them the managed breakpoint.
  The TTL of those models is not stated in that guide; 30 minutes is assumed (the
  shortest breakpoint TTL Azure OpenAI lists for them).
- **Gemini** (https://ai.google.dev/gemini-api/docs/caching): implicit caching on Gemini
  2.5 and newer, nothing to mark (put shared content first); minimum 2,048 tokens for
  Gemini 2.5, 4,096 for Gemini 3.x; hits reported as ``cachedContentTokenCount``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .names import ProviderName, check_provider

__all__ = ["DEFAULT_MODELS", "CacheRules", "cache_rules", "normalize_model"]


@dataclass(frozen=True, slots=True)
class CacheRules:
    """How one provider's model caches prompt prefixes."""

    provider: ProviderName
    model: str
    """The model these rules were looked up for (or the provider default's name)."""
    min_tokens: int
    """Shortest prefix the provider caches; shorter ones are silently not cached."""
    explicit: bool
    """Caching needs markers (Anthropic, Bedrock); otherwise it is automatic."""
    max_breakpoints: int = 0
    """Markers allowed per request (explicit caching only)."""
    lookback_blocks: int = 0
    """Content blocks a marker looks back for an earlier entry (0: exact marker only)."""
    granularity: int = 1
    """Cached tokens come in multiples of this beyond the minimum (OpenAI: 128)."""
    ttl_seconds: float = 300.0
    """How long an unused entry lives (refreshed by every hit)."""
    known: bool = True
    """Whether the model was in the table (else the provider's default rules)."""
    implicit_breakpoint: bool = False
    """The provider also places its own marker near the latest message (OpenAI GPT-5.6+);
    it counts toward ``max_breakpoints`` + 1 writes."""


# (model key, minimum tokens); a key matches a model name that contains it, longest key first.
_ANTHROPIC_MINIMUMS: dict[str, int] = {
    "claude-opus-5": 512,
    "claude-fable-5": 512,
    "claude-mythos-5": 512,
    "claude-opus-4-8": 1024,
    "claude-sonnet-5": 1024,
    "claude-sonnet-4-6": 1024,
    "claude-sonnet-4-5": 1024,
    "claude-opus-4-1": 1024,
    "claude-opus-4": 1024,
    "claude-sonnet-4": 1024,
    "claude-3-7-sonnet": 1024,
    "claude-opus-4-7": 2048,
    "claude-3-5-haiku": 2048,
    "claude-3-haiku": 2048,
    "claude-opus-4-6": 4096,
    "claude-opus-4-5": 4096,
    "claude-haiku-4-5": 4096,
}
_BEDROCK_MINIMUMS: dict[str, int] = {
    **_ANTHROPIC_MINIMUMS,
    "claude-opus-4-7": 4096,  # Bedrock lists Opus 4.7 with the 4,096-token models
    "nova-micro": 1000,
    "nova-lite": 1000,
    "nova-pro": 1000,
    "nova-premier": 1000,
}
_GEMINI_MINIMUMS: dict[str, int] = {
    "gemini-2-5-flash": 2048,
    "gemini-2-5-pro": 2048,
    "gemini-3": 4096,
    "gemini-4": 4096,
}
_OPENAI_EXPLICIT: dict[str, int] = {"gpt-5-6": 1, "gpt-5-7": 1, "gpt-5-8": 1, "gpt-6": 1}
"""OpenAI families with explicit breakpoints and billed writes (GPT-5.6 and later)."""
DEFAULT_MODELS: dict[ProviderName, str] = {
    "openai": "gpt-5",
    "anthropic": "claude-sonnet-4-5",
    "bedrock": "anthropic.claude-sonnet-4-5",
    "gemini": "gemini-2.5-flash",
}
"""The model assumed when none is given (a common mid-priced one per provider)."""


def normalize_model(model: str) -> str:
    """Lower case, dots as dashes: ``claude-sonnet-4.5`` and ``claude-sonnet-4-5`` match."""
    return model.strip().lower().replace(".", "-").replace("_", "-")


def _lookup(table: dict[str, int], model: str) -> int | None:
    name = normalize_model(model)
    for key in sorted(table, key=len, reverse=True):
        if key in name:
            return table[key]
    return None


def cache_rules(provider: ProviderName, model: str | None = None) -> CacheRules:
    """The cache rules of ``provider``'s ``model`` (its default model when ``None``).

    A model missing from the table gets the provider's most common rules (``known`` is
    then ``False``): 1,024 tokens for Anthropic and Bedrock (a marker placed too early is
    harmless, one left out loses a hit), 1,024 for OpenAI, 2,048 for Gemini.
    """
    provider = check_provider(provider)
    name = model or DEFAULT_MODELS[provider]
    if provider == "openai":
        if _lookup(_OPENAI_EXPLICIT, name):
            return CacheRules(
                provider, name, 1024, explicit=True, max_breakpoints=3, ttl_seconds=1800.0, implicit_breakpoint=True
            )
        return CacheRules(provider, name, 1024, explicit=False, granularity=128, ttl_seconds=300.0)
    if provider == "gemini":
        minimum = _lookup(_GEMINI_MINIMUMS, name)
        return CacheRules(provider, name, minimum or 2048, explicit=False, known=minimum is not None)
    table = _ANTHROPIC_MINIMUMS if provider == "anthropic" else _BEDROCK_MINIMUMS
    minimum = _lookup(table, name)
    lookback = 0 if provider == "bedrock" and "nova" in normalize_model(name) else 20
    return CacheRules(
        provider,
        name,
        minimum or 1024,
        explicit=True,
        max_breakpoints=4,
        lookback_blocks=lookback,
        known=minimum is not None,
    )
