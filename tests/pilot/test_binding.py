"""Exact binding by run tree, references that always resolve, and the order annotation only
when the order changed."""

from __future__ import annotations

import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import Block, ContextPilot, render_block
from contextpilot_integrations.core.annotations import render_reference
from contextpilot_integrations.core.blocks import CHARS_PER_TOKEN
from contextpilot_integrations.pilot.binding import Binding, RunBinder, restore_references
from contextpilot_integrations.testing.invariants import dangling_references, invariant_breaches, message_texts


def blocks(*ids: str) -> list[Block]:  # 100 tokens: long enough for a reference to pay
    return [Block(id=i, text=f"text of {i} " * 40) for i in ids]


def bound(pilot: ContextPilot, *ids: str) -> Binding:
    return Binding(pilot, pilot.prepare(blocks(*ids), "q"))


# ---- the run tree ------------------------------------------------------------------------------
def chain_tree(binder: RunBinder) -> None:
    """root -> parallel -> (retrieve_a -> ret_a, retrieve_b -> ret_b); root -> llm_a, llm_b
    under branch a and b: seq_a -> (ret_a2, llm_a), seq_b -> (ret_b2, llm_b)."""
    for run, parent in [
        ("root", None),
        ("seq_a", "root"),
        ("seq_b", "root"),
        ("ret_a", "seq_a"),
        ("ret_b", "seq_b"),
        ("llm_a", "seq_a"),
        ("llm_b", "seq_b"),
    ]:
        binder.started(run, parent)


def test_a_model_call_takes_the_deposit_nearest_in_the_tree() -> None:
    pilot, binder = ContextPilot(), RunBinder()
    chain_tree(binder)
    a, b = bound(pilot, "x", "y"), bound(pilot, "x", "y")  # identical retrievals
    binder.deposit("ret_b", b)
    binder.deposit("ret_a", a)
    assert binder.take("llm_b") is b and binder.take("llm_a") is a  # not the latest: the nearest
    assert binder.take("llm_a") is None  # each deposit is taken once
    assert binder.take("elsewhere") is None and binder.take(None) is None


def test_a_failed_call_is_retaken_under_a_fresh_id() -> None:
    pilot, binder = ContextPilot(), RunBinder()
    chain_tree(binder)
    first = bound(pilot, "x", "y")
    binder.deposit("ret_a", first)
    taken = binder.take("llm_a")
    assert taken is first
    pilot.discard(first.prepared)
    binder.failed(first)
    retry = binder.take("llm_a")
    assert retry is not None and retry.prepared.request_id != first.prepared.request_id
    assert pilot.live_request_ids() == [retry.prepared.request_id]
    assert [b.id for b in retry.prepared.blocks] == [b.id for b in first.prepared.blocks]


def test_forgetting_a_subtree_and_the_bounds() -> None:
    pilot, binder = ContextPilot(), RunBinder(max_runs=3, max_deposits=2)
    for n in range(5):
        binder.started(f"r{n}", None)
        binder.deposit(f"r{n}", bound(pilot, "x"))
    assert len(binder.untaken()) == 2
    binder.forget({"r4"})
    assert len(binder.untaken()) == 1 and binder.take("r4") is None
    binder.deposit("r3", bound(pilot, "y"))
    assert [binder.take("r3") is not None for _ in range(3)] == [True, True, False]  # each deposit taken once


def test_concurrent_invocations_never_take_each_others_request() -> None:
    pilot, binder = ContextPilot(), RunBinder()
    taken: dict[int, Binding | None] = {}
    made: dict[int, Binding] = {}

    def invocation(n: int) -> None:
        binder.started(f"root{n}", None)
        binder.started(f"ret{n}", f"root{n}")
        binder.started(f"llm{n}", f"root{n}")
        made[n] = bound(pilot, "same", "documents")
        binder.deposit(f"ret{n}", made[n])
        taken[n] = binder.take(f"llm{n}")

    threads = [threading.Thread(target=invocation, args=(n,)) for n in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(taken[n] is made[n] for n in range(50))
    assert len({b.prepared.request_id for b in made.values()}) == 50


# ---- references always resolve ------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    turns=st.lists(st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=5, unique=True), min_size=2, max_size=5),
    sent=st.data(),
)
def test_restored_messages_never_refer_to_what_they_do_not_carry(turns: list[list[str]], sent: st.DataObject) -> None:
    """A conversation prepared with every turn kept, then sent with any subset of its history:
    after restoring, no reference dangles and every retrieved block's text is in the request."""
    pilot = ContextPilot()
    rendered = [pilot.prepare(blocks(*ids), "q", "c").render() for ids in turns[:-1]]
    last = pilot.prepare(blocks(*turns[-1]), "q", "c")
    history = sent.draw(st.lists(st.sampled_from(range(len(rendered))), unique=True).map(sorted))
    texts = [rendered[i] for i in history] + [last.render()]
    restored = restore_references(last, texts)
    pilot.note_restored(last, restored)
    assert dangling_references(texts) == dangling_references(texts[:-1])  # the new message adds none
    joined = "\n".join(texts)
    for block in last.ranking:
        assert block.text in joined
    assert pilot.stats().references_restored == len(restored)


def test_a_restored_block_can_be_referred_to_from_the_turn_that_carried_it() -> None:
    pilot = ContextPilot(keep_top=False)  # the top block may be a reference too
    pilot.prepare(blocks("a", "b"), "q", "c")
    second = pilot.prepare(blocks("a", "b"), "q", "c")  # references to turn 0
    assert len(second.references) == 2
    texts = [second.render()]  # turn 0 is not sent
    restored = restore_references(second, texts)
    pilot.note_restored(second, restored)
    assert sorted(restored) == ["a", "b"] and dangling_references(texts) == []
    third = pilot.prepare(blocks("a", "b"), "q", "c", kept_turns={1})  # only turn 1 is sent
    assert [r.turn for r in third.references] == [1, 1]


