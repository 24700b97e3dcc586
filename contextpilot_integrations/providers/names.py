"""The hosted providers whose prompt caches ContextPilot plans for."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["PROVIDERS", "ProviderName", "check_provider"]

ProviderName = Literal["openai", "anthropic", "bedrock", "gemini"]
PROVIDERS: tuple[ProviderName, ...] = get_args(ProviderName)


def check_provider(provider: object) -> ProviderName:
    """``provider`` as a :data:`ProviderName`, or ``ValueError`` naming the choices."""
    if provider not in PROVIDERS:
        raise ValueError(f"provider must be one of {', '.join(PROVIDERS)}, got {provider!r}")
    return provider
