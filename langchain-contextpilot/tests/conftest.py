"""A real llama-server (tiny random-weight model) for the integration tests, or a skip.

``CONTEXTPILOT_REQUIRE_ENGINE=1`` (CI) fails instead of skipping without a binary.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from contextpilot_integrations.whatif.llama_server import LlamaServer, llama_server_binary, write_tiny_gguf


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    binary = llama_server_binary()
    if binary is None:
        if os.environ.get("CONTEXTPILOT_REQUIRE_ENGINE"):
            raise RuntimeError("llama-server not found; run scripts/build_llama_server.sh")
        pytest.skip("llama-server not built; ./run.sh test builds it")
    workdir = tmp_path_factory.mktemp("llama-lc")
    server = LlamaServer(binary, write_tiny_gguf(workdir / "tiny.gguf"), workdir / "llama-server.log")
    yield server
    server.stop()
