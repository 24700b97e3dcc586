"""LangChain's standard unit suite for the chat model, and its request id."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_openai import ChatOpenAI
from langchain_tests.unit_tests import ChatModelUnitTests

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.pilot.binding import Binding
from langchain_contextpilot import ChatSGLang, ContextPilotChatModel
from langchain_contextpilot._model_calls import with_ids


class TestChatSGLangStandard(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatSGLang]:
        return ChatSGLang

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "tiny", "base_url": "http://127.0.0.1:9/v1"}


def test_request_id_goes_out_as_rid_and_session_id() -> None:
    pilot = ContextPilot()
    binding = Binding(pilot, pilot.prepare([Block(id="a", text="alpha")], "q"))
    payload = with_ids("sglang", binding, {"extra_body": {"top_k": 1}}, {"seed": 3}, prompt_ids=False)
    rid = binding.prepared.request_id
    assert payload["extra_body"] == {"seed": 3, "top_k": 1, "rid": rid, "session_id": rid}
    fresh = [with_ids("vllm", None, {}, None, prompt_ids=False)["extra_body"]["request_id"] for _ in range(2)]
    assert fresh[0] != fresh[1] and all(f.startswith("cp-") for f in fresh)  # unbound: a new id each call
    assert with_ids(None, binding, {"temperature": 0}, None, prompt_ids=False) == {"temperature": 0}  # hosted: none


def test_no_api_key_is_needed_and_none_is_borrowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-secret")  # never sent to another server
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    assert ChatSGLang(model="tiny", base_url="http://127.0.0.1:9/v1").openai_api_key.get_secret_value() == "EMPTY"
    monkeypatch.setenv("SGLANG_API_KEY", "from-env")
    assert ChatSGLang(model="tiny").openai_api_key.get_secret_value() == "from-env"
    assert ChatSGLang(model="tiny", api_key="mine").openai_api_key.get_secret_value() == "mine"


@pytest.mark.parametrize("retries", [None, 2])
def test_a_model_retrying_inside_a_call_is_refused_where_it_would_resend_the_id(retries: int | None) -> None:
    """An SDK retry sends the same body, request id and all (the audit saw it: a stale
    connection retried by ChatOpenAI's default client), and an engine still running the
    first attempt (a time-out) refuses it (SGLang: "Duplicate request ID")."""
    url = "http://127.0.0.1:9/v1"
    retrying = ChatOpenAI(model="tiny", base_url=url, api_key="x", max_retries=retries)
    with pytest.raises(ValueError, match=r"ChatOpenAI retries inside a call .* max_retries=0 and retry with"):
        ContextPilotChatModel(llm=retrying, engine="sglang")
    assert ContextPilotChatModel(llm=retrying).engine is None  # no id in the body: its retries are its own
    once = ChatOpenAI(model="tiny", base_url=url, api_key="x", max_retries=0)
    assert ContextPilotChatModel(llm=once, engine="vllm").llm is once


@pytest.mark.parametrize("name", ["server", "backend", "enigne"])
def test_a_misplaced_or_misspelt_argument_is_refused_not_sent_in_the_body(name: str) -> None:
    """ChatOpenAI moves an unknown name into ``model_kwargs``, which goes out in the request
    body; ChatSGLang refuses it, naming the one it takes."""
    with pytest.raises(ValueError, match=f"ChatSGLang got an unknown argument '{name}'") as caught:
        ChatSGLang(model="tiny", base_url="http://127.0.0.1:9/v1", **{name: "vllm"})
    assert "engine" in str(caught.value)
    assert ChatSGLang(model="tiny", base_url="http://127.0.0.1:9/v1", engine="vllm").engine == "vllm"
