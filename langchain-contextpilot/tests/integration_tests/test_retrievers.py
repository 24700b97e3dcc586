"""LangChain's standard retriever suite on the wrapper around a real BM25 retriever."""

from __future__ import annotations

from typing import Any

from langchain_tests.integration_tests import RetrieversIntegrationTests

from contextpilot_integrations import ContextPilot
from langchain_contextpilot import ContextPilotRetriever
from tests.support import QUERY, BM25ChunkRetriever


class TestContextPilotRetrieverStandard(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[ContextPilotRetriever]:
        return ContextPilotRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"base_retriever": BM25ChunkRetriever(k=10), "pilot": ContextPilot()}

    @property
    def retriever_query_example(self) -> str:
        return QUERY
