"""A real llama-server (tiny random-weight model) for the integration tests, or a skip.

``CONTEXTPILOT_REQUIRE_ENGINE=1`` (CI) fails instead of skipping without a binary.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from contextpilot_integrations.testing.audit import audited_bodies  # noqa: F401  (autouse: audits every body sent)
from contextpilot_integrations.testing.llama_server import LlamaServer, tiny_llama_server, tiny_llama_servers


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    server = tiny_llama_server(tmp_path_factory.mktemp("llama-lc"), pytest.skip)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LlamaServer]]:
    """Two llama-servers (one CPU thread each): replicas to route between."""
    with tiny_llama_servers(tmp_path_factory.mktemp("replicas"), pytest.skip, 2, threads=1) as servers:
        yield servers
