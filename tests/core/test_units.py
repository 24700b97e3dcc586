"""One unit for everything the send decision weighs, pages, and the engine's pool (issue 29:
a pilot that knows the engine). The tiny models read one token a character, so ``len`` is
their tokenizer here; the engine's own ``/tokenize`` is tested in tests/engines."""

from __future__ import annotations

import threading

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.core.annotations import DEFAULT_TEMPLATES, render_position_order
from contextpilot_integrations.core.gain import choose_order, page_margin
from contextpilot_integrations.core.units import TokenUnits
from contextpilot_integrations.pilot import BatchRequest


def docs(prefix: str, count: int, chars: int) -> list[Block]:
    return [Block(id=f"{prefix}{n}", text=(f"{prefix}{n} " * chars)[:chars]) for n in range(count)]


def test_blocks_without_tokens_are_counted_with_the_pilots_counter() -> None:
    blocks = [*docs("a", 3, 200), Block(id="given", text="x" * 200, tokens=7)]
    prepared = ContextPilot(token_counter=len).prepare(blocks, "q")
    assert [block.token_count for block in prepared.blocks] == [200, 200, 200, 7]  # a given count is kept
    assert [block.token_count for block in ContextPilot().prepare(blocks, "q").blocks] == [50, 50, 50, 7]


def test_a_reorder_is_weighed_in_the_engines_units() -> None:
    """The tiny models read a token a character: one shared block of 80 characters is 80
    tokens, the annotation 63. Weighed in one unit, the reorder pays; with the block
    estimated at four characters a token (20) against the annotation counted (63), it
    would not be made."""
    shared = Block(id="s", text="sssssss " * 10)
    rest = [Block(id=f"b{n}", text=f"block{n} " * 10) for n in range(4)]
    pilot = ContextPilot(token_counter=len, annotate_order=True, keep_top=False)  # the annotation priced in
    pilot.prepare([shared, *(Block(id=f"c{n}", text=f"other{n} " * 10) for n in range(4))], "q")
    second = pilot.prepare([*rest, shared], "q")
    annotation = render_position_order([*rest, shared], [shared, *rest], DEFAULT_TEMPLATES)
    assert len(annotation) == 63 < len(shared.text) == 80
    assert second.blocks[0].id == "s" and second.cached_tokens == 80


def test_a_remote_counter_is_never_called_under_the_pilots_lock() -> None:
    pilot = ContextPilot()
    calls: list[bool] = []

    class Remote:
        remote = True

        def __call__(self, text: str) -> int:
            calls.append(pilot._lock._is_owned())  # type: ignore[attr-defined]
            return len(text)

    pilot.token_counter = Remote()
    for n in range(6):
        pilot.prepare([*docs("e", 4, 80), *docs(f"f{n}", 3, 80)], f"question {n}")
    pilot.plan([BatchRequest(docs(f"g{n}", 5, 80) + docs("e", 2, 80), "q") for n in range(4)])
    assert calls and not any(calls)


def test_token_units_remember_a_bounded_number_of_texts_and_count_each_once() -> None:
    counted: list[str] = []
    lock = threading.Lock()

    def count(text: str) -> int:
        with lock:
            counted.append(text)
        return len(text)

    units = TokenUnits(count, max_texts=3)
    threads = [threading.Thread(target=lambda: [units(t) for t in ("a", "bb", "ccc")]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert units("bb") == 2 and len(units) == 3
    assert units("dddd") == 4 and len(units) == 3  # the least recently used went
    assert counted.count("dddd") == 1


def test_a_reorder_must_win_by_more_than_a_page() -> None:
    """Reordered, two blocks of 24 tokens are reused now for an annotation of 20: +28 on paper;
    with pages of 32, the realized reuse may be 17 tokens, or a page less than on paper."""
    tokens = {"a": 24, "b": 24, "x": 24}

    def choose(page: int) -> list[str]:
        return choose_order(
            ["a", "b", "x"],
            ["x", "a", "b"],
            tokens,
            matched=lambda order, _labelled: 2 if list(order[:2]) == ["a", "b"] else 0,
            chance=lambda _previous, _key: 0.0,
            annotation_cost=20,
            label_cost=0,
            page_tokens=page,
        ).order

    assert page_margin(1) == 0 and page_margin(32) == 31
    assert choose(1) == choose(16) == ["a", "b", "x"]  # +28 beats a margin of 15
    assert choose(32) == ["x", "a", "b"]  # not a margin of 31


def test_a_pair_reordered_to_share_a_prefix_shorter_than_both_annotations_goes_plain() -> None:
    """Two requests of a batch share three blocks of 15 tokens in different orders: lining
    them up costs each an annotation of 25 for 45 reused (the 4-request offline breach)."""
    shared = docs("s", 3, 60)
    first = [*docs("p", 3, 60), *shared, *docs("q", 5, 60)]
    second = [*docs("r", 4, 60), *reversed(shared), *docs("t", 4, 60)]
    annotated = ContextPilot(annotate_order=True, keep_top=False)  # the annotation priced in
    planned = annotated.plan([BatchRequest(first, "q1"), BatchRequest(second, "q2")])
    assert all(p.order_annotation == "" for p in planned)
    assert [[b.id for b in p.blocks] for p in sorted(planned, key=lambda p: p.batch_index or 0)] == [
        [b.id for b in first],
        [b.id for b in second],
    ]


def test_a_pilot_that_knows_the_pool_forgets_what_it_cannot_hold() -> None:
    """Without eviction events: once the engine's reports say the live requests computed
    more than its pool, the oldest are no longer predicted (the engine dropped them)."""
    pilot = ContextPilot(token_counter=len, cache_tokens=3_000)
    first = pilot.prepare(docs("h", 5, 200), "q")
    pilot.record_usage(first, 1_100, 0)
    assert pilot.predicted_cached_blocks([f"h{n}" for n in range(5)]) == 5
    for n in range(2):
        later = pilot.prepare(docs(f"k{n}", 5, 200), "q")
        pilot.record_usage(later, 1_100, 0)
    assert pilot.predicted_cached_blocks([f"h{n}" for n in range(5)]) == 0
    assert pilot.predicted_cached_blocks([f"k1{n}" for n in range(5)]) == 5  # the newest stays

    heard = ContextPilot(token_counter=len, cache_tokens=3_000)
    first = heard.prepare(docs("m", 5, 200), "q")
    heard.evict(["unknown"])  # the engine's evictions reach this pilot: they are followed instead
    for n in range(3):
        heard.record_usage(heard.prepare(docs(f"n{n}", 5, 200), "q"), 1_100, 0)
    heard.record_usage(first, 1_100, 0)
    assert heard.predicted_cached_blocks([f"m{n}" for n in range(5)]) == 5
