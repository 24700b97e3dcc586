"""What a hosted request carries besides ContextPilot's own cache hints, through LlamaIndex's
real classes (llama_index.llms.anthropic.Anthropic, llama_index.llms.openai.OpenAI, a stock
query engine, ContextPilotChatEngine) against local fakes of the hosted APIs
(contextpilot_integrations.testing.fake_*: they cannot be reached from here), which record
every body and refuse a fifth cache_control marker with HTTP 400, as the real API does:
markers of ``Anthropic(cache_idx=...)`` count before ours, a ``prompt_cache_key`` the caller
set is sent as set, every turn of a chat goes under one key, and a misspelt or foreign
argument to ContextPilotLLM is refused."""

from __future__ import annotations

import json

import pytest
from llama_index.llms.anthropic import Anthropic
from llama_index.llms.openai import OpenAI

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.errors import CacheKeyWarning
from contextpilot_integrations.testing.fake_openai import fake_openai
from contextpilot_integrations.testing.fake_providers import fake_anthropic
from contextpilot_integrations.testing.invariants import invariant_breaches
from llama_index.postprocessor.contextpilot import ContextPilotChatEngine, ContextPilotLLM
from tests.test_hosted_providers import QUERIES, RELATED, WordRetriever, engine

TURNS = [*QUERIES, RELATED + " Who testified?"]


def chat_turns(chat: ContextPilotChatEngine, questions: list[str]) -> int:
    """Turns that completed (one refused by the fake counts as not)."""
    completed = 0
    for question in questions:
        try:
            chat.chat(question)
        except Exception as exc:
            if "cache_control" not in str(exc):
                raise
        else:
            completed += 1
    return completed


def test_markers_of_anthropic_cache_idx_count_before_ours() -> None:
    """``cache_idx=1``: LlamaIndex marks the first user message of every request; ours get
    the other three slots."""
    with fake_anthropic() as fake:
        llm = Anthropic(model="claude-sonnet-4-5-20250929", base_url=fake.url, api_key="x", max_retries=0, cache_idx=1)
        chat = ContextPilotChatEngine.from_defaults(
            retriever=WordRetriever(), llm=ContextPilotLLM(llm=llm), pilot=ContextPilot(), token_limit=150_000
        )
        completed = chat_turns(chat, TURNS[:3])
        counts = [json.dumps(body).count('"cache_control"') for body in fake.requests]
        assert completed == 3, f"markers per body: {counts}"
        assert all(1 <= count <= 4 for count in counts) and max(counts) > 1
        assert invariant_breaches(fake.requests) == []  # every reference with its text


def test_a_prompt_cache_key_in_additional_kwargs_is_sent_and_ours_is_left_out_with_a_warning() -> None:
    with fake_openai() as fake:
        openai = OpenAI(
            model="gpt-4o",
            api_base=fake.base_url,
            api_key="x",
            max_retries=0,
            additional_kwargs={"prompt_cache_key": "tenant-A"},
        )
        query_engine = engine(ContextPilot(), ContextPilotLLM(llm=openai, provider="openai"))
        with pytest.warns(CacheKeyWarning, match="tenant-A"):
            for query in QUERIES:
                query_engine.query(query)
        assert [body.get("prompt_cache_key") for body in fake.requests] == ["tenant-A"] * len(QUERIES)
        assert invariant_breaches(fake.requests) == []


def test_every_turn_of_a_chat_goes_under_one_key() -> None:
    with fake_openai() as fake:
        openai = OpenAI(model="gpt-4o", api_base=fake.base_url, api_key="x", max_retries=0)
        llm = ContextPilotLLM(llm=openai, provider="openai")
        chat = ContextPilotChatEngine.from_defaults(retriever=WordRetriever(), llm=llm, pilot=ContextPilot())
        chat_turns(chat, TURNS)
        keys = [body.get("prompt_cache_key") for body in fake.requests]
        assert len(keys) == len(TURNS) and all(keys) and len(set(keys)) == 1, keys
        other = ContextPilotChatEngine.from_defaults(retriever=WordRetriever(), llm=llm, pilot=ContextPilot())
        chat_turns(other, TURNS[:1])  # another chat, another first request
        assert fake.requests[-1].get("prompt_cache_key")
        assert invariant_breaches(fake.requests) == []


def test_a_misspelt_argument_is_refused() -> None:
    with fake_openai() as fake:
        openai = OpenAI(model="gpt-4o", api_base=fake.base_url, api_key="x", max_retries=0)
        with pytest.raises(ValueError, match="unknown argument 'provder' \\(did you mean 'provider'\\?\\)"):
            ContextPilotLLM(llm=openai, provder="openai")
        with pytest.raises(ValueError, match="unknown argument 'pilot': the pilot belongs to"):
            ContextPilotLLM(llm=openai, pilot=ContextPilot())
        assert fake.requests == []
        engine(ContextPilot(), ContextPilotLLM(llm=openai, provider="openai", usage_feedback=False)).query(QUERIES[0])
        assert len(fake.requests) == 1 and fake.requests[0].get("prompt_cache_key")
