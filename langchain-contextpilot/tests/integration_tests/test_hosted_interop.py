"""What a hosted request carries besides ContextPilot's own cache hints, through LangChain's
real classes (ChatAnthropic, ChatOpenAI, create_agent, AnthropicPromptCachingMiddleware)
against local fakes of the hosted APIs (contextpilot_integrations.testing.fake_*: they cannot
be reached from here), which record every body and refuse what the real APIs refuse (a fifth
cache_control marker: HTTP 400, the top-level automatic marker taking a slot):

- markers the caller placed (system prompt, a bound tool, ``cache_control`` as a request
  argument or in ``model_kwargs``, AnthropicPromptCachingMiddleware's three) are counted
  before ours: never more than 4, every call completes;
- a ``prompt_cache_key`` the caller set is sent as set, with a CacheKeyWarning that ours is not;
- every request of one conversation goes under one key (chain, ConversationalRAG, agent);
- a misspelt or foreign argument to ContextPilotChatModel is refused.
"""

from __future__ import annotations

import json
import warnings
from operator import itemgetter
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_anthropic import ChatAnthropic
from langchain_anthropic.middleware import AnthropicPromptCachingMiddleware
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_core.tools import StructuredTool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.errors import CacheKeyWarning
from contextpilot_integrations.testing.fake_openai import fake_openai
from contextpilot_integrations.testing.fake_providers import fake_anthropic
from contextpilot_integrations.testing.invariants import dangling_references
from langchain_contextpilot import ContextPilotChatModel, ContextPilotRetriever, ConversationalRAG, format_documents
from langchain_contextpilot.middleware import ContextPilotMiddleware, MarkerLimitWarning, WrappedModelWarning
from tests.integration_tests.test_agent_middleware import search, texts
from tests.support import QUERY, BM25ChunkRetriever

RELATED = "Which cryptocurrency founder was convicted of fraud by a jury?"  # shares 3 of 6 documents with QUERY
QUESTIONS = [
    QUERY,
    RELATED,
    QUERY + " Briefly.",
    "What did the jury decide about the cryptocurrency founder?",
    RELATED + " In one sentence.",
    "Who testified at the fraud trial?",
]
MARK = {"type": "ephemeral"}
LOOKUP = {
    "name": "lookup",
    "description": "Look a name up in the archive.",
    "input_schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    "cache_control": MARK,
}


def markers(body: dict[str, Any]) -> int:
    """cache_control markers a Messages body carries, the top-level (automatic) one included."""
    return json.dumps(body).count('"cache_control"')


def anthropic(fake: Any, **options: Any) -> ChatAnthropic:
    return ChatAnthropic(model="claude-sonnet-4-6", base_url=fake.url, api_key="x", max_retries=0, **options)


def rag_chain(pilot: ContextPilot, llm: Any, system: Any = "Answer from the context.") -> Any:
    prompt = ChatPromptTemplate.from_messages([("system", system), ("user", "{context}\n\nQuestion: {question}")])
    context = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=6), pilot=pilot) | RunnableLambda(
        format_documents
    )
    return {"context": context, "question": RunnablePassthrough()} | prompt | llm


def run_all(chain: Any, questions: list[str], config: Any = None) -> int:
    """Calls that completed (a refused one counts as not)."""
    completed = 0
    for question in questions:
        try:
            chain.invoke(question, config=config)
        except Exception as exc:  # the fake's 400, through the SDK
            if "cache_control" not in str(exc):
                raise
        else:
            completed += 1
    return completed


# ---- item 1: every marker the request carries counts ----------------------------------------------------
SYSTEM_MARKED = [{"type": "text", "text": "Answer from the context.", "cache_control": MARK}]
SYSTEM_THREE_MARKED = [
    {"type": "text", "text": "You answer questions about the news.", "cache_control": MARK},
    {"type": "text", "text": "Answer from the context.", "cache_control": MARK},
    {"type": "text", "text": "Cite the documents you use.", "cache_control": MARK},
]


