"""The fakes of the hosted APIs (which cannot be reached from here), driven by the providers'
own SDKs over real HTTP: each speaks its wire format and applies its provider's documented
caching rules (prefix, breakpoints, minimum length), so tests built on them mean something."""

from __future__ import annotations

import anthropic
import boto3
import openai
import pytest
from google import genai
from google.genai import types as genai_types

from contextpilot_integrations.testing.fake_bedrock import fake_bedrock
from contextpilot_integrations.testing.fake_gemini import fake_gemini
from contextpilot_integrations.testing.fake_openai import fake_openai
from contextpilot_integrations.testing.fake_providers import fake_anthropic

LONG = "the shared document text. " * 300  # about 1,950 tokens at four characters each
SHORT = "a short document. " * 40  # about 180 tokens


def test_openai_caches_long_prefixes_in_128_token_steps_per_prompt_cache_key() -> None:
    with fake_openai() as fake:
        client = openai.OpenAI(base_url=fake.base_url, api_key="x", max_retries=0)

        def cached(question: str, key: str | None, document: str = LONG) -> int:
            extra = {"prompt_cache_key": key} if key else {}
            answer = client.chat.completions.create(
                model="gpt-fake",
                messages=[{"role": "user", "content": document}, {"role": "user", "content": question}],
                **extra,
            )
            assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
            return answer.usage.prompt_tokens_details.cached_tokens or 0

        assert cached("first?", "k") == 0
        hit = cached("second?", "k")
        assert hit >= 1024 and hit % 128 == 0 and hit <= len(LONG) // 4
        assert cached("third?", "other-key") == 0  # routed to another cache
        assert cached("one?", None, SHORT) == cached("two?", None, SHORT) == 0  # below 1,024 tokens
        assert fake.requests[1]["prompt_cache_key"] == "k"


def test_anthropic_reads_at_breakpoints_with_look_back_skips_short_prefixes_and_refuses_five() -> None:
    with fake_anthropic() as fake:
        client = anthropic.Anthropic(base_url=fake.url, api_key="x", max_retries=0)
        marked = {"type": "ephemeral"}

        def usage(*blocks: dict[str, object]) -> anthropic.types.Usage:
            return client.messages.create(
                model="claude-fake", max_tokens=5, messages=[{"role": "user", "content": list(blocks)}]
            ).usage

        first = usage({"type": "text", "text": LONG, "cache_control": marked}, {"type": "text", "text": "q1"})
        assert first.cache_creation_input_tokens >= len(LONG) // 4 and first.cache_read_input_tokens == 0
        # the breakpoint moved two blocks later: the earlier prefix is found by looking back
        later = usage(
            {"type": "text", "text": LONG},
            {"type": "text", "text": "more context", "cache_control": marked},
            {"type": "text", "text": "q2"},
        )
        assert (
            later.cache_read_input_tokens == first.cache_creation_input_tokens and later.cache_creation_input_tokens > 0
        )
        short = usage({"type": "text", "text": SHORT, "cache_control": marked})
        assert short.cache_creation_input_tokens == short.cache_read_input_tokens == 0  # below the minimum
        with pytest.raises(anthropic.BadRequestError, match="maximum of 4"):
            usage(*({"type": "text", "text": f"block {i}", "cache_control": marked} for i in range(5)))
        # the top-level (automatic) marker takes a slot, and writes the prompt up to its last block
        four = [{"type": "text", "text": f"block {i}", "cache_control": marked} for i in range(4)]
        with pytest.raises(anthropic.BadRequestError, match="Found 5"):
            client.messages.create(
                model="claude-fake",
                max_tokens=5,
                messages=[{"role": "user", "content": four}],
                extra_body={"cache_control": marked},
            )
        automatic = client.messages.create(
            model="claude-fake",
            max_tokens=5,
            messages=[{"role": "user", "content": [{"type": "text", "text": LONG + " once more"}]}],
            extra_body={"cache_control": marked},
        ).usage
        assert automatic.cache_creation_input_tokens >= len(LONG) // 4


def test_bedrock_converse_cache_points_through_boto3() -> None:
    with fake_bedrock() as fake:
        client = boto3.client(
            "bedrock-runtime",
            endpoint_url=fake.url,
            region_name="us-east-1",
            aws_access_key_id="fake",
            aws_secret_access_key="fake",
        )

        def usage(question: str) -> dict[str, int]:
            answer = client.converse(
                modelId="anthropic.claude-fake-v1:0",
                system=[{"text": "Answer from the context."}],
                messages=[
                    {
                        "role": "user",
                        "content": [{"text": LONG}, {"cachePoint": {"type": "default"}}, {"text": question}],
                    }
                ],
            )
            return dict(answer["usage"])

        first, second = usage("q1"), usage("q2")
        assert first["cacheWriteInputTokens"] > 0 and first["cacheReadInputTokens"] == 0
        assert second["cacheReadInputTokens"] == first["cacheWriteInputTokens"] and second["cacheWriteInputTokens"] == 0
        assert fake.requests[0]["modelId"] == "anthropic.claude-fake-v1:0"


def test_gemini_implicit_cache_through_google_genai() -> None:
    with fake_gemini() as fake:
        client = genai.Client(api_key="fake", http_options=genai_types.HttpOptions(base_url=fake.url))

        def cached(question: str) -> int:
            answer = client.models.generate_content(model="gemini-fake", contents=[LONG, LONG, question])
            assert answer.usage_metadata is not None
            return answer.usage_metadata.cached_content_token_count or 0

        assert cached("q1") == 0
        assert cached("q2") >= 2048
        assert fake.requests[0]["model"] == "gemini-fake"
