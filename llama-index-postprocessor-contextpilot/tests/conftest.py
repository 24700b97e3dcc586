"""Real LlamaIndex objects over the bundled MultiHop-RAG chunks, and a real llama-server.

``MockEmbedding`` and ``MockLLM`` stand in for models offline (no model can run here
without a download). ``CONTEXTPILOT_REQUIRE_ENGINE=1`` (CI) fails instead of skipping
when llama-server is not built.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from llama_index.core import Settings, VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.llms import MockLLM
from llama_index.core.schema import TextNode

from contextpilot_integrations.testing.audit import audited_bodies  # noqa: F401  (autouse: audits every body sent)
from contextpilot_integrations.testing.llama_server import LlamaServer, tiny_llama_server, tiny_llama_servers
from contextpilot_integrations.whatif.datasets import load_multihop_rag


@pytest.fixture(scope="session")
def index() -> VectorStoreIndex:
    Settings.embed_model = MockEmbedding(embed_dim=8)
    Settings.llm = MockLLM()
    chunks = list(load_multihop_rag().chunks.values())[:40]
    nodes = [TextNode(id_=c.id, text=c.text[:500], metadata={"title": c.metadata["title"]}) for c in chunks]
    return VectorStoreIndex(nodes)


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    server = tiny_llama_server(tmp_path_factory.mktemp("llama-li"), pytest.skip)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LlamaServer]]:
    """Two llama-servers (one CPU thread each): replicas to route between."""
    with tiny_llama_servers(tmp_path_factory.mktemp("replicas"), pytest.skip, 2, threads=1) as servers:
        yield servers
