"""A LangChain RAG chain with ContextPilot, over the bundled MultiHop-RAG sample.

    python examples/langchain_rag_chain.py              # prints the prompts (no server needed)
    CONTEXTPILOT_ENGINE_URL=http://127.0.0.1:30000 python examples/langchain_rag_chain.py   # and asks the server

Needs: pip install langchain-contextpilot rank-bm25 (from a clone: pip install ./ ./langchain-contextpilot rank-bm25)
"""

from __future__ import annotations

import os
from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from rank_bm25 import BM25Okapi

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.whatif.datasets import load_multihop_rag
from langchain_contextpilot import ChatSGLang, ContextPilotRetriever, ConversationalRAG, format_documents

chunks = list(load_multihop_rag().chunks.values())
index = BM25Okapi([chunk.text.lower().split() for chunk in chunks])


class BM25Retriever(BaseRetriever):
    """Your existing retriever; here BM25 over the bundled news chunks."""

    k: int = 6

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        scores = index.get_scores(query.lower().split())
        best = sorted(range(len(chunks)), key=lambda i: -scores[i])[: self.k]
        return [Document(id=chunks[i].id, page_content=chunks[i].text[:600]) for i in best]


pilot = ContextPilot()
retriever = ContextPilotRetriever(base_retriever=BM25Retriever(), pilot=pilot)  # the one-line change
prompt = ChatPromptTemplate.from_messages(
    [("system", "Answer from the context."), ("user", "{context}\n\nQuestion: {question}")]
)
inputs = {"context": retriever | RunnableLambda(format_documents), "question": RunnablePassthrough()}

questions = [
    "Who is the individual associated with the cryptocurrency industry facing a criminal trial?",
    "Which crypto exchange founder was accused by prosecutors of fraud?",
]
url = os.environ.get("CONTEXTPILOT_ENGINE_URL")
sent: list[list[BaseMessage]] = []


def offline(messages: Any) -> AIMessage:
    """Stands in for the model without a server: keeps the prompt, answers nothing."""
    sent.append(messages.to_messages() if hasattr(messages, "to_messages") else list(messages))
    return AIMessage("(no server: this is where the answer goes)")


llm: Any = (
    ChatSGLang(model=os.environ.get("CONTEXTPILOT_MODEL", "default"), base_url=url + "/v1", max_tokens=64)
    if url
    else RunnableLambda(offline)
)

# 1. a conversation: the history is in the messages, so documents already shown become references
rag = ConversationalRAG(retriever=BM25Retriever(), llm=llm, pilot=pilot)
for turn, question in enumerate([questions[0], questions[0] + " What was the verdict?"]):
    answer = rag.invoke(question, config={"configurable": {"thread_id": "demo"}})
    cached = (getattr(answer, "usage_metadata", None) or {}).get("input_token_details", {}).get("cache_read")
    user = rag.history("demo")[-1][1]
    print(f"turn {turn}: cached prompt tokens {cached}; {user.count('Please refer to ')} location references")
    if turn:
        print(user[:400])

# 2. one-shot questions from other users: the first shares documents with the conversation's first
#    turn, so it is sent in that turn's order (a prefix the engine holds), its own top document
#    first or last, where a model reads best; a question that shares nothing goes out exactly as
#    it would without ContextPilot
chain = inputs | prompt | llm
for n, question in enumerate(questions[1:], start=1):
    answer = chain.invoke(question, config={"configurable": {"thread_id": f"user-{n}"}})
    cached = (getattr(answer, "usage_metadata", None) or {}).get("input_token_details", {}).get("cache_read")
    text = sent[-1][-1].content if sent else ""
    print(f"question {n}: cached prompt tokens {cached}; prompt ends with: {str(text)[-400:]!r}")
print(pilot.stats())
