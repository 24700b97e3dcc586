"""ContextPilot as a LlamaIndex node postprocessor (where ``LongContextReorder`` goes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.base import BaseEvent
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle
from pydantic import SkipValidation

from contextpilot_integrations import Block, BlockTypeError, InvalidBlockError, PreparedRequest, Reference
from contextpilot_integrations.integration.implicit import own_pilot
from contextpilot_integrations.pilot.binding import prepare_bound
from contextpilot_integrations.pilot.ports import Preparer

from ._binding import deposit, span_binder

__all__ = ["ContextPilotEvent", "ContextPilotPostprocessor"]

dispatcher = get_dispatcher(__name__)
LABEL_KEY = "ref"
"""The metadata key of a node's label, shown to the LLM as ``ref: 545`` before every node: short,
since every node of every prompt carries it (``contextpilot_label`` cost 20 characters a node)."""
FALLBACK_LABEL_KEY = "contextpilot_label"
"""Used instead where a node's own metadata already has :data:`LABEL_KEY`."""
DUPLICATE_KEY = "duplicate_of"
"""The metadata key that tells the LLM a node repeats the one before it (two sources of one chunk)."""
FALLBACK_DUPLICATE_KEY = "contextpilot_duplicate_of"
"""Used instead where a node's own metadata already has :data:`DUPLICATE_KEY`."""


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
    A node given again under the same id and text (two sources of one chunk) follows its first
    copy, showing the LLM its own metadata but not the text again (:func:`shown_once`).
    Blank nodes last, as given (no text: where they go changes nothing the LLM reads)."""
    by_id: dict[str, list[NodeWithScore]] = {}
    for item in nodes:
        if not is_blank(item):
            by_id.setdefault(item.node.node_id, []).append(item)
    out = []
    for part in prepared.sequence:  # as the model reads them
        block = part.block if isinstance(part, Reference) else part
        first, *again = by_id[block.id]
        label = block.label if prepared.labels else None
        if label is None:  # sent as without ContextPilot: the node as retrieved
            out.append(first)
        else:
            node = first.node.model_copy(deep=False)
            key = FALLBACK_LABEL_KEY if LABEL_KEY in first.node.metadata else LABEL_KEY
            node.metadata = {**first.node.metadata, key: label}
            node.excluded_embed_metadata_keys = [*first.node.excluded_embed_metadata_keys, key]
            out.append(NodeWithScore(node=node, score=first.score))
        out += [shown_once(item, label) for item in again]
    return out + [item for item in nodes if is_blank(item)]


def shown_once(item: NodeWithScore, label: str | None) -> NodeWithScore:
    """A copy of a second source of a node shown just before it: the synthesizer renders its
    metadata and :data:`DUPLICATE_KEY` (the first copy's label, or "above") but not the text,
    which the prompt carries already. The text stays in the node for the caller."""
    node = item.node
    if "text_template" not in type(node).model_fields:  # a node type we cannot render without its text
        return item
    key = FALLBACK_DUPLICATE_KEY if DUPLICATE_KEY in node.metadata else DUPLICATE_KEY
    copy = node.model_copy(deep=False)
    copy.metadata = {**node.metadata, key: label or "above"}
    copy.excluded_llm_metadata_keys = [name for name in node.excluded_llm_metadata_keys if name != key]
    copy.excluded_embed_metadata_keys = [*node.excluded_embed_metadata_keys, key]
    copy.text_template = "{metadata_str}"  # type: ignore[attr-defined]
    return NodeWithScore(node=copy, score=item.score)


class ContextPilotPostprocessor(BaseNodePostprocessor):
    """Reorders retrieved nodes so shared ones form a common prefix (drop-in like
    ``LongContextReorder``); scores and metadata kept, no node dropped (a second source of
    a node comes back after the first, its text sent once: :func:`shown_once`).

    Each node comes back as a copy labelled :data:`LABEL_KEY` (``ref``; shown to the LLM, not
    embedded); when the order changed, the order annotation joins the query string, which
    the QA template places after the context. The prepared request stays with the query
    (its instrumentation span): ``ContextPilotLLM`` / ``SGLangLLM`` answering that query
    send its id and report the engine's cached tokens.

    A postprocessor never sees the prompt, so it never replaces a node by a location
    reference: every node is sent in full (for multi-turn de-duplication use
    :class:`ContextPilotChatEngine`, which builds the prompt with its history).
    """

    pilot: SkipValidation[Preparer[Any]] = Field(
        default_factory=lambda: own_pilot("ContextPilotPostprocessor"), exclude=True
    )
    """A :class:`ContextPilot`, a router (``engines.Router``) or a ``MicroBatcher``."""
    annotate_query: bool = True
    """Append the order annotation to the query string (the QA template shows it after the context)."""
    partition: str | None = None
    """The engine's cache partition its queries go to (:func:`~contextpilot_integrations.cache_partition`:
    a tenant's ``cache_salt``, a LoRA adapter); an LLM call whose body names another moves it there."""

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
        binding = prepare_bound(self.pilot, to_blocks(nodes), query, partition=self.partition)
        deposit(binding)
        prepared = binding.prepared
        emit(prepared, nodes)
        annotation = prepared.order_annotation
        if query_bundle is not None and self.annotate_query and annotation and annotation not in query_bundle.query_str:
            query_bundle.query_str = f"{annotation}\n{query_bundle.query_str}"
        return in_send_order(prepared, nodes)
