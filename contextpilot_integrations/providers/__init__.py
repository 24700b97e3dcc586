"""Hosted APIs' prompt caches (OpenAI, Anthropic, Bedrock, Gemini), provider-neutral.

- :func:`plan_cache`: where a prepared request's cache markers go (Anthropic
  ``cache_control``, Bedrock ``cachePoint``) or its OpenAI ``prompt_cache_key``;
- :func:`read_provider_usage`: cache reads and writes from any provider's usage report;
- :class:`PriceTable`, :func:`cost_of`: what those tokens cost (overridable prices);
- :func:`cache_rules`: each provider's rules per model (minimum length, markers, look-back).

The framework classes that render the markers live in the adapter packages.
"""

from .cache_key import prompt_cache_key
from .names import PROVIDERS, ProviderName
from .plan import CachePlan, plan_cache
from .prices import DEFAULT_PRICES, PRICES_AS_OF, ModelPrice, PriceTable, cost_of
from .rules import DEFAULT_MODELS, CacheRules, cache_rules
from .usage import ProviderTotals, ProviderUsage, read_provider_usage

__all__ = [
    "DEFAULT_MODELS",
    "DEFAULT_PRICES",
    "PRICES_AS_OF",
    "PROVIDERS",
    "CachePlan",
    "CacheRules",
    "ModelPrice",
    "PriceTable",
    "ProviderName",
    "ProviderTotals",
    "ProviderUsage",
    "cache_rules",
    "cost_of",
    "plan_cache",
    "prompt_cache_key",
    "read_provider_usage",
]
