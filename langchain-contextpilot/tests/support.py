"""Shared test material: a real BM25 retriever over the bundled MultiHop-RAG chunks."""

from __future__ import annotations

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict
from rank_bm25 import BM25Okapi

from contextpilot_integrations.whatif.datasets import load_multihop_rag

CHUNKS = [chunk for _, chunk in zip(range(400), load_multihop_rag().chunks.values(), strict=False)]
_INDEX = BM25Okapi([chunk.text.lower().split() for chunk in CHUNKS])
QUERY = "Who is the individual associated with the cryptocurrency industry facing a criminal trial?"


class BM25ChunkRetriever(BaseRetriever):
    """BM25 over the first 400 bundled MultiHop-RAG chunks (real data, real ranking)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    k: int = 10
    max_chars: int | None = None

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        scores = _INDEX.get_scores(query.lower().split())
        best = sorted(range(len(CHUNKS)), key=lambda i: -scores[i])[: self.k]
        return [
            Document(
                id=CHUNKS[i].id,
                page_content=CHUNKS[i].text[: self.max_chars],
                metadata={"title": CHUNKS[i].metadata["title"]},
            )
            for i in best
        ]
