"""The real prefix-caching engine for the tests (``whatif.llama_server``), or a skip.

Set ``CONTEXTPILOT_REQUIRE_ENGINE=1`` (CI does) to fail instead of skip without a binary.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from contextpilot_integrations.whatif.llama_server import LlamaServer, free_port, llama_server_binary, write_tiny_gguf

__all__ = ["LlamaServer", "free_port", "start_llama_server"]


def start_llama_server(workdir: Path, extra_args: tuple[str, ...] = (), **options: int) -> LlamaServer:
    binary = llama_server_binary()
    if binary is None:
        if os.environ.get("CONTEXTPILOT_REQUIRE_ENGINE"):
            raise RuntimeError("llama-server not found; run scripts/build_llama_server.sh")
        pytest.skip("llama-server not built; ./run.sh test builds it")
    model = workdir / "tiny.gguf"
    if not model.exists():
        write_tiny_gguf(model)
    return LlamaServer(binary, model, workdir / "llama-server.log", extra_args, **options)
