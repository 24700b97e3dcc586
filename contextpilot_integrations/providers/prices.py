"""What prompt tokens cost, per provider and model: :class:`PriceTable` and :func:`cost_of`.

Default prices in USD per million tokens, from the providers' pricing pages as read on
2026-11-25. Prices change: pass your own (``PriceTable({...})`` or
``DEFAULT_PRICES.with_prices({...})``) for your models, region or contract.

- Anthropic (https://platform.claude.com/docs/en/about-claude/pricing): 5-minute cache
  writes 1.25x the input price, 1-hour writes 2x, hits 0.1x.
- Bedrock (https://aws.amazon.com/bedrock/pricing/): Claude at Anthropic's list prices
  (global endpoints); Nova reads at 0.25x with no write surcharge.
- OpenAI (https://developers.openai.com/api/docs/pricing): cached input 0.1x on the GPT-5
  family, 0.25x on GPT-4.1; before GPT-5.6 writes cost the input price (no fee), from
  GPT-5.6 on 1.25x (the prompt-caching guide). The GPT-5.6 rows are as third-party price
  trackers quote OpenAI's page (Sol $5 before its promotion, Terra $2 and Luna $0.20 after
  the 2026-07-30 cut): check them against your invoice.
- Gemini (https://ai.google.dev/gemini-api/docs/pricing): implicit cache hits 0.1x of
  the input price (prompts up to 200k tokens), no write charge.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from .names import ProviderName, check_provider
from .rules import DEFAULT_MODELS, normalize_model
from .usage import ProviderUsage

__all__ = ["DEFAULT_PRICES", "PRICES_AS_OF", "ModelPrice", "PriceTable", "Ttl", "cost_of"]

PRICES_AS_OF = "2026-11-25"
Ttl = Literal["5m", "1h"]


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """USD per million prompt tokens."""

    input: float
    """An uncached prompt token."""
    cache_read: float
    """A token read from the cache."""
    cache_write: float
    """A token written to the cache with the default TTL (5 minutes)."""
    cache_write_1h: float | None = None
    """A token written with the 1-hour TTL (Anthropic, Bedrock Claude); ``None``: n/a."""

    def __post_init__(self) -> None:
        for name in ("input", "cache_read", "cache_write", "cache_write_1h"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0):
                raise ValueError(f"{name} must be a price >= 0, got {value!r}")


def _claude(input_price: float) -> ModelPrice:
    return ModelPrice(input_price, input_price * 0.1, input_price * 1.25, input_price * 2)


_CLAUDE: dict[str, ModelPrice] = {
    "claude-opus-4-1": _claude(15.0),
    "claude-opus-4": _claude(15.0),
    "claude-opus-4-5": _claude(5.0),
    "claude-opus-4-6": _claude(5.0),
    "claude-opus-4-7": _claude(5.0),
    "claude-opus-4-8": _claude(5.0),
    "claude-opus-5": _claude(5.0),
    "claude-sonnet-4": _claude(3.0),
    "claude-sonnet-4-5": _claude(3.0),
    "claude-sonnet-4-6": _claude(3.0),
    "claude-3-7-sonnet": _claude(3.0),
    "claude-haiku-4-5": _claude(1.0),
    "claude-3-5-haiku": _claude(0.8),
}
"""Anthropic's list prices, which Bedrock charges for the Claude models it lists."""
_BEDROCK_CLAUDE = ("claude-opus-4-5", "claude-opus-4-6", "claude-sonnet-4", "claude-sonnet-4-5", "claude-sonnet-4-6",
                   "claude-haiku-4-5")  # fmt: skip