@pytest.mark.parametrize(
    ("system", "top_level", "callers"),
    [(SYSTEM_MARKED, None, 2), (SYSTEM_THREE_MARKED, None, 4), (SYSTEM_MARKED, "model_kwargs", 3)],
    ids=["system+tool", "3 system+tool", "system+tool+top-level"],
)
def test_chat_anthropic_counts_tool_and_top_level_markers(system: Any, top_level: str | None, callers: int) -> None:
    with fake_anthropic(call_tools=False) as fake:
        pilot = ContextPilot(plain_prompts=False)
        options = {"model_kwargs": {"cache_control": MARK}} if top_level else {}
        llm = ContextPilotChatModel(llm=anthropic(fake, **options)).bind_tools([LOOKUP])
        completed = run_all(rag_chain(pilot, llm, system), QUESTIONS)
        counts = [markers(body) for body in fake.requests]
        assert completed == len(QUESTIONS), f"markers per body: {counts}"
        assert all(callers <= count <= 4 for count in counts)
        assert callers == 4 or max(counts) > callers  # ours, where markers were left
        assert all(not dangling_references([text for text, _ in _texts(body)]) for body in fake.requests)


def test_chat_anthropic_counts_a_cache_control_argument() -> None:
    with fake_anthropic(call_tools=False) as fake:
        pilot = ContextPilot(plain_prompts=False)
        llm = ContextPilotChatModel(llm=anthropic(fake)).bind(cache_control=MARK)
        completed = run_all(rag_chain(pilot, llm, SYSTEM_THREE_MARKED), QUESTIONS)
        assert completed == len(QUESTIONS) and all(markers(body) == 4 for body in fake.requests)
        assert all(body.get("cache_control") == MARK for body in fake.requests)


def _texts(body: dict[str, Any]) -> list[tuple[str, bool]]:
    return [(text, False) for text in texts(body)]


def marked_search() -> StructuredTool:
    """The archive search, its definition marked by the caller (``extras``)."""
    return search.model_copy(update={"extras": {"cache_control": MARK}})


def agent_turns(agent: Any, questions: list[str], thread: str = "t1") -> int:
    completed = 0
    for question in questions:
        try:
            agent.invoke({"messages": [HumanMessage(question)]}, {"configurable": {"thread_id": thread}})
        except Exception as exc:
            if "cache_control" not in str(exc):
                raise
        else:
            completed += 1
    return completed


@pytest.mark.parametrize(
    ("system", "options"),
    [(SYSTEM_THREE_MARKED, {}), (SYSTEM_THREE_MARKED[:2], {"model_kwargs": {"cache_control": MARK}})],
    ids=["3 system+tool", "2 system+tool+top-level"],
)
def test_middleware_counts_the_callers_tool_system_and_top_level_markers(system: Any, options: Any) -> None:
    with fake_anthropic() as fake:
        pilot = ContextPilot()
        agent = create_agent(
            anthropic(fake, **options),
            [marked_search()],
            system_prompt=SystemMessage(system),
            middleware=[ContextPilotMiddleware(pilot=pilot)],
            checkpointer=InMemorySaver(),
        )
        completed = agent_turns(agent, QUESTIONS[:4])
        counts = [markers(body) for body in fake.requests]
        assert completed == 4, f"markers per body: {counts}"
        assert counts == [4] * 8  # the caller's four: none left for ours
        assert all(not dangling_references(texts(body)) for body in fake.requests)
        if options:  # the automatic marker on the conversation's end: the next turn reads it
            assert pilot.stats().provider_usage["anthropic"].cache_read_tokens > 0


# ---- item 7: AnthropicPromptCachingMiddleware and ours in one agent -------------------------------------
SYSTEM_TWO_PARTS = [
    {"type": "text", "text": "You answer questions about the news.", "cache_control": MARK},
    {"type": "text", "text": "Answer from the search results."},
]


def test_anthropic_prompt_caching_middleware_composes_with_ours() -> None:
    """The documented setup: the provider's own model, AnthropicPromptCachingMiddleware
    listed before ours. Its three markers (last system block, last tool, top-level) and the
    caller's own on the system prompt reach ours in the request: ours take what is left."""
    with fake_anthropic() as fake:
        pilot = ContextPilot()
        agent = create_agent(
            anthropic(fake),
            [search],
            system_prompt=SystemMessage(SYSTEM_TWO_PARTS),  # type: ignore[arg-type]
            middleware=[AnthropicPromptCachingMiddleware(), ContextPilotMiddleware(pilot=pilot)],
            checkpointer=InMemorySaver(),
        )
        completed = agent_turns(agent, QUESTIONS[:4])
        counts = [markers(body) for body in fake.requests]
        assert completed == 4, f"markers per body: {counts}"
        assert counts == [4] * 8  # the caller's, and AnthropicPromptCachingMiddleware's three, in every body
        assert all(body.get("cache_control") and body["tools"][-1].get("cache_control") for body in fake.requests)
        assert all(not dangling_references(texts(body)) for body in fake.requests)
        assert pilot.stats().blocks_referenced > 0  # ours still de-duplicates the tool results
        assert pilot.stats().provider_usage["anthropic"].cache_read_tokens > 0


