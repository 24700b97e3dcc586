from __future__ import annotations

import asyncio
import random
import re
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import (
    STRATEGIES,
    BatchRequest,
    Block,
    BlockTypeError,
    ContextPilot,
    DuplicateBlockError,
    DuplicateRequestError,
    InvalidBlockError,
    UnknownStrategyError,
    parse_order_annotation,
)

ALL = sorted(STRATEGIES)
retrievals = st.lists(st.lists(st.integers(0, 25), min_size=1, max_size=8, unique=True), min_size=1, max_size=20)


def as_blocks(ids: list[int]) -> list[Block]:
    """Blocks of about 100 tokens: large enough that reuse pays for the order annotation."""
    return [Block(id=str(i), text=f"text of block {i}. " * 20) for i in ids]


@pytest.mark.parametrize("strategy", ALL)
@settings(max_examples=40, deadline=None)
@given(batch=retrievals)
def test_prepare_is_a_permutation_and_the_annotation_rebuilds_the_ranking(
    strategy: str, batch: list[list[int]]
) -> None:
    pilot = ContextPilot(strategy, annotate_order=True)
    for ids in batch:
        prepared = pilot.prepare(as_blocks(ids), "q")
        assert sorted(b.id for b in prepared.blocks) == sorted(str(i) for i in ids)
        # the model can rebuild the ranking: from the annotation, or (without one) from the order itself
        annotation = prepared.order_annotation
        if prepared.labels:
            labels = parse_order_annotation(annotation) or [b.label for b in prepared.blocks]
        else:  # one text per block: the ranking restated by position
            positions = [int(p) for p in re.findall(r"#(\d+)", annotation)]
            labels = [prepared.blocks[p - 1].label for p in positions] or [b.label for b in prepared.blocks]
        assert labels == [str(i) for i in ids]
        assert prepared.cached_tokens <= prepared.block_tokens
    pilot.check()


@pytest.mark.parametrize("strategy", ALL)
@settings(max_examples=30, deadline=None)
@given(batch=retrievals)
def test_plan_is_a_permutation_paired_with_queries(strategy: str, batch: list[list[int]]) -> None:
    pilot = ContextPilot(strategy)
    planned = pilot.plan([(as_blocks(ids), f"query {n}") for n, ids in enumerate(batch)])
    assert sorted(p.batch_index for p in planned) == list(range(len(batch)))  # type: ignore[type-var]
    for prepared in planned:
        ids = batch[prepared.batch_index]  # type: ignore[index]
        assert prepared.query == f"query {prepared.batch_index}"
        assert sorted(b.id for b in prepared.blocks) == sorted(str(i) for i in ids)
    pilot.check()


def test_rendered_prefixes_are_byte_identical_across_conversations() -> None:
    pilot = ContextPilot(keep_top=False)  # the top block (4) may stay inside the shared prefix
    shared = as_blocks([1, 2, 3, 4])
    a = pilot.prepare(shared + as_blocks([10]), "first question", conversation_id="alice")
    b = pilot.prepare(list(reversed(shared)) + as_blocks([11]), "another question", conversation_id="bob")
    assert b.cached_blocks == 4
    prefix_a = a.render_context().split("\n\n")[:4]
    prefix_b = b.render_context().split("\n\n")[:4]
    assert prefix_a == prefix_b


def test_paper_section_6_through_the_pilot() -> None:
    # the paper's form: labels, references after the blocks, the ranking restated, any repeat referred to
    pilot = ContextPilot(plain_prompts=False, annotate_order=True, keep_top=False)
    pilot.prepare(as_blocks([1, 2, 4]), "turn 0", conversation_id="c")
    second = pilot.prepare(as_blocks([1, 5, 2]), "turn 1", conversation_id="c")
    assert [b.id for b in second.blocks] == ["5"]
    assert [r.text for r in second.references] == [
        "Please refer to [1] in the previous conversation.",
        "Please refer to [2] in the previous conversation.",
    ]
    assert parse_order_annotation(second.order_annotation) == ["1", "5", "2"]
    text = second.render()
    assert text.index("[5]") < text.index("Please refer") < text.index("priority order") < text.index("turn 1")
    # a dropped turn means the block is sent again: nothing is lost
    third = pilot.prepare(as_blocks([1, 5]), "turn 2", conversation_id="c", kept_turns=[1])
    assert [b.id for b in third.blocks] == ["1"] and [r.block.id for r in third.references] == ["5"]
    assert pilot.stats().blocks_referenced == 3


def seen_before(pilot: ContextPilot, blocks: list[Block]) -> None:
    """Another request carried these blocks (then left): they recur, so labelling them pays;
    a fresh pilot sends blocks nobody shared plain, as without ContextPilot."""
    pilot.discard(pilot.prepare(blocks, "seen before"))


