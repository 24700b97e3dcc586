"""Prompt text for documents that went through ContextPilot."""

from __future__ import annotations

from collections.abc import Sequence

from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda

from ._documents import METADATA_KEY

__all__ = ["format_documents", "format_documents_runnable"]


def format_documents(documents: Sequence[Document]) -> str:
    """The documents in the order given (ContextPilot's: the blocks, the shared prefix, and
    the location references, each in the place the model reads it), then the order annotation.

    Documents without ContextPilot metadata are rendered as plain text blocks; a second
    source of a document already shown (``duplicate_of``) adds nothing.
    """
    parts, annotation, separator = [], "", "\n\n"
    for document in documents:
        info = document.metadata.get(METADATA_KEY) or {}
        if info.get("duplicate_of"):  # another source of a document shown already
            continue
        parts.append(info.get("reference") or info.get("text") or document.page_content)  # the pilot's rendering
        annotation = info.get("order_annotation") or annotation
        separator = info.get("separator") or separator
    return separator.join(part for part in [*parts, annotation] if part)


format_documents_runnable = RunnableLambda(format_documents, name="contextpilot_format")
""":func:`format_documents` as a Runnable: ``retriever | format_documents_runnable``."""
