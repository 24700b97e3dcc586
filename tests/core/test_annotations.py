from __future__ import annotations

import pytest
from pydantic import ValidationError

from contextpilot_integrations import Block, Templates, parse_order_annotation, render_block
from contextpilot_integrations.core.annotations import render_order, render_reference


def test_default_templates_are_compact() -> None:
    """The paper's wording cost 83 characters plus the labels; this one 28 (issue 21)."""
    blocks = [Block(id=i, text=f"text {i}") for i in ("2", "1", "4")]
    assert render_order(blocks) == "Context in priority order: [2] > [1] > [4]."
    assert parse_order_annotation(render_order(blocks)) == ["2", "1", "4"]
    assert render_reference(blocks[2]) == "Please refer to [4] in the previous conversation."
    assert render_block(blocks[0]) == "[2] text 2"
    assert render_block(blocks[0], labelled=False) == "text 2"  # as sent without ContextPilot


def test_order_annotation_round_trips_with_custom_templates() -> None:
    templates = Templates(order="Ranking: {order}.", order_item="<{label}>", order_joiner=", ")
    blocks = [Block(id=f"d{i}", text="t") for i in range(5)]
    text = render_order(blocks, templates)
    assert parse_order_annotation(text, templates) == [b.label for b in blocks]


def test_templates_must_keep_their_placeholders() -> None:
    with pytest.raises(ValidationError, match=r"\{text\}"):
        Templates(block="[{label}]")
