"""One name per concept: ``engine=`` says which engine a call's id fields are for, in both LLM
classes, and an argument a class does not take is refused, never silently dropped (on vLLM,
SGLang's id fields would go out and nothing would come back). Real LlamaIndex objects against
a local fake of the OpenAI API over real HTTP (it records every body)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from llama_index.core import VectorStoreIndex
from llama_index.llms.openai_like import OpenAILike

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.testing.fake_openai import fake_openai
from llama_index.postprocessor.contextpilot import ContextPilotLLM, ContextPilotPostprocessor, SGLangLLM
from tests.support import QUESTION

NOWHERE = "http://127.0.0.1:9/v1"


def wrapped(api_base: str) -> OpenAILike:
    return OpenAILike(
        model="tiny", api_base=api_base, api_key="x", is_chat_model=True, max_retries=0, context_window=8192
    )


BUILDS: dict[str, Callable[..., Any]] = {
    "SGLangLLM": lambda api_base, **options: SGLangLLM(model="tiny", api_base=api_base, context_window=8192, **options),
    "ContextPilotLLM": lambda api_base, **options: ContextPilotLLM(llm=wrapped(api_base), **options),
}


@pytest.mark.parametrize("cls", list(BUILDS))
def test_engine_vllm_sends_vllms_id_field_and_reports_back(index: VectorStoreIndex, cls: str) -> None:
    with fake_openai() as fake:
        pilot = ContextPilot()
        llm = BUILDS[cls](fake.base_url, engine="vllm")
        engine = index.as_query_engine(
            llm=llm, similarity_top_k=3, node_postprocessors=[ContextPilotPostprocessor(pilot=pilot)]
        )
        engine.query(QUESTION)
        body = fake.requests[-1]
        assert body.get("request_id") == pilot.live_request_ids()[0]
        assert "rid" not in body and "session_id" not in body  # SGLang's fields: not on vLLM
        assert pilot.stats().engine_requests == 1


@pytest.mark.parametrize("cls", list(BUILDS))
@pytest.mark.parametrize("name", ["server", "backend", "enigne"])
def test_a_misplaced_or_misspelt_engine_argument_is_refused(cls: str, name: str) -> None:
    with pytest.raises(ValueError, match=f"{cls} got an unknown argument '{name}'") as caught:
        BUILDS[cls](NOWHERE, **{name: "vllm"})
    assert "engine" in str(caught.value)


@pytest.mark.parametrize("cls", list(BUILDS))
def test_an_unknown_engine_or_argument_is_refused_and_known_ones_kept(cls: str) -> None:
    with pytest.raises(ValueError, match=r"engine must be one of \['sglang', 'vllm', 'llamacpp', 'openai'\]"):
        BUILDS[cls](NOWHERE, engine="vlm")
    with pytest.raises(ValueError, match=f"{cls} got an unknown argument 'usage_fedback'.*'usage_feedback'"):
        BUILDS[cls](NOWHERE, usage_fedback=False)
    assert BUILDS[cls](NOWHERE, engine="llamacpp", usage_feedback=False).engine == "llamacpp"


def test_sglang_llm_takes_what_openai_like_takes() -> None:
    with httpx.Client() as client:
        llm = SGLangLLM(
            model="tiny", api_base=NOWHERE, http_client=client, default_headers={"X-Team": "a"}, is_chat_model=True
        )
        assert llm.engine == "sglang" and llm.default_headers == {"X-Team": "a"}
    with pytest.raises(ValueError, match=r"unknown argument 'temprature' \(did you mean 'temperature'\?\)"):
        SGLangLLM(model="tiny", api_base=NOWHERE, temprature=0.0)
