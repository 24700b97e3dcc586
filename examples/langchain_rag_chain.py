"""A LangChain RAG chain with ContextPilot, over the bundled MultiHop-RAG sample.

    python examples/langchain_rag_chain.py              # prints the prompts (no server needed)
    CONTEXTPILOT_ENGINE_URL=http://127.0.0.1:30000 python examples/langchain_rag_chain.py   # and asks the server

Needs: pip install langchain-contextpilot rank-bm25 (from a clone: pip install ./ ./langchain-contextpilot rank-bm25)
"""

from __future__ import annotations

import os

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from rank_bm25 import BM25Okapi

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.whatif.datasets import load_multihop_rag
from langchain_contextpilot import ChatSGLang, ContextPilotRetriever, format_documents

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
if url:
    llm = ChatSGLang(model=os.environ.get("CONTEXTPILOT_MODEL", "default"), base_url=url + "/v1", max_tokens=64)
    chain = inputs | prompt | llm
    for n, question in enumerate(questions):
        answer = chain.invoke(question, config={"configurable": {"thread_id": "demo"}})
        cached = (answer.usage_metadata or {}).get("input_token_details", {}).get("cache_read")
        print(f"turn {n}: cached prompt tokens {cached}; answer: {answer.content[:200]!r}")
else:
    chain = inputs | prompt
    for n, question in enumerate(questions):
        text = chain.invoke(question, config={"configurable": {"thread_id": "demo"}}).to_string()
        print(f"--- turn {n} prompt (first 300 and last 400 characters) ---\n{text[:300]}\n...\n{text[-400:]}\n")
print(pilot.stats())
