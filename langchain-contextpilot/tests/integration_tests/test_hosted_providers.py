"""Hosted APIs through LangChain's own chat models (ChatAnthropic, ChatBedrockConverse,
ChatOpenAI, ChatGoogleGenerativeAI), wrapped by ContextPilotChatModel, against local fakes of
the hosted APIs (which cannot be reached from here; contextpilot_integrations.testing.fake_*),
driven over real HTTP by the providers' real SDKs. Every request body is asserted: the
provider's marker right where the shared prefix ends, at most 4, none below the model's
minimum, one prompt_cache_key for requests that share their leading documents, and the
provider's cache reads and writes back in the pilot's statistics. The pilots label every document
(``plain_prompts=False``), so requests with the same leading documents share their text;
a first sight sent plain is tested with the rule that decides it (tests/core/test_gain.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from langchain_anthropic import ChatAnthropic
from langchain_aws import ChatBedrockConverse
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_google_genai import ChatGoogleGenerativeAI
from langchain_openai import ChatOpenAI

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.testing.fake_bedrock import fake_bedrock
from contextpilot_integrations.testing.fake_gemini import fake_gemini
from contextpilot_integrations.testing.fake_openai import fake_openai
from contextpilot_integrations.testing.fake_providers import fake_anthropic
from contextpilot_integrations.testing.invariants import dangling_references
from langchain_contextpilot import ContextPilotChatModel, ContextPilotRetriever, format_documents
from langchain_contextpilot.cache_markers import provider_of
from tests.support import QUERY, BM25ChunkRetriever

PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer from the context."), ("user", "{context}\n\nQuestion: {question}")]
)
RELATED = "Which cryptocurrency founder was convicted of fraud by a jury?"  # shares 3 of 6 documents with QUERY
QUERIES = [QUERY, RELATED, QUERY, RELATED + " Briefly."]


def rag_chain(pilot: ContextPilot, llm: Any, **retriever: Any) -> Any:
    documents = BM25ChunkRetriever(**({"k": 6} | retriever))
    context = ContextPilotRetriever(base_retriever=documents, pilot=pilot) | RunnableLambda(format_documents)
    return {"context": context, "question": RunnablePassthrough()} | PROMPT | llm


def documents_of(query: str) -> list[Any]:
    return BM25ChunkRetriever(k=6).invoke(query)


# ---- reading request bodies -------------------------------------------------------------------------
def anthropic_parts(body: dict[str, Any]) -> list[tuple[str, bool]]:
    """Every text block of a Messages request in order, and whether it carries cache_control."""
    system = body.get("system") or []
    parts = [(system, False)] if isinstance(system, str) else [(b["text"], "cache_control" in b) for b in system]
    for message in body["messages"]:
        content = message["content"]
        if isinstance(content, str):
            parts.append((content, False))
            continue
        parts += [(block.get("text", ""), "cache_control" in block) for block in content]
    return parts


def bedrock_parts(body: dict[str, Any]) -> list[tuple[str, bool]]:
    """Every text block of a Converse request in order, and whether a cachePoint follows it."""
    parts: list[tuple[str, bool]] = []
    blocks = list(body.get("system") or [])
    for message in body["messages"]:
        blocks += message["content"]
    for block in blocks:
        if "cachePoint" in block:
            parts[-1] = (parts[-1][0], True)
        else:
            parts.append((block.get("text", ""), False))
    return parts


def openai_parts(body: dict[str, Any]) -> list[tuple[str, bool]]:
    """Every text part of a Chat Completions request in order, and whether it carries an
    explicit prompt_cache_breakpoint."""
    parts: list[tuple[str, bool]] = []
    for message in body["messages"]:
        content = message["content"]
        parts += (
            [(content, False)]
            if isinstance(content, str)
            else [(part.get("text", ""), "prompt_cache_breakpoint" in part) for part in content]
        )
    return parts


def marker_ends(parts: list[tuple[str, bool]]) -> list[int]:
    """Offsets in the joined text where a marker sits."""
    ends, offset = [], 0
    for text, marked in parts:
        offset += len(text)
        if marked:
            ends.append(offset)
    return ends


def send_order(text: str, documents: list[Any]) -> list[Any]:
    found = [(text.find(document.page_content), document) for document in documents]
    return [document for position, document in sorted(found, key=lambda item: item[0]) if position >= 0]


def shared_depth(order: list[Any], earlier: list[list[Any]]) -> int:
    """Leading documents of ``order`` that an earlier request sent in the same order."""
    best = 0
    for previous in earlier:
        depth = 0
        while depth < min(len(order), len(previous)) and order[depth].id == previous[depth].id:
            depth += 1
        best = max(best, depth)
    return best


def check_markers_at_the_shared_prefix(bodies: list[dict[str, Any]], parts_of: Any) -> int:
    """Each body: at most 4 markers, every marker right after a document, one right after the
    prefix shared with an earlier request. Returns the requests that shared a prefix."""
    orders: list[list[Any]] = []
    shared_requests = 0
    for body, query in zip(bodies, QUERIES, strict=True):
        parts = parts_of(body)
        text = "".join(part for part, _ in parts)
        order = send_order(text, documents_of(query))
        ends = marker_ends(parts)
        assert len(ends) <= 4  # a first request shares nothing yet: it may carry none
        document_ends = {text.find(d.page_content) + len(d.page_content): d.id for d in order}
        assert all(end in document_ends for end in ends), "a marker sits right after a document"
        depth = shared_depth(order, orders)
        if depth:
            shared_requests += 1
            last_shared = order[depth - 1]
            assert text.find(last_shared.page_content) + len(last_shared.page_content) in ends
        orders.append(order)
        assert not dangling_references([part for part, _ in parts])
    return shared_requests


def check_usage_back_in_the_pilot(pilot: ContextPilot, answers: list[Any], provider: str) -> None:
    reads = sum(answer.usage_metadata["input_token_details"].get("cache_read", 0) for answer in answers)
    writes = sum(answer.usage_metadata["input_token_details"].get("cache_creation", 0) for answer in answers)
    stats = pilot.stats()
    assert reads > 0 and stats.engine_cached_tokens == reads and stats.engine_cache_write_tokens == writes
    totals = stats.provider_usage[provider]
    assert totals.requests == len(answers) and totals.cache_read_tokens == reads and totals.cache_write_tokens == writes


# ---- Anthropic: cache_control on the text block where the shared prefix ends ------------------------------
def test_chat_anthropic_marks_where_the_shared_prefix_ends_and_reports_reads_and_writes() -> None:
    with fake_anthropic() as fake:
        pilot = ContextPilot(plain_prompts=False, keep_top=False)  # shared prefixes past the minimum
        llm = ContextPilotChatModel(
            llm=ChatAnthropic(model="claude-sonnet-4-6", base_url=fake.url, api_key="x", max_tokens=5, max_retries=0)
        )
        chain = rag_chain(pilot, llm)
        answers = [chain.invoke(query) for query in QUERIES]
        assert check_markers_at_the_shared_prefix(fake.requests, anthropic_parts) >= 2
        check_usage_back_in_the_pilot(pilot, answers, "anthropic")
        assert pilot.stats().cache_markers_placed >= len(QUERIES)


def test_chat_anthropic_adds_no_marker_below_the_models_minimum() -> None:
    with fake_anthropic() as fake:
        pilot = ContextPilot(plain_prompts=False)
        llm = ContextPilotChatModel(
            llm=ChatAnthropic(model="claude-haiku-4-5", base_url=fake.url, api_key="x", max_tokens=5, max_retries=0)
        )
        rag_chain(pilot, llm, k=3, max_chars=800).invoke(QUERY)  # about 600 tokens: Haiku 4.5 caches 4,096 and up
        assert "cache_control" not in json.dumps(fake.requests[0])
        skipped = pilot.stats().cache_plans_skipped
        assert (
            list(skipped) == ["below minimum 4096 tokens for claude-haiku-4-5"]
            and pilot.stats().cache_markers_placed == 0
        )


def test_chat_anthropic_keeps_the_callers_own_markers_within_four() -> None:
    """A prompt that already marks its context: ContextPilot's markers share the limit of 4."""
    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", [{"type": "text", "text": "Answer from the context.", "cache_control": {"type": "ephemeral"}}]),
            ("user", [{"type": "text", "text": "{context}", "cache_control": {"type": "ephemeral"}}]),
            ("user", "Question: {question}"),
        ]
    )
    with fake_anthropic() as fake:
        pilot = ContextPilot(plain_prompts=False)
        llm = ContextPilotChatModel(llm=ChatAnthropic(model="claude-sonnet-4-6", base_url=fake.url, api_key="x"))
        retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=6), pilot=pilot)
        chain = (
            {"context": retriever | RunnableLambda(format_documents), "question": RunnablePassthrough()} | prompt | llm
        )
        for query in QUERIES:
            chain.invoke(query)
        counts = [json.dumps(body).count('"cache_control"') for body in fake.requests]
        # the caller's two, and ours where a prefix is shared (one may fall on the caller's own)
        assert all(2 <= count <= 4 for count in counts) and max(counts) > 2


