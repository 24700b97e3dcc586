"""Prices and costs: writes and reads at their own prices, tables the user can override."""

from __future__ import annotations

import pytest

from contextpilot_integrations.providers import DEFAULT_PRICES, ModelPrice, PriceTable, ProviderUsage, cost_of


def test_anthropic_cost_counts_writes_and_reads_at_their_prices() -> None:
    usage = ProviderUsage(prompt_tokens=1_000_000 + 2_000_000 + 4_000_000, cache_read_tokens=2_000_000,
                          cache_write_tokens=4_000_000, provider="anthropic")  # fmt: skip
    # Sonnet 4.5: $3 input, $3.75 5-minute writes, $6 1-hour writes, $0.30 reads
    assert cost_of(usage, "claude-sonnet-4-5") == pytest.approx(3.0 + 0.60 + 15.0)
    assert cost_of(usage, "claude-sonnet-4-5", ttl="1h") == pytest.approx(3.0 + 0.60 + 24.0)


def test_model_names_match_their_table_entries() -> None:
    assert DEFAULT_PRICES.price("bedrock", "us.anthropic.claude-haiku-4-5-20251001-v1:0").input == 1.0
    assert DEFAULT_PRICES.price("anthropic", "claude-opus-4-1-20250805").input == 15.0
    assert DEFAULT_PRICES.price("anthropic", "claude-opus-4-5").input == 5.0
    assert DEFAULT_PRICES.price("openai", "gpt-5-mini-2025-08-07").input == 0.25
    assert DEFAULT_PRICES.price("gemini", "models/gemini-2.5-flash").cache_read == 0.03
    with pytest.raises(KeyError, match="with_prices"):
        DEFAULT_PRICES.price("openai", "davinci")


def test_user_prices_override_the_defaults() -> None:
    mine = DEFAULT_PRICES.with_prices(
        {"openai": {"gpt-5": ModelPrice(1.0, 0.1, 1.25), "my-model": ModelPrice(2, 0, 2)}}
    )
    usage = ProviderUsage(2_000_000, 1_000_000, 1_000_000, "openai")
    assert cost_of(usage, "gpt-5", prices=mine) == pytest.approx(0.1 + 1.25)
    assert cost_of(usage, "my-model", prices=mine) == pytest.approx(2.0)  # no uncached tokens, free reads
    assert cost_of(usage, "gpt-5") == pytest.approx(0.125 + 1.25)  # the defaults are untouched
    only = PriceTable({"gemini": {"gemini-x": ModelPrice(1, 0.5, 1)}})
    assert cost_of(ProviderUsage(10**6, 10**6, 0, None), "gemini-x", provider="gemini", prices=only) == 0.5


def test_bad_prices_and_costs_raise() -> None:
    with pytest.raises(ValueError, match="input"):
        ModelPrice(-1.0, 0.0, 0.0)
    with pytest.raises(TypeError, match="ModelPrice"):
        PriceTable({"openai": {"gpt-5": 1.0}})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="provider"):
        cost_of(ProviderUsage(10, 0, 0, None))
    with pytest.raises(ValueError, match="1-hour"):
        cost_of(ProviderUsage(10, 0, 5, "openai"), "gpt-5", ttl="1h")
