"""The core's hosted-call helpers the adapters share: markers counted wherever a request
carries them, the caller's prompt_cache_key found wherever it was set, and a conversation's
key kept (bounded, thread-safe)."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.integration.call_plan import (
    MarkedCall,
    callers_cache_key,
    carried_markers,
    mark_bound_call,
    markers_left,
    plan_bound_call,
)
from contextpilot_integrations.pilot.binding import Binding
from contextpilot_integrations.providers.cache_key import ConversationKeys

MARK = {"type": "ephemeral"}


def test_markers_on_tools_and_the_top_level_take_slots() -> None:
    tools = [{"name": "a"}, {"name": "b", "cache_control": MARK}, SimpleNamespace(extras={"cache_control": MARK})]
    assert carried_markers("anthropic", tools=tools, settings=[{}, {"cache_control": MARK}]) == 3
    assert markers_left("anthropic", 1, tools=tools, settings=[{"cache_control": MARK}]) == 0
    assert markers_left("anthropic", 3, tools=tools) == 0  # never below zero
    assert carried_markers("bedrock", tools=[{"cachePoint": {"type": "default"}}]) == 1
    assert carried_markers("openai", tools=tools, settings=[{"cache_control": MARK}]) == 0  # not OpenAI's


def test_the_callers_key_is_found_wherever_it_was_set() -> None:
    assert (
        callers_cache_key({"prompt_cache_key": "call"}, SimpleNamespace(model_kwargs={"prompt_cache_key": "m"}))
        == "call"
    )
    assert callers_cache_key({}, SimpleNamespace(model_kwargs={"prompt_cache_key": "m"})) == "m"
    assert callers_cache_key({}, SimpleNamespace(prompt_cache_key="field")) == "field"
    assert callers_cache_key({}, SimpleNamespace(additional_kwargs={"prompt_cache_key": "li"})) == "li"
    assert callers_cache_key({}, SimpleNamespace(model_kwargs={})) is None


def test_a_conversation_keeps_its_first_key_and_the_map_is_bounded() -> None:
    keys = ConversationKeys(max_conversations=2)
    assert keys.key_for("a", lambda: "k1") == "k1"
    assert keys.key_for("a", lambda: "k2") == "k1"  # later requests: the first key
    assert keys.key_for("b", lambda: None) is None and len(keys) == 1  # nothing to keep
    keys.key_for("b", lambda: "kb")
    keys.key_for("c", lambda: "kc")
    assert len(keys) == 2 and keys.key_for("a", lambda: "new") == "new"  # the oldest went first
    with pytest.raises(ValueError, match="at least 1"):
        ConversationKeys(0)


def test_concurrent_first_requests_of_a_conversation_agree() -> None:
    keys = ConversationKeys()
    got: list[str | None] = []
    threads = [threading.Thread(target=lambda i=i: got.append(keys.key_for("c", lambda: f"k{i}"))) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(got)) == 1


def test_a_marked_call_is_counted_and_one_the_rules_do_not_cover_goes_out_unmarked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pilot = ContextPilot()
    blocks = [Block(id=str(i), text=f"document {i} " * 400) for i in range(3)]
    pilot.prepare(blocks, "q0")
    binding = Binding(pilot, pilot.prepare(blocks, "q1"))
    messages, kwargs = ["the prompt"], {"temperature": 0}
    plan = plan_bound_call(binding, "anthropic", "claude-sonnet-4-5", history_tokens=0, max_breakpoints=4)
    assert plan.markers
    sent = mark_bound_call(
        binding,
        messages,
        kwargs,
        lambda: MarkedCall(["the prompt, marked"], {"x": 1}, plan, plan.markers),
        logging.getLogger("adapter"),
    )
    assert sent == (["the prompt, marked"], {"x": 1})
    assert pilot.stats().cache_markers_placed == plan.markers

    def uncovered() -> MarkedCall[str]:
        raise ValueError("no rules for model 'unknown'")

    with caplog.at_level(logging.WARNING, logger="adapter"):
        unmarked = mark_bound_call(binding, messages, kwargs, uncovered, logging.getLogger("adapter"))
    assert unmarked == (messages, kwargs)
    assert pilot.stats().cache_markers_placed == plan.markers  # counted nothing
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("adapter", f"no cache markers for request {binding.prepared.request_id!r}: no rules for model 'unknown'")
    ]
