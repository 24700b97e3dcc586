"""ContextPilotMiddleware in a create_agent agent whose state something else rewrites:
LangChain's own SummarizationMiddleware (before or after ours) or a before_model trimmer,
over a five-turn thread whose searches overlap. The agent's model is ChatAnthropic or
ChatOpenAI against the bundled fakes of those hosted APIs (they cannot be reached from
here); the summarizer is ChatOpenAI against a real llama-server. Every body that leaves,
the summarizer's included, is audited: no location reference without its text in the
same body, no request id twice."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import SummarizationMiddleware, before_model
from langchain_anthropic import ChatAnthropic
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, RemoveMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph.message import REMOVE_ALL_MESSAGES

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.testing.bodies import Bodies
from contextpilot_integrations.testing.fake_openai import fake_openai
from contextpilot_integrations.testing.fake_providers import fake_anthropic
from contextpilot_integrations.testing.invariants import dangling_references, invariant_breaches, message_texts
from contextpilot_integrations.testing.llama_server import LlamaServer
from langchain_contextpilot.middleware import REFERENCES_KEY, ContextPilotMiddleware
from tests.support import QUERY, BM25ChunkRetriever

RETRIEVER = BM25ChunkRetriever(k=6, max_chars=400)
RELATED = "Which cryptocurrency founder was convicted of fraud by a jury?"
TURNS = [QUERY, RELATED, QUERY + " Who else?", RELATED + " When?", QUERY + " Briefly."]  # the searches overlap


@tool(response_format="content_and_artifact")
def search(query: str) -> tuple[str, list[Document]]:
    """Search the news archive."""
    documents = RETRIEVER.invoke(query)
    return "\n\n".join(document.page_content for document in documents), documents


@before_model
def last_two_turns(state: Any, runtime: Any) -> dict[str, Any] | None:
    """A trimmer: the history from the second-to-last question on."""
    messages = state["messages"]
    questions = [index for index, message in enumerate(messages) if isinstance(message, HumanMessage)]
    if len(questions) <= 2:
        return None
    return {"messages": [RemoveMessage(id=REMOVE_ALL_MESSAGES), *messages[questions[-2] :]]}


@contextmanager
def hosted(provider: str) -> Iterator[tuple[Any, list[dict[str, Any]]]]:
    """The agent's model against the fake of ``provider``'s API, and the bodies it got."""
    if provider == "anthropic":
        with fake_anthropic() as fake:
            yield ChatAnthropic(model="claude-sonnet-4-6", base_url=fake.url, api_key="x", max_retries=0), fake.requests
    else:
        with fake_openai() as fake:
            yield ChatOpenAI(model="gpt-5", base_url=fake.base_url, api_key="x", max_retries=0), fake.requests


def wiring(name: str, pilot: ContextPilot, summarizer: Any) -> list[Any]:
    ours = ContextPilotMiddleware(pilot=pilot)
    summarize = SummarizationMiddleware(model=summarizer, trigger=("messages", 6), keep=("messages", 4))
    return {"summarize-then-ours": [summarize, ours], "ours-then-summarize": [ours, summarize]}.get(
        name, [last_two_turns, ours]
    )


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
@pytest.mark.parametrize("name", ["summarize-then-ours", "ours-then-summarize", "trimmer"])
def test_five_turns_with_a_rewritten_history_send_no_reference_without_its_text(
    llama: LlamaServer, provider: str, name: str
) -> None:
    summary_bodies = Bodies()
    summarizer = ChatOpenAI(
        model="tiny", base_url=llama.url + "/v1", api_key="x", max_tokens=8, http_client=summary_bodies.client()
    )
    pilot = ContextPilot()
    with hosted(provider) as (model, bodies):
        agent = create_agent(model, [search], middleware=wiring(name, pilot, summarizer), checkpointer=InMemorySaver())
        config = {"configurable": {"thread_id": f"{provider}-{name}"}}
        states = [agent.invoke({"messages": [HumanMessage(question)]}, config) for question in TURNS]
        sent = list(bodies)
    assert [type(state["messages"][-1]) for state in states] == [AIMessage] * 5  # every turn answered
    if name == "trimmer":
        assert not any(text == QUERY for text in message_texts(sent[-1]))  # the first question was trimmed away
    else:
        assert summary_bodies.sent  # the history was summarized
    everything = [*sent, *summary_bodies.sent]
    assert [label for body in everything for label in dangling_references(message_texts(body))] == []
    assert invariant_breaches(everything) == []
    references = sum("\n".join(message_texts(body)).count("Please refer to ") for body in sent)
    stats = pilot.stats()
    if name == "trimmer":  # the previous turn is sent: its documents go out as references
        assert references == stats.blocks_referenced > 0 and stats.references_restored == 0
    else:  # the summary took the earlier results: every document goes out in full
        assert references == 0 and stats.references_restored == stats.blocks_referenced > 0
    state_tool_texts = [str(m.content) for m in states[-1]["messages"] if isinstance(m, ToolMessage)]
    assert state_tool_texts and all("Please refer to " not in text for text in state_tool_texts)  # state: in full
    assert all(REFERENCES_KEY not in json.dumps(body) for body in everything)  # bookkeeping never leaves


def test_with_every_earlier_document_sent_a_tool_result_is_what_the_pilot_prepared() -> None:
    """The state keeps the text in full; the messages sent read exactly as prepared when the
    earlier result is among them, and in full when it is not."""
    from langchain_contextpilot._documents import to_blocks
    from langchain_contextpilot._written import as_sent, written_out

    pilot = ContextPilot()
    first = pilot.prepare(to_blocks(RETRIEVER.invoke(QUERY)), QUERY, "c")
    second = pilot.prepare(to_blocks(RETRIEVER.invoke(RELATED)), RELATED, "c", kept_turns={first.turn or 0})
    content, spans = written_out(second)
    assert second.references and "Please refer to " not in content
    earlier = ToolMessage(content=first.render(include_question=False), tool_call_id="1")
    later = ToolMessage(
        content=content, tool_call_id="2", additional_kwargs={REFERENCES_KEY: spans, "contextpilot_request": "r2"}
    )
    sent, written = as_sent([earlier, later])
    assert sent[1].content == second.render(include_question=False) and written == {}
    assert later.content == content  # the state's message is untouched
    alone, written = as_sent([later])
    assert alone[0].content == content and written == {"r2": [reference.text for reference in second.references]}
    edited = later.model_copy(update={"content": "trimmed: " + content})  # edited since: sent as it is
    assert as_sent([earlier, edited])[0][1].content == edited.content