@pytest.mark.parametrize("system", [SYSTEM_TWO_PARTS, "You answer questions about the news."], ids=["caller's", "none"])
def test_anthropic_prompt_caching_middleware_listed_after_ours_never_exceeds_the_limit(system: Any) -> None:
    """The other order: AnthropicPromptCachingMiddleware runs inside ours and adds its
    markers after ours counted. The limit is kept as the body is built (ours give way, with
    a warning naming the order to use), so no call is refused."""
    with fake_anthropic() as fake:
        pilot = ContextPilot()
        agent = create_agent(
            anthropic(fake),
            [search],
            system_prompt=SystemMessage(system),  # type: ignore[arg-type]
            middleware=[ContextPilotMiddleware(pilot=pilot), AnthropicPromptCachingMiddleware()],
            checkpointer=InMemorySaver(),
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            completed = agent_turns(agent, QUESTIONS[:4])
        counts = [markers(body) for body in fake.requests]
        assert completed == 4 and max(counts) <= 4, f"markers per body: {counts}"
        assert all(body.get("cache_control") and body["tools"][-1].get("cache_control") for body in fake.requests)
        assert all(not dangling_references(texts(body)) for body in fake.requests)
        assert pilot.stats().provider_usage["anthropic"].cache_read_tokens > 0
        gave_way = [w for w in caught if issubclass(w.category, MarkerLimitWarning)]
        assert gave_way and "list AnthropicPromptCachingMiddleware before" in str(gave_way[0].message)


def test_a_wrapped_model_in_an_agent_is_named_with_the_fix() -> None:
    """Wrapped in ContextPilotChatModel, AnthropicPromptCachingMiddleware switches itself off:
    ours says so, and what to pass instead."""
    with fake_anthropic() as fake:
        agent = create_agent(
            ContextPilotChatModel(llm=anthropic(fake)),
            [search],
            middleware=[
                AnthropicPromptCachingMiddleware(unsupported_model_behavior="ignore"),
                ContextPilotMiddleware(),
            ],
        )
        with pytest.warns(WrappedModelWarning, match="pass ChatAnthropic itself to create_agent"):
            agent.invoke({"messages": [HumanMessage(QUERY)]})
        assert len(fake.requests) == 2


# ---- item 3: the caller's prompt_cache_key --------------------------------------------------------------
def openai(fake: Any, **options: Any) -> ChatOpenAI:
    return ChatOpenAI(model="gpt-5", base_url=fake.base_url, api_key="x", max_retries=0, **options)


def test_a_prompt_cache_key_in_model_kwargs_is_sent_and_ours_is_left_out_with_a_warning() -> None:
    with fake_openai() as fake:
        pilot = ContextPilot(plain_prompts=False)
        llm = ContextPilotChatModel(llm=openai(fake, model_kwargs={"prompt_cache_key": "tenant-A"}), provider="openai")
        with pytest.warns(CacheKeyWarning, match="tenant-A"):
            completed = run_all(rag_chain(pilot, llm), QUESTIONS[:4])
        assert completed == 4 and [body.get("prompt_cache_key") for body in fake.requests] == ["tenant-A"] * 4


def test_a_bound_prompt_cache_key_is_sent_and_ours_is_left_out_with_a_warning() -> None:
    with fake_openai() as fake:
        pilot = ContextPilot(plain_prompts=False)
        llm = ContextPilotChatModel(llm=openai(fake), provider="openai")
        with warnings.catch_warnings():
            warnings.simplefilter("error", CacheKeyWarning)  # no key of the caller's: ours, silently
            run_all(rag_chain(pilot, llm), QUESTIONS[:2])
        with pytest.warns(CacheKeyWarning, match="tenant-7"):
            run_all(rag_chain(pilot, llm.bind(prompt_cache_key="tenant-7")), QUESTIONS[:2])
        keys = [body.get("prompt_cache_key") for body in fake.requests]
        assert all(key.startswith("cp-") for key in keys[:2]) and keys[2:] == ["tenant-7"] * 2


def test_middleware_sends_the_models_own_prompt_cache_key() -> None:
    with fake_openai() as fake:
        pilot = ContextPilot()
        model = openai(fake, model_kwargs={"prompt_cache_key": "tenant-A"})
        agent = create_agent(
            model, [search], middleware=[ContextPilotMiddleware(pilot=pilot, provider="openai")], checkpointer=None
        )
        with pytest.warns(CacheKeyWarning):
            agent.invoke({"messages": [HumanMessage(QUERY)]})
        assert [body.get("prompt_cache_key") for body in fake.requests] == ["tenant-A"] * 2


# ---- item 6: one key a conversation ---------------------------------------------------------------------
def keys_sent(fake: Any) -> list[Any]:
    return [body.get("prompt_cache_key") for body in fake.requests]


def test_a_chain_with_history_and_a_thread_id_keeps_one_key() -> None:
    """A chat chain: the history resent before each turn's documents (references into it
    where a document was shown), the thread in the config. Every turn extends the first."""
    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "Answer from the context."),
            MessagesPlaceholder("history"),
            ("user", "{context}\n\nQuestion: {question}"),
        ]
    )
    with fake_openai() as fake:
        pilot = ContextPilot(plain_prompts=False)
        retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=6), pilot=pilot, deduplicate=True)
        chain = (
            {
                "context": itemgetter("question") | retriever | RunnableLambda(format_documents),
                "question": itemgetter("question"),
                "history": itemgetter("history"),
            }
            | prompt
            | ContextPilotChatModel(llm=openai(fake), provider="openai")
        )
        history: list[Any] = []
        config = {"configurable": {"thread_id": "user-42"}}
        for question in QUESTIONS[:5]:
            answer = chain.invoke({"question": question, "history": history}, config=config)
            history += [HumanMessage(fake.requests[-1]["messages"][-1]["content"]), answer]
        keys = keys_sent(fake)
        assert len(keys) == 5 and all(keys) and len(set(keys)) == 1, keys
        assert pilot.stats().blocks_referenced > 0


