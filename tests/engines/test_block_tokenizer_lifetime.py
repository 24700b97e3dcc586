"""A BlockTokenizer that made its own HTTP client closes it when it is collected: the chat
models that own one (ChatSGLang, SGLangLLM) have no close() a user would call."""

from __future__ import annotations

import gc

import httpx

from contextpilot_integrations.engines.client import BlockTokenizer


def test_its_own_client_closes_when_the_tokenizer_goes() -> None:
    tokenizer = BlockTokenizer("http://127.0.0.1:9/v1", "sglang")
    client = tokenizer._own_client()
    assert isinstance(client, httpx.Client) and not client.is_closed
    del tokenizer
    gc.collect()
    assert client.is_closed
