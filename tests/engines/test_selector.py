"""The routing decision alone (issue 43: the router split by job): numbers in, a target out,
with no pilot, lock or engine: each rule of SGLang's ``cache_aware`` policy in its order."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from contextpilot_integrations.engines.selector import CacheAwarePolicy, select
from contextpilot_integrations.engines.targets import Target

A, B, C = (Target(name, f"http://127.0.0.1:{port}") for name, port in (("a", 1), ("b", 2), ("c", 3)))
TARGETS = [A, B, C]


def choose(**given: Any) -> tuple[str, str]:
    numbers: dict[str, Any] = {
        "up": {"a", "b", "c"},
        "loads": {"a": 0, "b": 0, "c": 0},
        "last_used": {"a": 0, "b": 0, "c": 0},
        "size": 100,
        "reuse": lambda target: 0,
    }
    target, reason = select(TARGETS, **{**numbers, **given})
    return target.name, reason


def test_each_rule_in_its_order() -> None:
    held = {"a": 0, "b": 80, "c": 40}
    assert choose(reuse=lambda t: held[t.name]) == ("b", "cache")
    assert choose(reuse=lambda t: held[t.name], sticky="c") == ("c", "conversation")
    assert choose(reuse=lambda t: held[t.name], loads={"a": 0, "b": 9, "c": 1}) == ("a", "balance")
    assert choose(reuse=lambda t: 10, last_used={"a": 5, "b": 3, "c": 4}) == ("b", "room")  # under the threshold
    assert choose(reuse=lambda t: held[t.name], up={"a", "c"}) == ("c", "cache")  # b is routed around
    assert choose(reuse=lambda t: held[t.name], exclude={"b"}) == ("c", "cache")  # b was tried


def test_a_request_no_cache_holds_goes_to_the_least_loaded() -> None:
    small = [Target(t.name, t.base_url, capacity_tokens=50) for t in TARGETS]
    target, reason = select(
        small, up={"a", "b", "c"}, loads={"a": 2, "b": 1, "c": 3}, last_used={}, size=100, reuse=lambda t: 100
    )
    assert (target.name, reason) == ("b", "oversized")


def test_the_baselines_and_the_thresholds() -> None:
    assert choose(routing="round_robin", turn=4) == ("b", "fixed")
    assert choose(routing="least_loaded", loads={"a": 3, "b": 2, "c": 2}) == ("b", "fixed")
    strict = CacheAwarePolicy(cache_threshold=0.9)
    assert choose(reuse=lambda t: 80 if t.name == "b" else 0, policy=strict)[1] == "room"


@given(
    loads=st.lists(st.integers(0, 20), min_size=3, max_size=3),
    held=st.lists(st.integers(0, 100), min_size=3, max_size=3),
    up=st.sets(st.sampled_from("abc")),
    exclude=st.sets(st.sampled_from("abc")),
)
def test_it_always_answers_and_prefers_a_target_up_and_not_tried(
    loads: list[int], held: list[int], up: set[str], exclude: set[str]
) -> None:
    names = "abc"
    name, reason = choose(
        loads=dict(zip(names, loads, strict=True)), reuse=lambda t: held[names.index(t.name)], up=up, exclude=exclude
    )
    allowed = set(names) - exclude
    if allowed & up:
        assert name in allowed & up
    elif allowed:
        assert name in allowed
    assert reason in {"balance", "cache", "room"}
