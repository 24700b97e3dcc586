"""ContextPilotMiddleware in a LangChain v1 agent (create_agent) whose tool returns documents,
on fakes of the hosted tool-calling APIs (Anthropic Messages, OpenAI Chat Completions; the
hosted APIs cannot be reached from here) driven by ChatAnthropic / ChatOpenAI over real
HTTP. Across turns of one thread the tool results refer to documents an earlier tool result
in the agent's state carries, and no request ever sends a reference whose text it lacks."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_anthropic import ChatAnthropic
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.testing.fake_openai import fake_openai
from contextpilot_integrations.testing.fake_providers import fake_anthropic
from contextpilot_integrations.testing.invariants import dangling_references
from langchain_contextpilot.middleware import REQUEST_KEY, TURN_KEY, ContextPilotMiddleware
from tests.support import QUERY, BM25ChunkRetriever

RELATED = "Which cryptocurrency founder was convicted of fraud by a jury?"  # shares 3 of 6 documents with QUERY
RETRIEVER = BM25ChunkRetriever(k=6)


@tool(response_format="content_and_artifact")
def search(query: str) -> tuple[str, list[Document]]:
    """Search the news archive."""
    documents = RETRIEVER.invoke(query)
    return "\n\n".join(document.page_content for document in documents), documents


def texts(body: dict[str, Any]) -> list[str]:
    """Every text a request sends, in order (Anthropic or OpenAI body)."""
    out: list[str] = []
    system = body.get("system")
    out += [system] if isinstance(system, str) else [block.get("text", "") for block in system or []]
    for message in body["messages"]:
        content = message.get("content")
        for block in [content] if isinstance(content, str) else content or []:
            if isinstance(block, str):
                out.append(block)
            elif block.get("type") == "tool_result":
                inner = block.get("content")
                out += [inner] if isinstance(inner, str) else [part.get("text", "") for part in inner or []]
            else:
                out.append(block.get("text", ""))
    return out


def run_turns(agent: Any, questions: list[str], thread: str = "t1") -> list[dict[str, Any]]:
    config = {"configurable": {"thread_id": thread}}
    return [agent.invoke({"messages": [HumanMessage(question)]}, config) for question in questions]


def check_no_dangling_and_references_used(bodies: list[dict[str, Any]], pilot: ContextPilot) -> None:
    assert all(not dangling_references(texts(body)) for body in bodies)
    assert sum("\n".join(texts(body)).count("Please refer to ") for body in bodies) > 0
    assert pilot.stats().blocks_referenced == 2  # what the first turn's result carries, but the top document
    sent = json.dumps(bodies)
    assert TURN_KEY not in sent and REQUEST_KEY not in sent  # bookkeeping never leaves


def test_agent_on_anthropic_deduplicates_across_turns_and_marks_the_tool_results() -> None:
    with fake_anthropic() as fake:
        pilot = ContextPilot()
        model = ChatAnthropic(model="claude-sonnet-4-6", base_url=fake.url, api_key="x", max_retries=0)
        agent = create_agent(
            model, [search], middleware=[ContextPilotMiddleware(pilot=pilot)], checkpointer=InMemorySaver()
        )
        states = run_turns(agent, [QUERY, RELATED])
        bodies = fake.requests
        assert len(bodies) == 4  # per turn: the tool call, then the answer after the tool result
        check_no_dangling_and_references_used(bodies, pilot)
        tool_messages = [m for m in states[-1]["messages"] if isinstance(m, ToolMessage)]
        assert len(tool_messages) == 2 and "Please refer to " not in str(tool_messages[1].content)  # state: in full
        assert "Please refer to " in "\n".join(texts(bodies[3]))  # sent: as references
        marks = [json.dumps(body).count('"cache_control"') for body in bodies]
        assert marks[1] >= 1 and marks[3] >= 1 and max(marks) <= 4  # the calls after a tool result
        usage = pilot.stats().provider_usage["anthropic"]
        assert usage.requests == 2 and usage.cache_read_tokens > 0  # turn 2 reads turn 1's tool result


def test_agent_on_openai_sends_a_prompt_cache_key_and_reports_cached_tokens() -> None:
    with fake_openai() as fake:
        pilot = ContextPilot()
        model = ChatOpenAI(model="gpt-5", base_url=fake.base_url, api_key="x", max_retries=0)
        agent = create_agent(
            model,
            [search],
            system_prompt="Answer from the search results.",
            middleware=[ContextPilotMiddleware(pilot=pilot, provider="openai")],
            checkpointer=InMemorySaver(),
        )
        run_turns(agent, [QUERY, RELATED])
        bodies = fake.requests
        check_no_dangling_and_references_used(bodies, pilot)
        keys = [body.get("prompt_cache_key") for body in bodies]
        assert all(keys) and len(set(keys)) == 1  # one conversation, one machine: every call of it
        usage = pilot.stats().provider_usage["openai"]
        assert usage.requests == 2 and usage.cache_read_tokens > 0


def test_a_trimmed_history_gets_the_referenced_text_back() -> None:
    """A middleware before ours drops the first turn from what the model is sent: the
    references into it go out as full text (the state keeps them)."""
    from langchain.agents.middleware import AgentMiddleware

    class KeepLastTurn(AgentMiddleware):
        def wrap_model_call(self, request: Any, handler: Any) -> Any:
            messages = request.messages
            last_human = max(i for i, m in enumerate(messages) if isinstance(m, HumanMessage))
            return handler(request.override(messages=messages[last_human:]))

    with fake_anthropic() as fake:
        pilot = ContextPilot()
        model = ChatAnthropic(model="claude-sonnet-4-6", base_url=fake.url, api_key="x", max_retries=0)
        agent = create_agent(
            model,
            [search],
            middleware=[KeepLastTurn(), ContextPilotMiddleware(pilot=pilot)],
            checkpointer=InMemorySaver(),
        )
        run_turns(agent, [QUERY, RELATED])
        assert all(not dangling_references(texts(body)) for body in fake.requests)
        assert "Please refer to " not in "\n".join(texts(fake.requests[-1]))
        assert pilot.stats().references_restored == 2  # the top document went out in full anyway


def test_async_agent_and_separate_threads_share_nothing() -> None:
    with fake_anthropic() as fake:
        pilot = ContextPilot()
        model = ChatAnthropic(model="claude-sonnet-4-6", base_url=fake.url, api_key="x", max_retries=0)
        agent = create_agent(
            model, [search], middleware=[ContextPilotMiddleware(pilot=pilot)], checkpointer=InMemorySaver()
        )

        async def both() -> None:
            for thread, question in (("a", QUERY), ("b", RELATED)):
                await agent.ainvoke({"messages": [HumanMessage(question)]}, {"configurable": {"thread_id": thread}})

        asyncio.run(both())
        assert pilot.stats().blocks_referenced == 0  # another thread's documents are no reference
        assert all(not dangling_references(texts(body)) for body in fake.requests)


def test_tools_without_documents_are_left_alone() -> None:
    @tool
    def clock(query: str) -> str:
        """The time."""
        return "noon"

    with fake_anthropic() as fake:
        pilot = ContextPilot()
        model = ChatAnthropic(model="claude-sonnet-4-6", base_url=fake.url, api_key="x", max_retries=0)
        agent = create_agent(model, [clock], middleware=[ContextPilotMiddleware(pilot=pilot)])
        state = agent.invoke({"messages": [SystemMessage("s"), HumanMessage("What time is it?")]})
        assert [m.content for m in state["messages"] if isinstance(m, ToolMessage)] == ["noon"]
        assert pilot.stats().requests_prepared == 0 and "cache_control" not in json.dumps(fake.requests)


def test_unknown_provider_is_refused() -> None:
    with pytest.raises(ValueError, match="provider"):
        ContextPilotMiddleware(provider="azure")


def test_a_turn_whose_documents_are_all_references_still_reads_the_conversation() -> None:
    with fake_anthropic() as fake:
        pilot = ContextPilot(keep_top=False)  # the top document may be a reference too
        model = ChatAnthropic(model="claude-sonnet-4-6", base_url=fake.url, api_key="x", max_retries=0)
        agent = create_agent(
            model, [search], middleware=[ContextPilotMiddleware(pilot=pilot)], checkpointer=InMemorySaver()
        )
        run_turns(agent, [QUERY, QUERY + " Again, please."])
        assert pilot.stats().blocks_referenced == 6 and all(not dangling_references(texts(b)) for b in fake.requests)
        assert 1 <= json.dumps(fake.requests[-1]).count('"cache_control"') <= 4  # the conversation so far
        assert pilot.stats().provider_usage["anthropic"].cache_read_tokens > 0


def test_a_failed_model_call_is_forgotten_and_its_retry_sends_the_request_again() -> None:
    from langchain.agents.middleware import ModelRetryMiddleware

    with fake_anthropic() as fake:

        @tool(response_format="content_and_artifact")
        def flaky_search(query: str) -> tuple[str, list[Document]]:
            """Search the news archive (the provider is overloaded right after)."""
            fake.fail_next = 1
            return search.func(query)  # type: ignore[attr-defined,no-any-return]

        pilot = ContextPilot()
        model = ChatAnthropic(model="claude-sonnet-4-6", base_url=fake.url, api_key="x", max_retries=0)
        retry = ModelRetryMiddleware(max_retries=1, initial_delay=0, jitter=False)
        agent = create_agent(model, [flaky_search], middleware=[retry, ContextPilotMiddleware(pilot=pilot)])
        agent.invoke({"messages": [HumanMessage(QUERY)]})
        assert len(fake.requests) == 3  # the tool call, the failed answer, its retry
        assert '"cache_control"' in json.dumps(fake.requests[1]) and '"cache_control"' in json.dumps(fake.requests[2])
        stats = pilot.stats()
        assert stats.requests_prepared == 1 and stats.provider_usage["anthropic"].requests == 1
        assert stats.live_requests == 1  # the retry, adopted under a new id; the failed one forgotten
