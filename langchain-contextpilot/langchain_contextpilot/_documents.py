"""Documents <-> blocks, and where a run's conversation id comes from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.runnables import RunnableConfig, ensure_config

from contextpilot_integrations import (
    Block,
    BlockTypeError,
    InvalidBlockError,
    PreparedRequest,
    Reference,
    content_id,
    partition_of_body,
)
from contextpilot_integrations.core.validation import check_partition

CONVERSATION_KEYS = ("conversation_id", "thread_id", "session_id")
METADATA_KEY = "contextpilot"
EVENT_NAME = "contextpilot_prepared"


def conversation_id_from_config(config: RunnableConfig | None = None) -> str | None:
    """``configurable.conversation_id`` / ``thread_id`` / ``session_id``, else ``metadata``.

    Without a config, the run's config in context (set by chains and graphs) is read.
    """
    config = ensure_config(config)
    for source in (config.get("configurable") or {}, config.get("metadata") or {}):
        for key in CONVERSATION_KEYS:
            value = source.get(key)
            if value:
                return str(value)
    return None


def partition_from_config(config: RunnableConfig | None = None) -> str | None:
    """The engine's cache partition of this invocation: ``configurable.cache_partition`` (a name
    from :func:`~contextpilot_integrations.cache_partition`), else one made of
    ``configurable.cache_salt``, ``extra_key`` and ``lora_path`` (the body fields the engine
    partitions by), else the same in ``metadata``; ``None``: the engine's default one. A model
    call whose body names another partition moves the request there (it sends it there)."""
    config = ensure_config(config)
    for source in (config.get("configurable") or {}, config.get("metadata") or {}):
        named = source.get("cache_partition")
        if named is not None:
            check_partition(named)
            return str(named)
        derived = partition_of_body(source)
        if derived is not None:
            return derived
    return None


def document_id(document: Document) -> str | None:
    block_id = document.id or document.metadata.get("id")
    return str(block_id) if block_id else None


def is_blank(document: Document) -> bool:
    """A document with no text to show (empty or whitespace): nothing to order or send."""
    return isinstance(document.page_content, str) and not document.page_content.strip()


def to_blocks(documents: Sequence[Document]) -> list[Block]:
    """The retrieved documents as blocks (same identity: the document id, else a content
    hash). Blank documents are left out (:func:`in_send_order` passes them through)."""
    blocks = []
    for position, document in enumerate(documents):
        if not isinstance(document, Document):
            raise BlockTypeError(f"document #{position}: expected a Document, got {type(document).__name__}")
        if not isinstance(document.page_content, str):
            raise BlockTypeError(f"document #{position}: page_content must be str")
        if is_blank(document):
            continue
        try:
            blocks.append(Block(id=document_id(document), text=document.page_content, metadata=document.metadata))
        except (BlockTypeError, InvalidBlockError) as exc:
            raise type(exc)(f"document #{position} (id {document.id!r}): {exc}") from exc
    return blocks


def in_send_order(prepared: PreparedRequest, documents: Sequence[Document]) -> list[Document]:
    """The retrieved documents in the order the model reads them (:attr:`PreparedRequest.sequence`), annotated in
    ``metadata["contextpilot"]`` (never as an extra document); blank documents last, as
    given (they carry no text, so where they go changes nothing the model reads). A
    document given again under the same id and text (two sources of one chunk) follows its
    first copy, marked ``duplicate_of`` with nothing to show: its text is sent once, and
    every document comes back."""
    by_id: dict[str, list[Document]] = {}
    for document in documents:
        if not is_blank(document):
            by_id.setdefault(document_id(document) or content_id(document.page_content), []).append(document)
    shared = {
        "request_id": prepared.request_id,
        "order_annotation": prepared.order_annotation,
        "separator": prepared.templates.separator,
    }
    ranks = {block.id: rank for rank, block in enumerate(prepared.ranking)}
    out = []
    position = 0
    for part in prepared.sequence:  # as the model reads them: references after the blocks, or in place
        fields: dict[str, Any]
        if isinstance(part, Reference):
            block, fields = part.block, {"position": None, "text": None, "reference": part.text}
        else:
            block, fields = part, {"position": position, "text": prepared.rendered(part), "reference": None}
            position += 1
        info = {**shared, "label": block.label, "rank": ranks[block.id], **fields}
        first, *again = by_id[block.id]
        out.append(_annotated(first, info))
        shown_once = {**info, "position": None, "text": None, "reference": None, "duplicate_of": block.label}
        out += [_annotated(document, shown_once) for document in again]
    return out + [document for document in documents if is_blank(document)]


def _annotated(document: Document, info: dict[str, Any]) -> Document:
    return Document(
        page_content=document.page_content, id=document.id, metadata={**document.metadata, METADATA_KEY: info}
    )


def event_data(prepared: PreparedRequest) -> dict[str, Any]:
    """The payload of the ``contextpilot_prepared`` custom event (for tracing)."""
    return {
        "request_id": prepared.request_id,
        "conversation_id": prepared.conversation_id,
        "turn": prepared.turn,
        "sent": [b.id for b in prepared.blocks],
        "references": [r.block.id for r in prepared.references],
        "reordered": prepared.reordered,
        "predicted_cached_tokens": prepared.cached_tokens,
    }
