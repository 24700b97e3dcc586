"""A reference names exactly one text in the messages the model receives (issue 39, items 4 and 7).

A quote reference names a block by its opening words. It may go out only where those words
begin the block's copy and occur nowhere else the model reads them: not at the start of
another block first sent in the very same turn, not as the start of a longer opening, not
inside another document, the question or the system prompt, and not where text without
spaces (CJK, code) makes two openings share their first characters. Where the first four
words are not enough, a longer quote (8 words / 80 characters, then 16 / 160) that names the
block alone is used; where none does, the block is sent in full. Restoring a reference
replaces the one the request placed, never the same sentence inside a document; the audit
counts a quote as found only where a block's copy begins with it.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import Block, ContextPilot, PreparedRequest
from contextpilot_integrations.core.annotations import render_reference
from contextpilot_integrations.pilot.binding import restore_references
from contextpilot_integrations.testing.invariants import dangling_references, invariant_breaches

FILLER = " and the rest of the document follows here" * 30


def doc(name: str, text: str) -> Block:
    """A block long enough that a reference to it costs less than its text."""
    return Block(id=name, text=text, tokens=300)


JURY = doc("A", "The jury said Monday that the verdict would stand." + FILLER)
TOP = doc("T", "An unrelated document that the retriever ranked first." + FILLER)


def quoted(prepared: PreparedRequest) -> list[str]:
    return [r.block.id for r in prepared.references if not r.labelled]


def quotes(prepared: PreparedRequest) -> dict[str, str]:
    """Block id -> the words its quote reference names it by (read from the sentence sent)."""
    head, _, tail = prepared.templates.quote_reference.partition("{opening}")
    return {r.block.id: r.text.removeprefix(head).removesuffix(tail) for r in prepared.references if not r.labelled}


def history(*turns: PreparedRequest) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    for turn in turns:
        out += [{"role": "user", "content": turn.render()}, {"role": "assistant", "content": "ok"}]
    return out


def texts_of(messages: list[dict[str, str]]) -> list[str]:
    return [m["content"] for m in messages]


def test_a_quote_goes_out_where_its_words_name_one_text() -> None:
    """The rule's positive side: a block whose opening nothing else shares is quoted, and
    the messages keep the quote (nothing restored, nothing dangling)."""
    pilot = ContextPilot()
    first = pilot.prepare([JURY], "q0", conversation_id="c")
    second = pilot.prepare([TOP, JURY], "q1", conversation_id="c")
    assert quoted(second) == ["A"]
    messages = second.to_messages(history=history(first))
    assert messages[-1]["content"] == second.render() and dangling_references(texts_of(messages)) == []


# ---- (a) the very turn that first sends a block beginning alike -------------------------------------
@pytest.mark.parametrize("ranking", [["T", "A", "B"], ["T", "B", "A"], ["B", "A"]])
def test_the_turn_that_first_sends_a_block_beginning_alike_quotes_more_words(ranking: list[str]) -> None:
    """Turn 0 sent A; turn 1 sends A again and, for the first time, B, which begins with the
    same four words: a four-word quote of A would name A and B alike, before or after it, so
    A is quoted by eight words, which B does not begin with."""
    twin = doc("B", "The jury said Monday nothing at all about the appeal." + FILLER)
    by_id = {"T": TOP, "A": JURY, "B": twin}
    pilot = ContextPilot()
    first = pilot.prepare([JURY], "q0", conversation_id="c")
    second = pilot.prepare([by_id[i] for i in ranking], "q1", conversation_id="c")
    assert quotes(second) == {"A": "The jury said Monday that the verdict would"}
    texts = texts_of(second.to_messages(history=history(first)))
    assert texts[-1] == second.render() and dangling_references(texts) == []


def test_no_quote_at_all_where_the_turn_first_sends_a_block_alike_past_the_longest_quote() -> None:
    same = "The jury said Monday that the verdict would stand, and the judge agreed with every word of it today."
    one, other = doc("A", same + " One." + FILLER), doc("B", same + " Two." + FILLER)
    pilot = ContextPilot()
    first = pilot.prepare([one], "q0", conversation_id="c")
    second = pilot.prepare([TOP, one, other], "q1", conversation_id="c")
    assert quoted(second) == []
    texts = texts_of(second.to_messages(history=history(first)))
    assert texts[-1] == second.render() and dangling_references(texts) == []


# ---- (b) an opening that is a prefix of another ----------------------------------------------------------
def test_an_opening_that_begins_another_text_is_not_quoted() -> None:
    """ "Prices rose on Monday" begins "Prices rose on Monday, ...": a quote of the first
    names both; the longer opening names one text and stays quotable."""
    short = doc("A", "Prices rose on Monday")
    longer = doc("B", "Prices rose on Monday, then fell on Tuesday." + FILLER)
    pilot = ContextPilot()
    first = pilot.prepare([short, longer], "q0", conversation_id="c")
    second = pilot.prepare([TOP, short, longer], "q1", conversation_id="c")
    assert quoted(second) == ["B"]
    texts = texts_of(second.to_messages(history=history(first)))
    assert texts[-1] == second.render() and dangling_references(texts) == []


# ---- (c) the quoted words elsewhere: another document, the question, the system prompt ------------------
def test_a_quote_takes_more_words_where_its_words_occur_inside_another_document() -> None:
    inside = doc("C", "Reports say The jury said Monday that the verdict would stand, said one." + FILLER[:100])
    pilot = ContextPilot()
    first = pilot.prepare([JURY, inside], "q0", conversation_id="c")
    second = pilot.prepare([TOP, JURY], "q1", conversation_id="c")
    sixteen = "The jury said Monday that the verdict would stand. and the rest of the document follows"
    assert quotes(second) == {"A": sixteen}  # C holds A's first eight words too
    third = pilot.prepare([TOP, JURY], "q2", conversation_id="c")  # and in a later turn too
    assert quotes(third) == quotes(second)
    texts = texts_of(third.to_messages(history=history(first, second)))
    assert texts[-1] == third.render() and dangling_references(texts) == []


def test_no_quote_whose_words_occur_inside_a_document_of_this_very_turn() -> None:
    inside = doc("C", "Reports say " + JURY.text)  # every quote of A is inside C
    pilot = ContextPilot()
    pilot.prepare([JURY], "q0", conversation_id="c")
    assert quoted(pilot.prepare([TOP, JURY, inside], "q1", conversation_id="c")) == []


def test_no_quote_whose_words_the_question_contains() -> None:
    pilot = ContextPilot()
    pilot.prepare([JURY], "q0", conversation_id="c")
    assert quoted(pilot.prepare([TOP, JURY], f"Why did {JURY.text[:200]} come up?", conversation_id="c")) == []
    pilot.prepare([JURY], "q0", conversation_id="d")
    four = pilot.prepare([TOP, JURY], "Why did The jury said Monday come up?", conversation_id="d")
    assert quotes(four) == {"A": "The jury said Monday that the verdict would"}


def test_a_quote_takes_more_words_where_a_kept_question_holds_its_words() -> None:
    pilot = ContextPilot()
    pilot.prepare([TOP], "Who wrote The jury said Monday?", conversation_id="c")
    pilot.prepare([JURY], "q1", conversation_id="c")
    assert quotes(pilot.prepare([TOP, JURY], "q2", conversation_id="c")) == {
        "A": "The jury said Monday that the verdict would"
    }
    # a turn the history no longer carries does not count
    assert quotes(pilot.prepare([TOP, JURY], "q3", conversation_id="c", kept_turns={1, 2})) == {
        "A": "The jury said Monday"
    }


@pytest.mark.parametrize(
    "where",
    ["system prompt", "assistant answer", "later message"],
)
def test_a_quote_whose_words_the_messages_carry_elsewhere_is_sent_in_full(where: str) -> None:
    """What the planner cannot see (the system prompt, an answer, a message after the
    prompt) is checked where the messages leave: the block goes out in full."""
    pilot = ContextPilot()
    first = pilot.prepare([JURY], "q0", conversation_id="c")
    second = pilot.prepare([TOP, JURY], "q1", conversation_id="c")
    assert quoted(second) == ["A"]
    words = "Remember: The jury said Monday is a famous headline."
    earlier = history(first)
    if where == "assistant answer":
        earlier[-1]["content"] = words
    system = words if where == "system prompt" else None
    messages = second.to_messages(system_prompt=system, history=earlier)
    texts = texts_of(messages)
    if where == "later message":
        texts = [*texts_of(second.to_messages(history=earlier)), words]
        assert restore_references(second, texts) == ["A"]
    assert "Please refer to" not in texts[-1 if where != "later message" else -2]
    assert JURY.text in texts[-1 if where != "later message" else -2]
    assert dangling_references(texts) == []


def test_restore_references_sends_an_ambiguous_quote_in_full_and_tells_the_pilot() -> None:
    pilot = ContextPilot()
    first = pilot.prepare([JURY], "q0", conversation_id="c")
    second = pilot.prepare([TOP, JURY], "q1", conversation_id="c")
    texts = ["System: The jury said Monday, a headline.", first.render(), "ok", second.render()]
    restored = restore_references(second, texts)
    pilot.note_restored(second, restored)
    assert restored == ["A"] and texts[-1].startswith(JURY.text) and pilot.stats().references_restored == 1


# ---- (d) CJK and code: openings cut at 40 characters --------------------------------------------------
CJK = "東京の株価は月曜日に大きく上昇し、市場関係者は今後の見通しについて慎重な姿勢を崩していない"
CODE = "def compute_the_total_price_of_all_items_in_the_cart(items):\n    return sum(item.price for item in items)\n"
CODE_TWIN = "def compute_the_total_price_of_all_items_in_the_cart_with_tax(items, rate):\n    return 0\n"


@pytest.mark.parametrize(
    ("text", "twin"),
    [
        (CJK + "。" + "詳細は後日発表される。" * 20, CJK[:40] + "とは言えないと専門家は述べた。" * 20),
        (CODE * 8, CODE_TWIN * 8),
    ],
    ids=["cjk", "code"],
)
def test_texts_without_spaces_that_share_their_first_40_characters_are_told_apart(text: str, twin: str) -> None:
    """A four-word quote of text without spaces is its first 40 characters: two texts that
    share them are quoted by 80 characters, which they do not share."""
    assert text[:40] == twin[:40] and text[:80] != twin[:80]
    one, other = doc("A", text), doc("B", twin)
    pilot = ContextPilot()
    first = pilot.prepare([one], "q0", conversation_id="c")
    second = pilot.prepare([TOP, one, other], "q1", conversation_id="c")  # the twin, first sent now
    assert quotes(second) == {"A": text[:80]}
    third = pilot.prepare([TOP, one, other], "q2", conversation_id="c")
    assert quotes(third) == {"A": text[:80], "B": twin[:80]}
    texts = texts_of(third.to_messages(history=history(first, second)))
    assert texts[-1] == third.render() and dangling_references(texts) == []


def test_texts_without_spaces_that_share_their_first_160_characters_are_sent_in_full() -> None:
    shared = CJK * 4
    one, other = doc("A", shared + "。一つ目。" * 20), doc("B", shared + "。二つ目。" * 20)
    pilot = ContextPilot()
    pilot.prepare([one], "q0", conversation_id="c")
    assert quoted(pilot.prepare([TOP, one, other], "q1", conversation_id="c")) == []


def test_a_cjk_opening_inside_another_document_is_not_quoted() -> None:
    one = doc("A", CJK + "。" + "詳細は後日発表される。" * 20)
    other = doc("B", "報道によると、" + one.text)
    pilot = ContextPilot()
    pilot.prepare([one, other], "q0", conversation_id="c")
    assert quoted(pilot.prepare([TOP, one], "q1", conversation_id="c")) == []


# ---- (e) restore the reference placed, never the same sentence inside a document -----------------------
SENTENCE = "Please refer to [A] in the previous conversation."
QUOTING = doc("D", f"Minutes of the meeting. {SENTENCE} Nobody knew what it meant." + FILLER)


def _labelled_turns() -> tuple[ContextPilot, PreparedRequest, PreparedRequest]:
    pilot = ContextPilot(plain_prompts=False, keep_top=False)  # the paper's form: references by label
    first = pilot.prepare([JURY], "q0", conversation_id="c")
    second = pilot.prepare([QUOTING, JURY], "q1", conversation_id="c")
    assert [r.text for r in second.references] == [SENTENCE]
    assert second.render().index(SENTENCE) < second.render().rindex(SENTENCE)  # the document's copy first
    return pilot, first, second


@pytest.mark.parametrize("frame", ["{}", "Context:\n{}\nAnswer briefly."])
def test_restoring_edits_the_reference_placed_not_a_document_quoting_it(frame: str) -> None:
    _, _, second = _labelled_turns()
    texts = [frame.format(second.render())]
    assert restore_references(second, texts) == ["A"]
    assert QUOTING.text in texts[0]  # the document, untouched
    full = "[A] " + JURY.text
    assert texts[0] == frame.format(second.render().replace(f"\n\n{SENTENCE}\n\n", f"\n\n{full}\n\n"))


def test_restoring_never_edits_an_earlier_message_that_carries_the_sentence() -> None:
    _, _, second = _labelled_turns()
    earlier = f"What does '{SENTENCE}' mean?"
    texts = [earlier, "It is a reference.", second.render()]
    assert restore_references(second, texts) == ["A"]
    assert texts[0] == earlier and texts[-1].count("[A] " + JURY.text) == 1 and QUOTING.text in texts[-1]


def test_to_messages_restores_the_reference_placed() -> None:
    _, _, second = _labelled_turns()
    content = second.to_messages()[-1]["content"]
    assert QUOTING.text in content and "[A] " + JURY.text in content


def test_a_reference_that_stays_leaves_the_document_alone() -> None:
    _, first, second = _labelled_turns()
    texts = [first.render(), "ok", second.render()]
    assert restore_references(second, texts) == [] and texts[-1] == second.render()


# ---- (f) the audit counts a quote as found only where a block's copy begins with it ---------------------
QUOTE = render_reference(JURY, labelled=False)


def test_the_audit_flags_a_quote_whose_words_only_occur_inside_another_document() -> None:
    inside = "Reports say The jury said Monday that it would meet again."
    assert dangling_references([inside, QUOTE]) == ['"The jury said Monday"']
    assert dangling_references([f"Context: {JURY.text}", QUOTE]) == [
        '"The jury said Monday"'
    ]  # not where a line begins


def test_the_audit_flags_a_quote_that_names_two_texts() -> None:
    two = "The jury said Monday yes.\n\nThe jury said Monday no."
    assert dangling_references([two, QUOTE]) == ['"The jury said Monday" (names more than one text)']
    after = ["The jury said Monday yes.", f"{QUOTE}\n\nThe jury said Monday no."]  # the other in the same message
    assert dangling_references(after) == ['"The jury said Monday" (names more than one text)']
    prefix = ["Prices rose on Monday\n\nPrices rose on Monday, then fell.", 'Please refer to "Prices rose on Monday…"']
    prefix[1] += " in the previous conversation."
    assert dangling_references(prefix) == ['"Prices rose on Monday" (names more than one text)']
    assert invariant_breaches([{"messages": [{"role": "user", "content": t} for t in [two, QUOTE]]}]) == [
        'reference to "The jury said Monday" naming more than one text'
    ]


def test_the_audit_accepts_a_quote_of_one_text_however_often_it_is_sent() -> None:
    assert dangling_references([JURY.text, QUOTE]) == []
    assert dangling_references([f"{TOP.text}\n\n{JURY.text}\n\nQuestion: q", "ok", JURY.text, QUOTE]) == []
    assert dangling_references([f"Context:\n{JURY.text}", QUOTE]) == []  # a copy where a line begins
    repeated = doc("R", "la la la la " * 30)
    assert dangling_references([repeated.text, render_reference(repeated, labelled=False)]) == []
    # a later turn's block that begins alike does not make an earlier turn's quote ambiguous
    assert dangling_references([JURY.text, QUOTE, "The jury said Monday no."]) == []
    # the quote inside a document that quotes it is no copy, nor is another quote of the same block
    assert dangling_references([JURY.text, f"He wrote: {QUOTE}", QUOTE]) == []


# ---- any conversation: every quote sent names one text ---------------------------------------------------
PIECES = [
    "Prices",
    "rose",
    "on",
    "Monday",
    "Monday,",
    "The",
    "jury",
    "said",
    "東京の株価は月曜日に大きく上昇し",
    "x" * 45,
]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(
                st.tuples(st.integers(0, 9), st.lists(st.sampled_from(PIECES), min_size=1, max_size=12)), max_size=6
            ),
            st.integers(1, 4),
            st.one_of(st.none(), st.lists(st.sampled_from(PIECES), min_size=1, max_size=8).map(" ".join)),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_whatever_the_texts_every_quote_sent_names_one_text(
    turns: list[tuple[list[tuple[int, list[str]]], int, str | None]],
) -> None:
    """Texts built to collide (openings that begin alike or are prefixes of others, words
    inside other texts, CJK and long tokens cut at 40 characters, a system prompt of the
    same words): the planner quotes only what names one text in what it sees (nothing is
    restored without a system prompt), and whatever the system prompt, the messages sent
    carry no reference that dangles or names two texts, and every block's text."""
    pilot = ContextPilot()
    history: list[dict[str, str]] = []
    texts: dict[int, str] = {}
    for number, (picks, window, system) in enumerate(turns):
        blocks: list[Block] = []
        for key, words in picks:
            if key in {int(b.id) for b in blocks}:
                continue
            if key not in texts:  # some texts extend another: prefix openings
                base = texts.get(key - 1, "") if key % 3 == 0 else ""
                texts[key] = (base + " " + " ".join(words)).strip()
            blocks.append(doc(str(key), texts[key]))
        if not blocks:
            continue
        kept = list(range(max(0, pilot_turns(history) - window), pilot_turns(history)))
        prepared = pilot.prepare(blocks, f"q{number}", conversation_id="c", kept_turns=kept)
        sent = history[2 * kept[0] :] if kept else []
        stale = dangling_references(texts_of(sent))  # the caller's window cut the history short
        plain = texts_of(prepared.to_messages(history=sent))
        assert plain[-1] == prepared.render()  # nothing the planner could see was left to restore
        assert dangling_references(plain) == stale
        framed = texts_of(prepared.to_messages(system_prompt=system, history=sent))
        assert dangling_references(framed) == dangling_references(framed[: len(framed) - 1])
        joined = "\n".join(framed)
        assert all(block.text in joined for block in blocks)
        for messages in (plain, framed):
            assert_names_one_text(messages, prepared)
        history += [{"role": "user", "content": prepared.render()}, {"role": "assistant", "content": "ok"}]


def pilot_turns(history: list[dict[str, str]]) -> int:
    return len(history) // 2


def assert_names_one_text(messages: list[str], prepared: PreparedRequest) -> None:
    """The oracle, independent of the code under test: each quote of ``prepared`` still in
    its message names its block alone: outside reference sentences, its words occur only
    inside copies of that block's text, and one copy comes before the quote."""
    sentence = re.compile(r'Please refer to (\[[^\]]*\]|".*?…") in the previous conversation\.', re.DOTALL)
    last = messages[-1]
    for words, reference in ((quotes(prepared)[r.block.id], r) for r in prepared.references if not r.labelled):
        if reference.text not in last:
            continue
        bare = [sentence.sub(lambda m: "\x00" * len(m.group()), text) for text in messages]
        copies = [(i, at) for i, text in enumerate(bare) for at in _finds(text, reference.block.text)]
        assert copies and copies[0] < (len(messages) - 1, last.index(reference.text))
        for i, text in enumerate(bare):
            for at in _finds(text, words):
                assert any(j == i and start <= at < start + len(reference.block.text) for j, start in copies)


def _finds(text: str, words: str) -> list[int]:
    found, at = [], text.find(words)
    while at != -1:
        found.append(at)
        at = text.find(words, at + 1)
    return found