_DEFAULTS: dict[ProviderName, dict[str, ModelPrice]] = {
    "anthropic": _CLAUDE,
    "bedrock": {
        **{model: _CLAUDE[model] for model in _BEDROCK_CLAUDE},
        "nova-pro": ModelPrice(0.80, 0.20, 0.80),
        "nova-lite": ModelPrice(0.06, 0.015, 0.06),
        "nova-micro": ModelPrice(0.035, 0.00875, 0.035),
    },
    "openai": {
        "gpt-5": ModelPrice(1.25, 0.125, 1.25),
        "gpt-5-mini": ModelPrice(0.25, 0.025, 0.25),
        "gpt-5-nano": ModelPrice(0.05, 0.005, 0.05),
        "gpt-5-1": ModelPrice(1.25, 0.125, 1.25),
        "gpt-4-1": ModelPrice(2.0, 0.50, 2.0),
        "gpt-4-1-mini": ModelPrice(0.40, 0.10, 0.40),
        "gpt-4o": ModelPrice(2.50, 1.25, 2.50),
        "gpt-4o-mini": ModelPrice(0.15, 0.075, 0.15),
        "gpt-5-6-sol": ModelPrice(5.0, 0.50, 6.25),
        "gpt-5-6-terra": ModelPrice(2.0, 0.20, 2.50),
        "gpt-5-6-luna": ModelPrice(0.20, 0.02, 0.25),
    },
    "gemini": {
        "gemini-2-5-pro": ModelPrice(1.25, 0.125, 1.25),
        "gemini-2-5-flash": ModelPrice(0.30, 0.03, 0.30),
        "gemini-2-5-flash-lite": ModelPrice(0.10, 0.01, 0.10),
        "gemini-3-pro": ModelPrice(2.0, 0.20, 2.0),
    },
}


class PriceTable:
    """Prices by (provider, model); a model name matches the longest key it contains
    (``us.anthropic.claude-sonnet-4-5-20250929-v1:0`` finds ``claude-sonnet-4-5``).

    Args:
        prices: ``{provider: {model key: ModelPrice}}``; keys are normalized (lower case,
            dots as dashes).
    """

    def __init__(self, prices: Mapping[ProviderName, Mapping[str, ModelPrice]]) -> None:
        table: dict[ProviderName, dict[str, ModelPrice]] = {}
        for provider, models in prices.items():
            check_provider(provider)
            for key, price in models.items():
                if not isinstance(price, ModelPrice):
                    raise TypeError(f"{provider}/{key}: expected a ModelPrice, got {type(price).__name__}")
            table[provider] = {normalize_model(key): price for key, price in models.items()}
        self._table = table

    def with_prices(self, overrides: Mapping[ProviderName, Mapping[str, ModelPrice]]) -> PriceTable:
        """A copy with ``overrides`` added or replacing entries."""
        merged = {provider: dict(models) for provider, models in self._table.items()}
        for provider, models in PriceTable(overrides)._table.items():
            merged.setdefault(provider, {}).update(models)
        return PriceTable(merged)

    def price(self, provider: ProviderName, model: str | None = None) -> ModelPrice:
        """The price of ``model`` (the provider's default model when ``None``).

        Raises:
            KeyError: no entry matches; add one with :meth:`with_prices`.
        """
        provider = check_provider(provider)
        name = normalize_model(model or DEFAULT_MODELS[provider])
        models = self._table.get(provider, {})
        for key in sorted(models, key=len, reverse=True):
            if key in name:
                return models[key]
        raise KeyError(f"no price for {provider} model {model!r}: add it with PriceTable.with_prices")


DEFAULT_PRICES = PriceTable(_DEFAULTS)
"""Prices as of :data:`PRICES_AS_OF` (see the module docstring for the sources)."""


def cost_of(
    usage: ProviderUsage,
    model: str | None = None,
    *,
    provider: ProviderName | None = None,
    prices: PriceTable | None = None,
    ttl: Ttl = "5m",
) -> float:
    """What ``usage``'s prompt tokens cost in USD: uncached tokens at the input price,
    reads at the cache-read price, writes at the write price of ``ttl``.

    Args:
        provider: needed when ``usage.provider`` is ``None`` (LangChain's usage).

    Raises:
        ValueError: no provider known; KeyError: no price for the model.
    """
    name = provider or usage.provider
    if name is None:
        raise ValueError("the usage does not name its provider: pass provider=")
    price = (prices or DEFAULT_PRICES).price(name, model)
    write = price.cache_write
    if ttl == "1h":
        if price.cache_write_1h is None:
            raise ValueError(f"{name} model {model!r} has no 1-hour cache write price")
        write = price.cache_write_1h
    elif ttl != "5m":
        raise ValueError(f"ttl must be '5m' or '1h', got {ttl!r}")
    uncached = usage.uncached_tokens * price.input
    return (uncached + usage.cache_read_tokens * price.cache_read + usage.cache_write_tokens * write) / 1_000_000
