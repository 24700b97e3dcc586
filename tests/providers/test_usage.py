"""Usage readers on the providers' own SDK types (and the dicts their wire formats carry)."""

from __future__ import annotations

import pytest
from anthropic.types import CacheCreation, Usage
from google.genai.types import GenerateContentResponse, GenerateContentResponseUsageMetadata
from hypothesis import given, settings
from hypothesis import strategies as st
from langchain_core.messages import AIMessage
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from openai.types import CompletionUsage
from openai.types.completion_usage import PromptTokensDetails
from openai.types.responses import ResponseUsage
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.providers import ProviderUsage, read_provider_usage


def test_openai_chat_completions_usage() -> None:
    usage = CompletionUsage(
        prompt_tokens=3000,
        completion_tokens=10,
        total_tokens=3010,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=2048, cache_write_tokens=512),
    )
    assert read_provider_usage(usage) == ProviderUsage(3000, 2048, 512, "openai")
    assert read_provider_usage(usage.model_dump()) == ProviderUsage(3000, 2048, 512, "openai")
    bare = CompletionUsage(prompt_tokens=40, completion_tokens=1, total_tokens=41)
    assert read_provider_usage(bare) == ProviderUsage(40, 0, 0, "openai")


def test_openai_responses_usage() -> None:
    usage = ResponseUsage(
        input_tokens=2500,
        input_tokens_details=InputTokensDetails(cached_tokens=1152, cache_write_tokens=0),
        output_tokens=5,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
        total_tokens=2505,
    )
    assert read_provider_usage(usage) == ProviderUsage(2500, 1152, 0, "openai")


def test_anthropic_usage_adds_reads_and_writes_to_the_input_tokens() -> None:
    usage = Usage(input_tokens=20, output_tokens=7, cache_read_input_tokens=4000, cache_creation_input_tokens=1500)
    assert read_provider_usage(usage) == ProviderUsage(5520, 4000, 1500, "anthropic")
    split = Usage(
        input_tokens=20,
        output_tokens=7,
        cache_creation_input_tokens=1500,
        cache_creation=CacheCreation(ephemeral_5m_input_tokens=500, ephemeral_1h_input_tokens=1000),
    )
    assert read_provider_usage(split) == ProviderUsage(1520, 0, 1500, "anthropic")


def test_bedrock_converse_usage() -> None:
    response = {
        "output": {"message": {"role": "assistant", "content": [{"text": "ok"}]}},
        "usage": {"inputTokens": 30, "outputTokens": 2, "totalTokens": 3532, "cacheReadInputTokens": 3000,
                  "cacheWriteInputTokens": 500},
    }  # fmt: skip
    assert read_provider_usage(response) == ProviderUsage(3530, 3000, 500, "bedrock")


def test_gemini_usage_metadata() -> None:
    metadata = GenerateContentResponseUsageMetadata(prompt_token_count=5000, cached_content_token_count=4096)
    assert read_provider_usage(metadata) == ProviderUsage(5000, 4096, 0, "gemini")
    response = GenerateContentResponse(usage_metadata=metadata)
    assert read_provider_usage(response) == ProviderUsage(5000, 4096, 0, "gemini")
    rest = {"candidates": [], "usageMetadata": {"promptTokenCount": 5000, "cachedContentTokenCount": 1024}}
    assert read_provider_usage(rest) == ProviderUsage(5000, 1024, 0, "gemini")


def test_langchain_usage_metadata_and_messages() -> None:
    metadata = UsageMetadata(
        input_tokens=5520,
        output_tokens=7,
        total_tokens=5527,
        input_token_details=InputTokenDetails(cache_read=4000, cache_creation=1500),
    )
    assert read_provider_usage(metadata) == ProviderUsage(5520, 4000, 1500, None)
    split = {"cache_read": 0, "cache_creation": 0, "ephemeral_5m_input_tokens": 500, "ephemeral_1h_input_tokens": 1000}
    by_ttl = {**metadata, "input_token_details": split}
    assert read_provider_usage(by_ttl) == ProviderUsage(5520, 0, 1500, None)
    assert read_provider_usage(AIMessage("hi", usage_metadata=metadata)) == ProviderUsage(5520, 4000, 1500, None)
    assert read_provider_usage(AIMessage("hi")) is None


def test_nothing_to_read() -> None:
    assert read_provider_usage(None) is None
    assert read_provider_usage({"foo": 1}) is None
    assert read_provider_usage("usage") is None


def test_broken_reports_raise() -> None:
    with pytest.raises(ValueError, match="exceed"):
        read_provider_usage({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 20}})
    with pytest.raises(TypeError, match="int"):
        read_provider_usage({"inputTokens": "12"})
    with pytest.raises(ValueError, match="provider"):
        ProviderUsage(1, 0, 0, "azure")  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6))
def test_all_formats_agree_on_the_same_tokens(uncached: int, reads: int, writes: int) -> None:
    total = uncached + reads + writes
    reports = [
        Usage(input_tokens=uncached, output_tokens=1, cache_read_input_tokens=reads,
              cache_creation_input_tokens=writes),
        {"inputTokens": uncached, "outputTokens": 1, "cacheReadInputTokens": reads, "cacheWriteInputTokens": writes},
        CompletionUsage(prompt_tokens=total, completion_tokens=1, total_tokens=total + 1,
                        prompt_tokens_details=PromptTokensDetails(cached_tokens=reads, cache_write_tokens=writes)),
        UsageMetadata(input_tokens=total, output_tokens=1, total_tokens=total + 1,
                      input_token_details=InputTokenDetails(cache_read=reads, cache_creation=writes)),
    ]  # fmt: skip
    for report in reports:
        usage = read_provider_usage(report)
        assert usage is not None
        assert (usage.prompt_tokens, usage.cache_read_tokens, usage.cache_write_tokens) == (total, reads, writes)
        assert usage.uncached_tokens == uncached


def test_usage_lands_in_the_pilot_stats_by_provider() -> None:
    pilot = ContextPilot()
    prepared = pilot.prepare(["some document text"], "q")
    pilot.record_provider_usage(prepared, ProviderUsage(5520, 4000, 1500, "anthropic"))
    pilot.record_provider_usage(prepared, ProviderUsage(3000, 2048, 0, "openai"))
    pilot.record_provider_usage(prepared, ProviderUsage(100, 0, 0, None))
    stats = pilot.stats()
    assert (stats.engine_prompt_tokens, stats.engine_cached_tokens) == (8620, 6048)
    assert stats.engine_cache_write_tokens == 1500
    assert stats.provider_usage["anthropic"].cache_write_tokens == 1500
    assert stats.provider_usage["openai"].cache_read_tokens == 2048
    assert stats.provider_usage["unknown"].requests == 1
    with pytest.raises(TypeError):
        pilot.record_provider_usage(prepared, {"prompt_tokens": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        pilot.record_usage(prepared, 10, 5, cache_write_tokens=-1)
    assert pilot.stats() == stats  # a call that raises changes nothing
