"""The real prefix-caching engine for the tests (``whatif.llama_server``), or a skip.

Set ``CONTEXTPILOT_REQUIRE_ENGINE=1`` (CI does) to fail instead of skip without a binary.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from contextpilot_integrations.whatif.llama_server import LlamaServer, free_port, tiny_llama_server

__all__ = ["LlamaServer", "free_port", "start_llama_server"]


def start_llama_server(workdir: Path, extra_args: tuple[str, ...] = (), **options: int) -> LlamaServer:
    return tiny_llama_server(workdir, pytest.skip, extra_args=extra_args, **options)