def test_evict_and_reset_remove_predicted_hits() -> None:
    pilot = ContextPilot(keep_top=False)  # a reversed request follows the prefix, its top block inside
    seen_before(pilot, as_blocks([1, 2, 3]))
    first = pilot.prepare(as_blocks([1, 2, 3]), "q")
    assert pilot.prepare(as_blocks([3, 2, 1]), "q").cached_blocks == 3
    assert pilot.evict([first.request_id, "unknown"]) == 1
    assert pilot.prepare(as_blocks([1, 2, 3]), "q").cached_blocks == 3  # the second still holds it
    pilot.reset()
    assert pilot.stats().live_requests == 0 and pilot.stats().index_nodes == 0
    assert pilot.prepare(as_blocks([1, 2, 3]), "q").cached_blocks == 0
    pilot.check()


def test_truncate_keeps_the_rest_of_a_prefix() -> None:
    pilot = ContextPilot("retrieval")
    first = pilot.prepare(as_blocks([1, 2, 3]), "q")
    assert pilot.truncate(first.request_id, 1)
    assert pilot.prepare(as_blocks([1, 2, 3]), "q").cached_blocks == 1
    assert not pilot.truncate("nope", 1)
    with pytest.raises(ValueError):
        pilot.truncate(first.request_id, -1)


def test_stats_and_bounded_live_requests() -> None:
    pilot = ContextPilot(max_live_requests=10)
    for i in range(25):
        pilot.prepare(as_blocks([100, i]), "q")  # 100 leads every prompt: reused as sent
    stats = pilot.stats()
    assert stats.live_requests == 10 and stats.requests_evicted == 15 and stats.requests_prepared == 25
    assert stats.predicted_cached_blocks > 0 and 0 < stats.predicted_hit_ratio < 1
    pilot.check()


def test_many_non_overlapping_requests_then_overlapping_ones() -> None:
    pilot = ContextPilot()
    for i in range(1_500):
        pilot.prepare(as_blocks(list(range(i * 15 + 1_000, i * 15 + 1_015))), "q")
    again = pilot.prepare(as_blocks(list(range(1_000, 1_015))), "q")
    assert again.cached_blocks == 15 and pilot.stats().live_requests == 1_501


def test_default_plan_weighs_shared_blocks_by_their_tokens() -> None:
    # the first two requests share one long block; the last two share two short ones
    long, short = "long block " * 400, "short"
    batch = [
        [Block(id="L", text=long), Block(id="a", text=short + "a")],
        [Block(id="L", text=long), Block(id="x", text=short + "x"), Block(id="y", text=short + "y")],
        [Block(id="x", text=short + "x"), Block(id="y", text=short + "y"), Block(id="b", text=short + "b")],
    ]
    planned = ContextPilot().plan([(blocks, "q") for blocks in batch])
    assert sum(p.cached_tokens for p in planned) == Block(id="L", text=long).token_count
    assert [p.blocks[0].id for p in planned if p.batch_index in (0, 1)] == ["L", "L"]


def test_plan_keeps_turn_order_within_a_conversation() -> None:
    pilot = ContextPilot()
    items = [
        BatchRequest(blocks=as_blocks([1, 2, 3]), query="t0", conversation_id="c"),
        BatchRequest(blocks=as_blocks([7, 8]), query="other"),
        BatchRequest(blocks=as_blocks([1, 2, 9]), query="t1", conversation_id="c"),
        {"blocks": as_blocks([1, 2, 3, 4]), "query": "x"},
    ]
    planned = pilot.plan(items)
    turns = [p for p in planned if p.conversation_id == "c"]
    assert [p.query for p in turns] == ["t0", "t1"] and [p.turn for p in turns] == [0, 1]
    assert [r.block.id for r in turns[1].references] == ["2"]  # 1, the top block, goes out in full
    assert [b.id for b in turns[1].blocks] == ["9", "1"]  # after the history, the top block last


# ---- bad input: clear errors, nothing recorded -------------------------------------------
def test_empty_retrieval_is_a_plain_question() -> None:
    pilot = ContextPilot()
    prepared = pilot.prepare([], "What is up?")
    assert prepared.blocks == () and prepared.order_annotation == ""
    assert prepared.render() == "Question: What is up?"


@pytest.mark.parametrize(
    ("blocks", "error", "match"),
    [
        ([{"id": "a", "text": "A"}, {"id": "a", "text": "B"}], DuplicateBlockError, "different text"),
        ([{"id": "a"}], BlockTypeError, "no 'text'"),
        (["ok", b"bytes"], BlockTypeError, "block #1"),
        (["ok", ""], InvalidBlockError, "empty"),
        ("a string", BlockTypeError, "sequence"),
    ],
)
def test_bad_blocks_raise_and_record_nothing(blocks: object, error: type[Exception], match: str) -> None:
    pilot = ContextPilot()
    with pytest.raises(error, match=match):
        pilot.prepare(blocks, "q", conversation_id="c")  # type: ignore[arg-type]
    stats = pilot.stats()
    assert stats.requests_prepared == 0 and stats.live_requests == 0 and stats.conversations == 0


