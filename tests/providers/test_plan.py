"""Cache plans: markers where the shared prefix ends, within each provider's rules (pilots label
every block here, ``plain_prompts=False``: requests with the same leading blocks share their text)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import Block, ContextPilot, PreparedRequest
from contextpilot_integrations.providers import cache_rules, plan_cache, prompt_cache_key
from contextpilot_integrations.providers.cache_key import KEY_BUCKETS


def _blocks(ids: list[str], tokens: int = 600) -> list[Block]:
    return [Block(id=i, text=f"text of {i}", tokens=tokens) for i in ids]


def _prepared(ids: list[str], tokens: int = 600, cached: int = 0) -> PreparedRequest:
    blocks = tuple(_blocks(ids, tokens))
    return PreparedRequest("r", "q", blocks, ranking=blocks, cached_blocks=cached)


def test_marker_right_after_the_predicted_shared_prefix() -> None:
    pilot = ContextPilot(plain_prompts=False)
    first = pilot.prepare(_blocks(["a", "b", "c", "d", "e", "f"]), "q1")
    second = pilot.prepare(_blocks(["a", "b", "c", "x", "y", "z"]), "q2")
    assert [b.id for b in second.blocks[:3]] == ["a", "b", "c"] and second.cached_blocks == 3
    plan = plan_cache(second, "anthropic", "claude-sonnet-4-5", speculate_blocks=0)
    assert plan.block_breakpoints == (2,)  # right after "c", the third block
    assert plan.skipped is None and plan.prompt_cache_key is None
    # prepared online, it also marks a block further, for a follower that shares more
    assert {2, 3} <= set(plan_cache(second, "anthropic", "claude-sonnet-4-5").block_breakpoints)
    # writing ahead marks the end of the blocks too (the default in a conversation)
    assert 5 in plan_cache(second, "anthropic", write_ahead=True).block_breakpoints
    chat = ContextPilot(plain_prompts=False).prepare(_blocks(["a", "b", "c"]), "q", "conversation-1")
    assert plan_cache(chat, "anthropic", speculate_blocks=0).block_breakpoints == (2,)
    # the index also tells the first request where the second one's shared part ends
    assert pilot.shared_depths(first) == (3,)
    assert 2 in plan_cache(first, "anthropic", shared_depths=pilot.shared_depths(first)).block_breakpoints


def test_bedrock_plans_like_anthropic_with_its_own_minimums() -> None:
    prepared = _prepared(["a", "b", "c", "d"], tokens=600, cached=4)
    assert 3 in plan_cache(prepared, "bedrock", "us.anthropic.claude-sonnet-4-5-20250929-v1:0").block_breakpoints
    # Opus 4.7 needs 2,048 tokens on Anthropic but 4,096 on Bedrock
    assert plan_cache(prepared, "anthropic", "claude-opus-4-7").block_breakpoints
    skipped = plan_cache(prepared, "bedrock", "anthropic.claude-opus-4-7")
    assert skipped.block_breakpoints == ()
    assert skipped.skipped == "below minimum 4096 tokens for anthropic.claude-opus-4-7"


@pytest.mark.parametrize("provider", ["anthropic", "bedrock"])
def test_no_marker_below_the_minimum_and_the_plan_says_why(provider: str) -> None:
    prepared = _prepared(["a", "b"], tokens=300, cached=1)
    plan = plan_cache(prepared, provider, "claude-haiku-4-5")  # type: ignore[arg-type]
    assert plan.block_breakpoints == () and not plan.mark_history and not plan.mark_prefix
    assert plan.skipped == "below minimum 4096 tokens for claude-haiku-4-5"
    pilot = ContextPilot(plain_prompts=False)
    pilot.note_cache_plan(plan)
    assert pilot.stats().cache_plans_skipped == {plan.skipped: 1}


def test_a_marker_below_the_minimum_is_dropped_but_a_longer_one_kept() -> None:
    prepared = _prepared(["a", "b", "c", "d"], tokens=400, cached=1)  # 400 tokens shared: too short
    plan = plan_cache(prepared, "anthropic", "claude-sonnet-4-5", write_ahead=True, ladder=False, speculate_blocks=0)
    assert plan.block_breakpoints == (3,)  # only the end of the blocks (1,600 tokens) qualifies
    unmarked = plan_cache(prepared, "anthropic", "claude-sonnet-4-5", speculate_blocks=0)
    assert unmarked.skipped == "below minimum 1024 tokens for claude-sonnet-4-5"
    # speculating 2 blocks past the shared one reaches 1,200 tokens: that one is kept
    assert plan_cache(prepared, "anthropic", "claude-sonnet-4-5", speculate_blocks=2).block_breakpoints == (2,)
    assert plan_cache(prepared, "anthropic", "claude-sonnet-4-5").skipped is not None  # 1 block: 800 tokens


def test_history_marker_counts_toward_the_limit() -> None:
    prepared = _prepared([f"b{i}" for i in range(12)], tokens=500, cached=4)
    plan = plan_cache(prepared, "anthropic", prefix_tokens=100, history_tokens=2000)
    assert plan.mark_history and plan.markers <= 4 and len(plan.block_breakpoints) <= 3


def test_nothing_shared_and_nothing_to_mark() -> None:
    plan = plan_cache(_prepared([], cached=0), "anthropic")
    assert plan.markers == 0 and plan.skipped == "nothing shared"


def test_long_shared_prefix_gets_a_marker_within_the_look_back() -> None:
    prepared = _prepared([f"b{i}" for i in range(50)], tokens=100, cached=45)
    plan = plan_cache(prepared, "anthropic", "claude-sonnet-4-5", write_ahead=False, ladder=False)
    depths = sorted(b + 1 for b in plan.block_breakpoints)
    assert 45 in depths
    marks = [0, *depths]
    assert all(b - a <= 20 for a, b in itertools.pairwise(marks)), depths


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3000), min_size=0, max_size=60),
    shared=st.lists(st.integers(0, 60), max_size=8),
    history=st.integers(0, 5000),
    prefix=st.integers(0, 3000),
    allowed=st.integers(0, 6),
    ahead=st.sampled_from([None, True, False]),
    model=st.sampled_from(["claude-sonnet-4-5", "claude-haiku-4-5", "claude-opus-5", "nova-pro", None]),
    provider=st.sampled_from(["anthropic", "bedrock"]),
)
def test_plans_obey_the_provider_rules(
    sizes: list[int],
    shared: list[int],
    history: int,
    prefix: int,
    allowed: int,
    ahead: bool | None,
    model: str | None,
    provider: str,
) -> None:
    blocks = tuple(Block(id=f"b{i}", text="t", tokens=size) for i, size in enumerate(sizes))
    prepared = PreparedRequest("r", "q", blocks, ranking=blocks)
    plan = plan_cache(
        prepared,
        provider,  # type: ignore[arg-type]
        model,
        prefix_tokens=prefix,
        history_tokens=history,
        max_breakpoints=allowed,
        shared_depths=[d for d in shared if d <= len(sizes)],
        write_ahead=ahead,
    )
    rules = cache_rules(provider, model)  # type: ignore[arg-type]
    assert plan.markers <= min(4, allowed)
    assert len(set(plan.block_breakpoints)) == len(plan.block_breakpoints)
    for index in plan.block_breakpoints:  # every marker closes a prefix the provider caches
        assert 0 <= index < len(sizes)
        assert prefix + history + sum(sizes[: index + 1]) >= rules.min_tokens
    if plan.mark_history:
        assert history > 0 and prefix + history >= rules.min_tokens
    assert (plan.markers == 0) == (plan.skipped is not None)


def test_openai_key_is_shared_by_requests_that_share_leading_blocks() -> None:
    pilot = ContextPilot(plain_prompts=False)
    first = pilot.prepare(_blocks(["a", "b", "c"]), "q1")
    second = pilot.prepare(_blocks(["a", "b", "x"]), "q2")
    other = pilot.prepare(_blocks(["m", "n"]), "q3")
    keys = [plan_cache(p, "openai", "gpt-5").prompt_cache_key for p in (first, second, other)]
    assert keys[0] is not None and keys[0] == keys[1] != keys[2]
    assert plan_cache(first, "openai").block_breakpoints == ()


def test_openai_below_1024_tokens_says_so() -> None:
    plan = plan_cache(_prepared(["a"], tokens=500), "openai", "gpt-5")
    assert plan.skipped == "below minimum 1024 tokens for gpt-5" and plan.prompt_cache_key is not None


def test_gemini_has_nothing_to_mark() -> None:
    plan = plan_cache(_prepared(["a", "b", "c", "d"], tokens=1000, cached=2), "gemini")
    assert plan.markers == 0 and plan.prompt_cache_key is None and plan.skipped is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text("abcdefghij", min_size=1, max_size=6), min_size=1, max_size=5), st.integers(0, 400))
def test_key_depends_only_on_the_leading_blocks(ids: list[str], prefix: int) -> None:
    head = _blocks(ids[:1], tokens=300)
    key = prompt_cache_key([*head, *_blocks(["tail-1"])], prefix)
    assert key == prompt_cache_key([*head, *_blocks(["tail-2", "tail-3"])], prefix)
    assert key is not None and int(key.removeprefix("cp-"), 16) < KEY_BUCKETS


def test_key_cardinality_is_bounded() -> None:
    keys = {prompt_cache_key(_blocks([f"doc-{i}"]), buckets=16) for i in range(2000)}
    assert len(keys) <= 16
    assert prompt_cache_key([]) is None
    with pytest.raises(ValueError, match="buckets"):
        prompt_cache_key(_blocks(["a"]), buckets=0)


def test_bad_arguments_raise() -> None:
    prepared = _prepared(["a"])
    with pytest.raises(ValueError, match="provider"):
        plan_cache(prepared, "azure")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefix_tokens"):
        plan_cache(prepared, "anthropic", prefix_tokens=-1)
    with pytest.raises(TypeError, match="shared_depths"):
        plan_cache(prepared, "anthropic", shared_depths=[1.5])  # type: ignore[list-item]


def test_openai_gpt_5_6_takes_explicit_breakpoints_and_a_key() -> None:
    pilot = ContextPilot(plain_prompts=False)
    pilot.prepare(_blocks(["a", "b", "c", "d"]), "q1")
    second = pilot.prepare(_blocks(["a", "b", "c", "x"]), "q2")
    plan = plan_cache(second, "openai", "gpt-5.6-terra")
    assert 2 in plan.block_breakpoints and plan.prompt_cache_key is not None
    assert plan.explicit_only and plan.markers <= 4  # no managed breakpoint: all 4 writes are ours
    chat = ContextPilot(plain_prompts=False).prepare(_blocks(["a", "b", "c"]), "q", "conversation-1")
    in_chat = plan_cache(chat, "openai", "gpt-5.6-terra", history_tokens=2000)
    assert not in_chat.explicit_only and in_chat.markers <= 3  # the managed one takes the 4th write
    older = plan_cache(second, "openai", "gpt-5")
    assert older.block_breakpoints == () and not older.explicit_only
