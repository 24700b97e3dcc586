"""The core's hosted-call helpers the adapters share: markers counted wherever a request
carries them, the caller's prompt_cache_key found wherever it was set, and a conversation's
key kept (bounded, thread-safe)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from contextpilot_integrations.providers.cache_key import ConversationKeys
from contextpilot_integrations.providers.call_plan import callers_cache_key, carried_markers, markers_left

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