# ---- the order annotation --------------------------------------------------------------------
def test_no_annotation_when_the_model_reads_the_retrievers_order() -> None:
    pilot = ContextPilot(annotate_order=True, keep_top=False)  # the annotation on (off by default)
    pilot.discard(pilot.prepare(blocks("a", "b", "c"), "seen before"))  # they recur: worth labelling
    first = pilot.prepare(blocks("a", "b", "c"), "q")
    assert first.order_annotation == "" and "priority order" not in first.render()
    reordered = pilot.prepare(blocks("c", "a", "b", "d"), "q")
    assert [b.id for b in reordered.blocks][:3] == ["a", "b", "c"]
    assert "#3 > #1 > #2 > #4" in reordered.order_annotation  # c, a, b, d by position
    chat = ContextPilot()
    chat.prepare(blocks("a"), "q", "c")
    later = chat.prepare(blocks("b", "a"), "q", "c")  # a's reference in a's place, the top block b last
    assert [b.id for b in later.blocks] == ["b"] and [r.block.id for r in later.references] == ["a"]
    assert later.order_annotation == "" and later.render().index("refer to") < later.render().index("text of b")
    # the paper's form: references after the blocks, the ranking restated, any repeat referred to
    paper = ContextPilot(plain_prompts=False, annotate_order=True, keep_top=False)
    paper.prepare(blocks("a"), "q", "c")
    moved = paper.prepare(blocks("a", "b"), "q", "c")
    assert [b.id for b in moved.blocks] == ["b"] and moved.order_annotation == "Context in priority order: [a] > [b]."
    same = paper.prepare(blocks("e", "a"), "q", "c")  # e sent, then the reference to a: as ranked
    assert same.order_annotation == ""


def test_a_plain_request_is_located_by_its_plain_text() -> None:
    """A request sent as without ContextPilot (no labels) is found in the outgoing prompt as
    sent: the tokens before its first block are the system prompt's, not the whole prompt's."""
    pilot = ContextPilot()
    prepared = pilot.prepare([Block(id="d1", text="x" * 400), Block(id="d2", text="y" * 400)], "q")
    assert not prepared.labels
    system = "s" * 80
    binding = Binding(pilot, prepared).located(system + prepared.render())
    assert binding.before_tokens == 80 // CHARS_PER_TOKEN


def test_invariant_breaches_names_a_dangling_reference_and_a_repeated_id() -> None:
    block = Block(id="7", text="seven")
    shown = {"rid": "a", "messages": [{"role": "user", "content": render_block(block)}]}
    referred = {
        "rid": "b",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": render_block(block)}]},  # text parts count
            {"role": "user", "content": render_reference(block)},
        ],
    }
    assert invariant_breaches([shown, referred, {"messages": []}]) == []  # a body without an id carries none
    alone = {"request_id": "a", "messages": [{"role": "user", "content": render_reference(block)}]}
    assert invariant_breaches([shown, alone]) == ["reference to [7] without its text", "request id 'a' sent 2 times"]


def test_invariant_breaches_reads_anthropic_bodies_too() -> None:
    """Anthropic's shape: the top-level system, and tool results' text inside their blocks."""
    block = Block(id="7", text="seven")
    in_system = {"system": [{"type": "text", "text": render_block(block)}], "messages": []}
    in_tool_result = {
        "system": "Answer.",
        "messages": [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": render_block(block)}]},
            {"role": "user", "content": [{"type": "tool_result", "content": [{"type": "text", "text": "x"}]}]},
        ],
    }
    assert message_texts(in_tool_result) == ["Answer.", render_block(block), "x"]
    referred = {"role": "user", "content": [{"type": "tool_result", "content": render_reference(block)}]}
    assert invariant_breaches([{**in_system, "messages": [referred]}]) == []
    assert invariant_breaches([{"messages": [referred]}]) == ["reference to [7] without its text"]


def test_invariant_breaches_reads_bedrock_and_gemini_bodies_too() -> None:
    """The shapes boto3 (Converse) and google-genai send: a reference in a tool's result is
    audited there too, and a block in Gemini's system instruction carries its text."""
    block = Block(id="7", text="seven")
    bedrock = {
        "system": [{"text": "Answer."}, {"cachePoint": {"type": "default"}}],
        "messages": [
            {"role": "user", "content": [{"text": render_block(block)}]},
            {"role": "user", "content": [{"toolResult": {"toolUseId": "t", "content": [{"text": "r"}]}}]},
        ],
    }
    assert message_texts(bedrock) == ["Answer.", "", render_block(block), "r"]
    bedrock_referred = {
        "messages": [{"role": "user", "content": [{"toolResult": {"content": [{"text": render_reference(block)}]}}]}]
    }
    assert invariant_breaches([bedrock_referred]) == ["reference to [7] without its text"]
    gemini = {
        "systemInstruction": {"parts": [{"text": render_block(block)}]},
        "contents": [
            {"role": "model", "parts": [{"functionCall": {"name": "search", "args": {}}}]},
            {
                "role": "user",
                "parts": [{"functionResponse": {"name": "search", "response": {"output": render_reference(block)}}}],
            },
        ],
    }
    assert message_texts(gemini) == [render_block(block), "", render_reference(block)]
    assert invariant_breaches([gemini]) == []
    assert invariant_breaches([{"contents": gemini["contents"]}]) == ["reference to [7] without its text"]