# ---- Bedrock: a cachePoint block after the text where the shared prefix ends ---------------------------------
def test_chat_bedrock_converse_puts_cache_points_where_the_shared_prefix_ends() -> None:
    with fake_bedrock() as fake:
        pilot = ContextPilot(plain_prompts=False, keep_top=False)  # shared prefixes past the minimum
        bedrock = ChatBedrockConverse(
            model="anthropic.claude-sonnet-4-5-20250929-v1:0",
            endpoint_url=fake.url,
            region_name="us-east-1",
            aws_access_key_id="fake",
            aws_secret_access_key="fake",
        )
        chain = rag_chain(pilot, ContextPilotChatModel(llm=bedrock))
        answers = [chain.invoke(query) for query in QUERIES]
        assert check_markers_at_the_shared_prefix(fake.requests, bedrock_parts) >= 2
        check_usage_back_in_the_pilot(pilot, answers, "bedrock")


# ---- OpenAI: prompt_cache_key from the leading documents ------------------------------------------------------
def test_chat_openai_sends_one_prompt_cache_key_for_requests_sharing_their_leading_documents() -> None:
    with fake_openai() as fake:
        pilot = ContextPilot(plain_prompts=False, keep_top=False)  # requests sharing leading documents
        openai = ChatOpenAI(model="gpt-5", base_url=fake.base_url, api_key="x", max_retries=0)
        assert provider_of(openai) is None  # not OpenAI's own URL: no key unless asked for
        chain = rag_chain(pilot, ContextPilotChatModel(llm=openai, provider="openai"))
        answers = [chain.invoke(query) for query in QUERIES]
        keys = [body.get("prompt_cache_key") for body in fake.requests]
        orders = [
            [d.id for d in send_order(json.dumps(body), documents_of(q))]
            for body, q in zip(fake.requests, QUERIES, strict=True)
        ]
        assert all(keys)
        for i in range(len(keys)):
            for j in range(len(keys)):
                if orders[i][:2] == orders[j][:2]:
                    assert keys[i] == keys[j]
        assert len(set(keys)) < len(keys)  # requests sharing leading documents share a key
        check_usage_back_in_the_pilot(pilot, answers, "openai")
        assert "prompt_cache_key" not in json.dumps(fake.requests[0]["messages"])


