from __future__ import annotations

import pytest

from contextpilot_integrations import (
    Block,
    BlockTypeError,
    DuplicateBlockError,
    InvalidBlockError,
    content_id,
)
from contextpilot_integrations.core.blocks import normalize_blocks


def test_id_defaults_to_content_hash_and_is_stable() -> None:
    a, b = Block(text="Paris is the capital of France."), Block(text="Paris is the capital of France.")
    assert a.id == b.id == content_id("Paris is the capital of France.")
    assert a.label == b.label and len(a.label) == 6 and a.label.isalnum()  # 16 hex digits hashed down to 6


def test_labels_are_short_and_stable() -> None:
    """Every block of every prompt carries its label: a long id costs six characters, not 40."""
    uuid = "3f2b8c1e-9a4d-4e6f-8b7a-1c2d3e4f5a6b"
    assert Block(id=uuid, text="x").label == Block(id=uuid, text="other text").label  # the id alone decides
    assert len(Block(id=uuid, text="x").label) == 6
    assert Block(id="chunk-12", text="x").label == "chunk-12"  # short ids as given
    assert len({Block(id=f"node-{n:06d}", text="x").label for n in range(20_000)}) >= 19_999


def test_given_id_is_kept_and_int_ids_become_str() -> None:
    assert Block(id="545", text="x").label == "545"
    assert Block(id=545, text="x").id == "545"  # type: ignore[arg-type]


def test_unsafe_ids_get_a_hashed_label_without_brackets() -> None:
    block = Block(id="https://example.org/a b]c", text="x")
    assert len(block.label) == 6 and "]" not in block.label and " " not in block.label


@pytest.mark.parametrize("text", ["", "   \n"])
def test_blank_text_is_rejected(text: str) -> None:
    with pytest.raises(InvalidBlockError, match="empty"):
        Block(text=text)


@pytest.mark.parametrize("content", [b"bytes", 3.5, {"image": "..."}, None])
def test_non_text_content_is_rejected(content: object) -> None:
    with pytest.raises(BlockTypeError, match="must be str"):
        Block(text=content)  # type: ignore[arg-type]


def test_token_count_given_or_estimated() -> None:
    assert Block(text="x" * 400, tokens=7).token_count == 7
    assert Block(text="x" * 400).token_count == 100
    with pytest.raises(InvalidBlockError):
        normalize_blocks([{"text": "x", "tokens": 0}])


def test_normalize_ranks_by_position_and_accepts_str_and_mappings() -> None:
    blocks, merged = normalize_blocks(["first", {"id": "b", "text": "second"}, Block(id="c", text="third")])
    assert [b.text for b in blocks] == ["first", "second", "third"]
    assert [b.id for b in blocks][1:] == ["b", "c"] and merged == []


def test_explicit_ranks_define_the_order() -> None:
    blocks, _ = normalize_blocks([Block(id="a", text="a", rank=2), Block(id="b", text="b", rank=0)])
    assert [b.id for b in blocks] == ["b", "a"]


def test_identical_duplicates_are_merged_and_reported_conflicts_raise() -> None:
    blocks, merged = normalize_blocks([{"id": "a", "text": "A"}, {"id": "b", "text": "B"}, {"id": "a", "text": "A"}])
    assert [b.id for b in blocks] == ["a", "b"] and merged == ["a"]
    with pytest.raises(DuplicateBlockError, match=r"block #1.*different text"):
        normalize_blocks([{"id": "a", "text": "A"}, {"id": "a", "text": "other"}])


def test_errors_name_the_position() -> None:
    with pytest.raises(BlockTypeError, match="block #2"):
        normalize_blocks(["a", "b", 42])  # type: ignore[list-item]
    with pytest.raises(BlockTypeError, match="sequence of blocks"):
        normalize_blocks("not a list")  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["text", "id"])
def test_a_lone_surrogate_is_refused_with_the_library_error(field: str) -> None:
    """Half of an emoji cut by a text splitter cannot be sent: refused where the block is made."""
    from contextpilot_integrations import ContextPilot, InvalidBlockError

    fields = {"id": "doc-7", "text": "The price rose today", field: "cut \ud83d"}
    with pytest.raises(InvalidBlockError, match=f"block {field} is not valid Unicode.*at character 4"):
        Block(**fields)
    pilot = ContextPilot()
    with pytest.raises(InvalidBlockError, match="block #1: "):
        pilot.prepare(["A whole text.", fields], "q")
    with pytest.raises(InvalidBlockError, match="query is not valid Unicode"):
        pilot.prepare(["A whole text."], "why \udc00")
    assert pilot.stats().requests_prepared == 0 and pilot.live_request_ids() == []  # a call that raised changed nothing
