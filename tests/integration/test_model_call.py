"""One model call's protocol, in the core once (issue 43): what both adapters do before the
provider's call, when it is served and when it fails, checked here on a real pilot without a
framework (the adapters' suites check it through LangChain and LlamaIndex)."""

from __future__ import annotations

from collections.abc import Sequence

import httpx
import pytest

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.core.partitions import cache_partition
from contextpilot_integrations.errors import EngineUnavailable
from contextpilot_integrations.integration.model_call import EngineUsage, MessageTexts, ModelCall, id_fields
from contextpilot_integrations.pilot.binding import Binding, prepare_bound
from contextpilot_integrations.testing.invariants import dangling_references

DOCS = [Block(id=name, text=f"Document {name}: " + "words of it " * 40) for name in "abcd"]

TEXTS: MessageTexts[str, int] = MessageTexts(
    read=lambda messages: (list(messages), list(range(len(messages)))),
    rebuilt=lambda messages, texts, places: [texts[place] for place in places],
)
"""Messages that are plain strings: a framework's message types reduced to their texts."""


def second_turn(pilot: ContextPilot) -> tuple[Binding, str]:
    first = pilot.prepare(DOCS[:3], "q1", "chat")
    return prepare_bound(pilot, DOCS[:3], "q2", "chat"), first.render()


def test_before_writes_out_every_reference_the_messages_do_not_carry() -> None:
    pilot = ContextPilot()
    binding, shown = second_turn(pilot)
    assert binding.prepared.references  # the second turn refers to the first
    kept = ModelCall(binding).before([shown, binding.prepared.render()], TEXTS, {})
    dropped = ModelCall(binding).before([binding.prepared.render()], TEXTS, {})  # the caller cut the history
    assert dangling_references(kept) == dangling_references(dropped) == []
    assert len(dropped[0]) > len(binding.prepared.render())  # written out in full
    assert pilot.stats().references_restored > 0


def test_before_moves_the_request_to_the_partition_its_body_names() -> None:
    pilot = ContextPilot()
    binding = prepare_bound(pilot, DOCS[:2], "q")
    call = ModelCall(binding)
    call.before([binding.prepared.render()], TEXTS, {"cache_salt": "tenant"})
    assert call.binding is not None and call.binding.prepared.partition == cache_partition(salt="tenant")
    assert pilot.predicted_cached_blocks(["a", "b"], cache_partition(salt="tenant")) == 2
    assert pilot.predicted_cached_blocks(["a", "b"]) == 0


def test_served_reports_to_the_requests_pilot_and_failed_forgets_it() -> None:
    pilot = ContextPilot()
    served = ModelCall(prepare_bound(pilot, DOCS[:2], "q"))
    served.served(EngineUsage(prompt_tokens=300, cached_tokens=0), usage_feedback=True)
    assert pilot.stats().engine_requests == 1
    retaken: list[Binding] = []
    failing = ModelCall(prepare_bound(pilot, DOCS[2:], "q2"), retake=retaken.append)
    error = httpx.ConnectError("refused")
    assert failing.failed(error) is error  # no caller named: raised as it is
    assert failing.binding is not None and failing.binding.prepared.request_id not in pilot.live_request_ids()
    assert retaken == [failing.binding]
    assert isinstance(ModelCall(None).failed(error, "SGLangLLM"), EngineUnavailable)  # a broken connection
    assert ModelCall(None).failed(httpx.ReadTimeout("slow"), "SGLangLLM").__class__ is httpx.ReadTimeout


@pytest.mark.parametrize(("engine", "names"), [("sglang", ("rid", "session_id")), ("vllm", ("request_id",))])
def test_the_request_id_goes_in_the_engines_own_fields(engine: str, names: Sequence[str]) -> None:
    pilot = ContextPilot()
    call = ModelCall(prepare_bound(pilot, DOCS[:2], "q"))
    fields = call.id_fields(engine, {"top_k": 5}, prompt_ids=False)
    assert fields == {"top_k": 5, **dict.fromkeys(names, call.request_id)}
    unbound = ModelCall(None)
    assert unbound.request_id.startswith("cp-") and unbound.request_id != ModelCall(None).request_id
    assert id_fields("llamacpp", unbound.request_id, None, prompt_ids=False) == {}