def test_chat_openai_gpt_5_6_gets_explicit_breakpoints_where_the_shared_prefix_ends() -> None:
    """From GPT-5.6 on, content parts take prompt_cache_breakpoint; outside a conversation
    the plan asks for explicit mode (no managed breakpoint writing the question too)."""
    with fake_openai() as fake:
        pilot = ContextPilot(plain_prompts=False, keep_top=False)  # shared prefixes past the minimum
        openai = ChatOpenAI(model="gpt-5.6", base_url=fake.base_url, api_key="x", max_retries=0)
        chain = rag_chain(pilot, ContextPilotChatModel(llm=openai, provider="openai"))
        for query in QUERIES:
            chain.invoke(query)
        assert check_markers_at_the_shared_prefix(fake.requests, openai_parts) >= 2
        marked = [body for body in fake.requests if "prompt_cache_breakpoint" in json.dumps(body)]
        assert marked and all(body["prompt_cache_options"] == {"mode": "explicit"} for body in marked)
        usage = pilot.stats().provider_usage["openai"]
        assert usage.cache_read_tokens > 0 and usage.cache_write_tokens > 0  # writes read from OpenAI's own usage
        assert pilot.stats().engine_cache_write_tokens == usage.cache_write_tokens


def test_a_callers_own_prompt_cache_key_wins() -> None:
    with fake_openai() as fake:
        pilot = ContextPilot(plain_prompts=False)
        llm = ContextPilotChatModel(
            llm=ChatOpenAI(model="gpt-5", base_url=fake.base_url, api_key="x"), provider="openai"
        )
        chain = rag_chain(pilot, llm.bind(prompt_cache_key="tenant-7"))
        chain.invoke(QUERY)
        assert fake.requests[-1]["prompt_cache_key"] == "tenant-7"


# ---- Gemini: the order is all that helps ----------------------------------------------------------------------
def test_chat_google_generative_ai_gets_the_order_and_reports_implicit_cache_hits() -> None:
    with fake_gemini() as fake:
        pilot = ContextPilot(plain_prompts=False)
        gemini = ChatGoogleGenerativeAI(model="gemini-2.5-flash", base_url=fake.url, api_key="fake")
        assert provider_of(gemini) == "gemini"
        chain = rag_chain(pilot, ContextPilotChatModel(llm=gemini))
        answers = [chain.invoke(query) for query in QUERIES]
        sent = json.dumps(fake.requests)
        assert "cache_control" not in sent and "cachePoint" not in sent
        reads = sum(answer.usage_metadata["input_token_details"].get("cache_read", 0) for answer in answers)
        totals = pilot.stats().provider_usage["gemini"]
        assert reads > 0 and totals.cache_read_tokens == reads and totals.requests == len(QUERIES)


def test_streamed_and_async_calls_are_marked_too() -> None:
    with fake_anthropic() as fake:
        pilot = ContextPilot(plain_prompts=False)
        llm = ContextPilotChatModel(llm=ChatAnthropic(model="claude-sonnet-4-6", base_url=fake.url, api_key="x"))
        chain = rag_chain(pilot, llm)
        assert "".join(str(chunk.content) for chunk in chain.stream(QUERY))
        asyncio.run(chain.ainvoke(RELATED))
        assert '"cache_control"' in json.dumps(fake.requests[-1])  # shares QUERY's leading documents
        assert pilot.stats().provider_usage["anthropic"].requests == 2
