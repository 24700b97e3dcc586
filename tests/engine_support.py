"""The real prefix-caching engine for the tests (``whatif.llama_server``), or a skip.

Set ``CONTEXTPILOT_REQUIRE_ENGINE=1`` (CI does) to fail instead of skip without a binary.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from contextpilot_integrations.whatif.llama_server import LlamaServer, free_port, tiny_llama_server, tiny_llama_servers

__all__ = ["LlamaServer", "free_port", "start_llama_server", "start_llama_servers"]


def start_llama_server(workdir: Path, extra_args: tuple[str, ...] = (), **options: int) -> LlamaServer:
    return tiny_llama_server(workdir, pytest.skip, extra_args=extra_args, **options)


def start_llama_servers(workdir: Path, count: int, **options: int) -> AbstractContextManager[list[LlamaServer]]:
    return tiny_llama_servers(workdir, pytest.skip, count, **options)
