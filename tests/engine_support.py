"""The real prefix-caching engine for the tests (``testing.llama_server``), or a skip; and
:func:`serve_quietly` for the stand-ins of broken or hostile servers.

Set ``CONTEXTPILOT_REQUIRE_ENGINE=1`` (CI does) to fail instead of skip without a binary.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from contextpilot_integrations.testing.fake_http import serve_handler
from contextpilot_integrations.testing.llama_server import LlamaServer, free_port, tiny_llama_server, tiny_llama_servers

__all__ = ["LlamaServer", "free_port", "serve_quietly", "start_llama_server", "start_llama_servers"]


def start_llama_server(workdir: Path, extra_args: tuple[str, ...] = (), **options: int) -> LlamaServer:
    return tiny_llama_server(workdir, pytest.skip, extra_args=extra_args, **options)


def start_llama_servers(workdir: Path, count: int, **options: int) -> AbstractContextManager[list[LlamaServer]]:
    return tiny_llama_servers(workdir, pytest.skip, count, **options)


@contextmanager
def serve_quietly(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler`` served on 127.0.0.1 in a thread (clients that hang up are no error); yields
    its base URL."""
    with serve_handler(handler, "stand-in", quiet=True) as url:
        yield url
