"""A retriever that returns an empty or blank Document among six: the call goes on, the blank
document comes back untouched (last: it carries no text, so its place changes nothing the
model reads), every other document reaches the model. Through the real classes, against a
real llama-server (every body recorded and audited) and, for the agent, the bundled fake of
Anthropic's API (the hosted API cannot be reached from here)."""

from __future__ import annotations

from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_anthropic import ChatAnthropic
from langchain_classic.retrievers import ContextualCompressionRetriever
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_core.tools import tool

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.testing.bodies import Bodies
from contextpilot_integrations.testing.fake_providers import fake_anthropic
from contextpilot_integrations.testing.invariants import invariant_breaches, message_texts
from contextpilot_integrations.testing.llama_server import LlamaServer
from langchain_contextpilot import ChatSGLang, ContextPilotCompressor, ContextPilotRetriever, format_documents
from langchain_contextpilot.middleware import ContextPilotMiddleware
from tests.support import QUERY, BM25ChunkRetriever

PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer from the context."), ("user", "{context}\n\nQuestion: {question}")]
)


class WithABlank(BaseRetriever):
    """Five real BM25 documents and one whose text is ``blank``, third."""

    blank: str = ""

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        documents = BM25ChunkRetriever(k=5, max_chars=200).invoke(query)
        return [*documents[:2], Document(id="empty-one", page_content=self.blank), *documents[2:]]


def chain(retriever: Any, llama: LlamaServer, bodies: Bodies) -> Any:
    llm = ChatSGLang(model="tiny", base_url=llama.url + "/v1", max_tokens=1, http_client=bodies.client())
    return {"context": retriever | RunnableLambda(format_documents), "question": RunnablePassthrough()} | PROMPT | llm


@pytest.mark.parametrize("blank", ["", "  \n "])
def test_retriever_passes_a_blank_document_through(llama: LlamaServer, blank: str) -> None:
    pilot, bodies = ContextPilot(), Bodies()
    base = WithABlank(blank=blank)
    retriever = ContextPilotRetriever(base_retriever=base, pilot=pilot)
    documents = retriever.invoke(QUERY)
    assert len(documents) == 6 and documents[-1].page_content == blank and documents[-1].id == "empty-one"
    assert "contextpilot" not in documents[-1].metadata  # untouched
    answer = chain(retriever, llama, bodies).invoke(QUERY)
    assert answer.usage_metadata is not None and len(bodies.sent) == 1  # the call went through
    sent = "\n".join(message_texts(bodies.sent[0]))
    assert all(d.page_content in sent for d in base.invoke(QUERY) if d.page_content.strip())
    assert pilot.stats().engine_requests == 1 and invariant_breaches(bodies.sent) == []


def test_compression_retriever_passes_a_blank_document_through(llama: LlamaServer) -> None:
    pilot, bodies = ContextPilot(), Bodies()
    retriever = ContextualCompressionRetriever(
        base_compressor=ContextPilotCompressor(pilot=pilot), base_retriever=WithABlank()
    )
    assert [d.page_content for d in retriever.invoke(QUERY)][-1] == ""
    chain(retriever, llama, bodies).invoke(QUERY)
    assert len(bodies.sent) == 1 and pilot.stats().engine_requests == 1
    assert invariant_breaches(bodies.sent) == []


def test_only_blank_documents_are_sent_as_they_are(llama: LlamaServer) -> None:
    class Blanks(BaseRetriever):
        def _get_relevant_documents(self, query: str, *, run_manager: Any) -> list[Document]:
            return [Document(page_content=""), Document(page_content=" ")]

    bodies = Bodies()
    retriever = ContextPilotRetriever(base_retriever=Blanks(), pilot=ContextPilot())
    assert [d.page_content for d in retriever.invoke(QUERY)] == ["", " "]
    chain(retriever, llama, bodies).invoke(QUERY)
    assert len(bodies.sent) == 1 and invariant_breaches(bodies.sent) == []


def test_agent_tool_with_a_blank_document_in_its_artifact() -> None:
    base = WithABlank(blank=" ")

    @tool(response_format="content_and_artifact")
    def search(query: str) -> tuple[str, list[Document]]:
        """Search the news archive."""
        documents = base.invoke(query)
        return "\n\n".join(document.page_content for document in documents), documents

    pilot = ContextPilot()
    with fake_anthropic() as fake:
        model = ChatAnthropic(model="claude-sonnet-4-6", base_url=fake.url, api_key="x", max_retries=0)
        agent = create_agent(model, [search], middleware=[ContextPilotMiddleware(pilot=pilot)])
        state = agent.invoke({"messages": [HumanMessage(QUERY)]})
        bodies = list(fake.requests)
    result = next(m for m in state["messages"] if isinstance(m, ToolMessage))
    assert len(result.artifact) == 6 and result.artifact[2].page_content == " "  # the artifact as the tool gave it
    assert all(d.page_content in str(result.content) for d in result.artifact if d.page_content.strip())
    assert len(bodies) == 2 and pilot.stats().requests_prepared == 1  # the answer after the tool result came
    assert invariant_breaches(bodies) == []
