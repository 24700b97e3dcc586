"""The bundled MultiHop-RAG sample: real news chunks and a real BM25 top-15 trace.

Source: MultiHop-RAG (Tang & Yang, COLM 2024), ODC-BY 1.0; see ``data/README.md``.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from ..core.blocks import Block

__all__ = ["MultiHopRAG", "RetrievalQuery", "load_multihop_rag"]

_CHUNKS = "multihop_rag_tok1024_chunks.jsonl.gz"
_TRACE = "multihop_rag_tok1024_bm25_top15.jsonl.gz"


@dataclass(frozen=True, slots=True)
class RetrievalQuery:
    """One query of the trace with its retrieved chunk ids, best first."""

    qid: int
    text: str
    answer: str
    question_type: str
    retrieved: tuple[str, ...]
    scores: tuple[float, ...]
    evidence_urls: tuple[str, ...]


@dataclass(frozen=True)
class MultiHopRAG:
    """Chunks by id (as :class:`Block`) and the queries of the retrieval trace."""

    chunks: dict[str, Block]
    queries: tuple[RetrievalQuery, ...]

    def blocks_for(self, query: RetrievalQuery) -> list[Block]:
        """The query's retrieved chunks as blocks, best first (ranked by position)."""
        return [self.chunks[cid] for cid in query.retrieved]

    def __iter__(self) -> Iterator[RetrievalQuery]:
        return iter(self.queries)


def _read_jsonl(name: str) -> Iterator[dict[str, Any]]:
    source = resources.files("contextpilot_integrations.whatif.data").joinpath(name)
    with source.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        for line in lines:
            yield json.loads(line)


@lru_cache(maxsize=1)
def load_multihop_rag() -> MultiHopRAG:
    """Load the bundled sample (1,704 chunks, 2,556 queries); cached after the first call."""
    chunks = {
        str(row["chunk_id"]): Block(
            id=str(row["chunk_id"]),
            text=row["text"],
            tokens=max(1, int(row["n_tokens"])),
            metadata={"title": row["title"], "source": row["source"], "url": row["url"]},
        )
        for row in _read_jsonl(_CHUNKS)
    }
    queries = tuple(
        RetrievalQuery(
            qid=int(row["qid"]),
            text=row["text"],
            answer=row["answer"],
            question_type=row["question_type"],
            retrieved=tuple(str(cid) for cid in row["top_k_doc_id"]),
            scores=tuple(float(s) for s in row["scores"]),
            evidence_urls=tuple(row["evidence_urls"]),
        )
        for row in _read_jsonl(_TRACE)
    )
    return MultiHopRAG(chunks=chunks, queries=queries)