def test_conversational_rag_sends_every_turn_under_one_key() -> None:
    with fake_openai() as fake:
        pilot = ContextPilot(plain_prompts=False)
        rag = ConversationalRAG(
            retriever=BM25ChunkRetriever(k=6),
            llm=ContextPilotChatModel(llm=openai(fake), provider="openai"),
            pilot=pilot,
        )
        config = {"configurable": {"thread_id": "user-42"}}
        for question in QUESTIONS[:5]:
            rag.invoke(question, config=config)
        keys = keys_sent(fake)
        assert len(keys) == 5 and all(keys) and len(set(keys)) == 1, keys
        # turn 2 extends turn 1's prompt: the same machine should hold it
        first_user = fake.requests[0]["messages"][1]["content"]
        assert json.dumps(fake.requests[1]["messages"]).find(json.dumps(first_user)[1:-1]) > 0
        rag.invoke(QUERY, config={"configurable": {"thread_id": "user-43"}})
        assert keys_sent(fake)[-1]


def test_every_model_call_of_an_agent_thread_carries_its_key() -> None:
    with fake_openai() as fake:
        pilot = ContextPilot()
        agent = create_agent(
            openai(fake),
            [search],
            system_prompt="Answer from the search results.",
            middleware=[ContextPilotMiddleware(pilot=pilot, provider="openai")],
            checkpointer=InMemorySaver(),
        )
        agent_turns(agent, QUESTIONS[:5])
        keys = keys_sent(fake)
        assert len(keys) == 10 and all(keys) and len(set(keys)) == 1, keys
        agent_turns(agent, [QUERY], thread="t2")  # another thread: a key of its own
        assert all(keys_sent(fake)[-2:]) and keys_sent(fake)[-1] == keys_sent(fake)[-2]


# ---- item 5: unknown arguments are refused --------------------------------------------------------------
def test_a_misspelt_argument_is_refused_and_nothing_is_sent() -> None:
    with fake_openai() as fake:
        with pytest.raises(ValueError, match="unknown argument 'provder' \\(did you mean 'provider'\\?\\)"):
            ContextPilotChatModel(llm=openai(fake), provder="openai")
        with pytest.raises(ValueError, match="unknown argument 'pilot': the pilot belongs to"):
            ContextPilotChatModel(llm=openai(fake), pilot=ContextPilot())
        assert fake.requests == []
        model = ContextPilotChatModel(llm=openai(fake), provider="openai", tags=["rag"], metadata={"app": "x"})
        assert model.invoke("hi").content and len(fake.requests) == 1  # LangChain's own fields still pass