def test_blocks_without_ids_and_duplicates_are_kept() -> None:
    pilot = ContextPilot()
    prepared = pilot.prepare(["alpha", "beta", "alpha"], "q")
    assert [b.text for b in prepared.blocks] == ["alpha", "beta"] and len(prepared.merged_duplicates) == 1


def test_a_thousand_blocks() -> None:
    pilot = ContextPilot(plain_prompts=False, keep_top=False)  # labelled from the first: a 1,000-block prefix is
    blocks = as_blocks(list(range(1_000)))  # no bet worth its labels (every block must recur)
    first = pilot.prepare(blocks, "q")
    second = pilot.prepare(list(reversed(blocks)), "q")
    assert len(first.blocks) == 1_000 and second.cached_blocks == 1_000


def test_other_bad_arguments() -> None:
    with pytest.raises(UnknownStrategyError, match="known: paper, retrieval, trie"):
        ContextPilot("fastest")
    pilot = ContextPilot()
    with pytest.raises(BlockTypeError, match="query"):
        pilot.prepare(["a"], None)  # type: ignore[arg-type]
    pilot.prepare(["a"], "q", request_id="mine")
    with pytest.raises(DuplicateRequestError):
        pilot.prepare(["b"], "q", request_id="mine")
    with pytest.raises(TypeError, match="request #1"):
        pilot.plan([(["a"], "q"), 42])  # type: ignore[list-item]
    with pytest.raises(InvalidBlockError, match="request #0"):
        pilot.plan([([""], "q")])


# ---- concurrency ---------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ALL)
def test_threads_and_asyncio_tasks_share_one_pilot(strategy: str, multihop) -> None:
    pilot = ContextPilot(strategy, max_live_requests=300)
    queries = multihop.queries[:400]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for n in range(60):
                q = rng.choice(queries)
                cid = f"t{seed}-{n % 3}"
                prepared = pilot.prepare(multihop.blocks_for(q), q.text, conversation_id=cid)
                if rng.random() < 0.3:
                    pilot.evict([prepared.request_id])
                if rng.random() < 0.1:
                    pilot.truncate(rng.choice(pilot.live_request_ids() or ["none"]), 2)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    async def task(seed: int) -> int:
        rng = random.Random(1_000 + seed)
        turns = 0
        for _ in range(5):
            q = rng.choice(queries)
            prepared = await pilot.aprepare(multihop.blocks_for(q), q.text, conversation_id=f"a{seed}")
            assert prepared.turn == turns
            turns += 1
            if rng.random() < 0.3:
                pilot.evict([prepared.request_id])
            await asyncio.sleep(0)
        return turns

    async def all_tasks() -> list[int]:
        return await asyncio.gather(*(task(i) for i in range(100)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    turns = asyncio.run(all_tasks())
    for thread in threads:
        thread.join()
    assert not errors and turns == [5] * 100
    pilot.check()
    stats = pilot.stats()
    assert stats.requests_prepared == 8 * 60 + 100 * 5
    assert stats.conversations == 8 * 3 + 100


def test_aplan_runs_in_a_thread(multihop) -> None:
    pilot = ContextPilot()
    planned = asyncio.run(pilot.aplan([(multihop.blocks_for(q), q.text) for q in multihop.queries[:50]]))
    assert len(planned) == 50


def test_a_setting_changed_after_construction_counts() -> None:
    """The planner reads the pilot's settings at each decision (issue 32 split them apart)."""
    blocks = [Block(id="a", text="x" * 400), Block(id="b", text="y" * 400)]
    pilot = ContextPilot()
    assert not pilot.prepare(blocks, "q").labels
    pilot.plain_prompts = False  # the paper's form: every block labelled
    assert pilot.prepare(blocks, "q").labels


def test_a_forked_worker_makes_request_ids_no_other_process_makes() -> None:
    """A pilot made at import under ``gunicorn --preload`` lives on in every forked worker:
    each must send ids no other worker sends (the engine refuses a duplicate ``rid``)."""
    import os

    pilot = ContextPilot()
    before = pilot.prepare(["alpha text"], "q").request_id
    children = []
    for _ in range(3):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: the first ids it makes
            os.close(read)
            ids = [pilot.prepare([f"text {n}"], "q").request_id for n in range(2)]
            os.write(write, "\n".join(ids).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            children.append(pipe.read().split("\n"))
        assert os.waitpid(pid, 0)[1] == 0
    here = [pilot.prepare([f"text {n}"], "q").request_id for n in range(2)]
    every = [before, *here, *(rid for ids in children for rid in ids)]
    assert len(set(every)) == len(every) == 9
    prefixes = {rid.rsplit("-", 1)[0] for rid in every}
    assert len(prefixes) == 4  # the parent's, and one of each worker's own
