"""Prompt text for documents that went through ContextPilot."""

from __future__ import annotations

from collections.abc import Sequence

from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda

from ._documents import METADATA_KEY

__all__ = ["format_documents", "format_documents_runnable"]


def format_documents(documents: Sequence[Document]) -> str:
    """The blocks (the shared prefix), the location references, then the order annotation.

    Documents without ContextPilot metadata are rendered as plain text blocks.
    """
    blocks, references, annotation, separator = [], [], "", "\n\n"
    for document in documents:
        info = document.metadata.get(METADATA_KEY) or {}
        if info.get("reference"):
            references.append(info["reference"])
        else:
            blocks.append(info.get("text") or document.page_content)  # rendered with the pilot's template
        annotation = info.get("order_annotation") or annotation
        separator = info.get("separator") or separator
    return separator.join(part for part in [*blocks, *references, annotation] if part)


format_documents_runnable = RunnableLambda(format_documents, name="contextpilot_format")
""":func:`format_documents` as a Runnable: ``retriever | format_documents_runnable``."""
