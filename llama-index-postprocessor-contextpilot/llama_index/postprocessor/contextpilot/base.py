"""ContextPilot as a LlamaIndex node postprocessor (where ``LongContextReorder`` goes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.base import BaseEvent
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from contextpilot_integrations import Block, BlockTypeError, InvalidBlockError, PreparedRequest, Reference
from contextpilot_integrations.integration.implicit import own_pilot
from contextpilot_integrations.pilot.binding import prepare_bound

from ._binding import deposit, span_binder

__all__ = ["ContextPilotEvent", "ContextPilotPostprocessor"]

dispatcher = get_dispatcher(__name__)
LABEL_KEY = "ref"
"""The metadata key of a node's label, shown to the LLM as ``ref: 545`` before every node: short,
since every node of every prompt carries it (``contextpilot_label`` cost 20 characters a node)."""
FALLBACK_LABEL_KEY = "contextpilot_label"
"""Used instead where a node's own metadata already has :data:`LABEL_KEY`."""


class ContextPilotEvent(BaseEvent):
    """What ContextPilot did to one request (for tracing)."""

    request_id: str
    conversation_id: str | None = None
    turn: int | None = None
    retrieved: list[str]
    sent: list[str]
    references: list[str]

    @classmethod
    def class_name(cls) -> str:
        return "ContextPilotEvent"


def _text(item: NodeWithScore) -> str:
    return item.node.get_content(metadata_mode=MetadataMode.NONE) or ""


def is_blank(item: NodeWithScore) -> bool:
    """A node with no text to show (empty or whitespace): nothing to order or send."""
    return not _text(item).strip()


def to_blocks(nodes: Sequence[NodeWithScore]) -> list[Block]:
    """Nodes as blocks: the node id is the identity, the text (no metadata) the content.
    Blank nodes are left out (:func:`in_send_order` passes them through)."""
    blocks = []
    for position, item in enumerate(nodes):
        if is_blank(item):
            continue
        try:
            blocks.append(Block(id=item.node.node_id, text=_text(item), metadata={}))
        except (BlockTypeError, InvalidBlockError) as exc:
            raise type(exc)(f"node #{position} (id {item.node.node_id!r}): {exc}") from exc
    return blocks


def emit(prepared: PreparedRequest, nodes: Sequence[NodeWithScore]) -> None:
    dispatcher.event(
        ContextPilotEvent(
            request_id=prepared.request_id,
            conversation_id=prepared.conversation_id,
            turn=prepared.turn,
            retrieved=[n.node.node_id for n in nodes],
            sent=[b.id for b in prepared.blocks],
            references=[r.block.id for r in prepared.references],
        )
    )


def in_send_order(prepared: PreparedRequest, nodes: Sequence[NodeWithScore]) -> list[NodeWithScore]:
    """Copies of the nodes in the order the model reads them, labelled; originals (and the docstore) untouched.
    Blank nodes last, as given (no text: where they go changes nothing the LLM reads)."""
    by_id = {item.node.node_id: item for item in nodes if not is_blank(item)}
    out = []
    for part in prepared.sequence:  # as the model reads them
        block = part.block if isinstance(part, Reference) else part
        item = by_id[block.id]
        if not prepared.labels:  # sent as without ContextPilot: the node as retrieved
            out.append(item)
            continue
        node = item.node.model_copy(deep=False)
        key = FALLBACK_LABEL_KEY if LABEL_KEY in item.node.metadata else LABEL_KEY
        node.metadata = {**item.node.metadata, key: block.label}
        node.excluded_embed_metadata_keys = [*item.node.excluded_embed_metadata_keys, key]
        out.append(NodeWithScore(node=node, score=item.score))
    return out + [item for item in nodes if is_blank(item)]


class ContextPilotPostprocessor(BaseNodePostprocessor):
    """Reorders retrieved nodes so shared ones form a common prefix (drop-in like
    ``LongContextReorder``); scores and metadata kept, no node dropped.

    Each node comes back as a copy labelled :data:`LABEL_KEY` (``ref``; shown to the LLM, not
    embedded); when the order changed, the order annotation joins the query string, which
    the QA template places after the context. The prepared request stays with the query
    (its instrumentation span): ``ContextPilotLLM`` / ``SGLangLLM`` answering that query
    send its id and report the engine's cached tokens.

    A postprocessor never sees the prompt, so it never replaces a node by a location
    reference: every node is sent in full (for multi-turn de-duplication use
    :class:`ContextPilotChatEngine`, which builds the prompt with its history).
    """

    pilot: Any = Field(default_factory=lambda: own_pilot("ContextPilotPostprocessor"), exclude=True)
    """A :class:`ContextPilot`, a router (``engines.Router``) or a ``MicroBatcher``."""
    annotate_query: bool = True
    """Append the order annotation to the query string (the QA template shows it after the context)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        span_binder()  # listening before the first query starts

    @classmethod
    def class_name(cls) -> str:
        return "ContextPilotPostprocessor"

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        if not nodes:
            return []
        query = query_bundle.query_str if query_bundle else ""
        binding = prepare_bound(self.pilot, to_blocks(nodes), query)
        deposit(binding)
        prepared = binding.prepared
        emit(prepared, nodes)
        annotation = prepared.order_annotation
        if query_bundle is not None and self.annotate_query and annotation and annotation not in query_bundle.query_str:
            query_bundle.query_str = f"{annotation}\n{query_bundle.query_str}"
        return in_send_order(prepared, nodes)
