"""LangChain's standard unit suite for the chat model, and its request id."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_contextpilot import ChatSGLang


class TestChatSGLangStandard(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatSGLang]:
        return ChatSGLang

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "tiny", "base_url": "http://127.0.0.1:9/v1"}


def test_request_id_goes_out_as_rid_and_session_id() -> None:
    llm = ChatSGLang(model="tiny", base_url="http://127.0.0.1:9/v1")
    payload = llm._with_rid({"metadata": {"contextpilot_request_id": "cp-7"}}, {"extra_body": {"top_k": 1}})
    assert payload["extra_body"] == {"top_k": 1, "rid": "cp-7", "session_id": "cp-7"}


def test_no_api_key_is_needed_and_none_is_borrowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-secret")  # never sent to another server
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    assert ChatSGLang(model="tiny", base_url="http://127.0.0.1:9/v1").openai_api_key.get_secret_value() == "EMPTY"
    monkeypatch.setenv("SGLANG_API_KEY", "from-env")
    assert ChatSGLang(model="tiny").openai_api_key.get_secret_value() == "from-env"
    assert ChatSGLang(model="tiny", api_key="mine").openai_api_key.get_secret_value() == "mine"
