"""LangChain components: ContextPilot between a retriever and the model.

- :class:`ContextPilotRetriever` wraps any retriever and returns the same documents in
  send order (shared ones first);
- :class:`ContextPilotPostprocessor` does the same as a document compressor (for
  ``ContextualCompressionRetriever``) and, via :meth:`~ContextPilotPostprocessor.as_runnable`,
  as an LCEL step after a retriever;
- :func:`format_documents` renders them (blocks, location references, order annotation)
  into the prompt text;
- :class:`ChatSGLang` is ``ChatOpenAI`` that sends the request id to SGLang and reports the
  server's cached tokens as ``usage_metadata["input_token_details"]["cache_read"]``;
- :class:`ConversationalRAG` is multi-turn RAG with memory, where documents already shown
  in the conversation become location references.

The annotation and references travel in each document's ``metadata["contextpilot"]``,
never as an extra document, so a retriever still returns exactly k documents. The
conversation id comes from the run config: ``configurable.conversation_id``, ``thread_id``
or ``session_id`` (LangGraph, ``RunnableWithMessageHistory``), else ``metadata``.
Needs the ``langchain`` extra.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
    Callbacks,
    adispatch_custom_event,
    dispatch_custom_event,
)
from langchain_core.documents import BaseDocumentCompressor, Document
from langchain_core.retrievers import BaseRetriever, RetrieverLike
from langchain_core.runnables import RunnableConfig, RunnableLambda, ensure_config
from langchain_openai import ChatOpenAI
from pydantic import ConfigDict, Field, model_validator

from .annotations import render_block
from .blocks import Block, content_id
from .errors import BlockTypeError
from .pilot import ContextPilot
from .prepared import PreparedRequest

__all__ = [
    "ChatSGLang",
    "ConversationalRAG",
    "ContextPilotPostprocessor",
    "ContextPilotRetriever",
    "contextpilot_reorder",
    "conversation_id_from_config",
    "format_documents",
    "format_documents_runnable",
]

CONVERSATION_KEYS = ("conversation_id", "thread_id", "session_id")
METADATA_KEY = "contextpilot"
EVENT_NAME = "contextpilot_prepared"


def conversation_id_from_config(config: RunnableConfig | None = None) -> str | None:
    """``configurable.conversation_id`` / ``thread_id`` / ``session_id``, else ``metadata``."""
    config = ensure_config(config)
    for source in (config.get("configurable") or {}, config.get("metadata") or {}):
        for key in CONVERSATION_KEYS:
            value = source.get(key)
            if value:
                return str(value)
    return None


def _document_id(document: Document) -> str | None:
    block_id = document.id or document.metadata.get("id")
    return str(block_id) if block_id else None


def _to_blocks(documents: Sequence[Document]) -> list[Block]:
    blocks = []
    for position, document in enumerate(documents):
        if not isinstance(document, Document):
            raise BlockTypeError(f"document #{position}: expected a Document, got {type(document).__name__}")
        if not isinstance(document.page_content, str):
            raise BlockTypeError(f"document #{position}: page_content must be str")
        blocks.append(Block(id=_document_id(document), text=document.page_content, metadata=document.metadata))  # type: ignore[arg-type]
    return blocks


def _documents(prepared: PreparedRequest, documents: Sequence[Document]) -> list[Document]:
    """The retrieved documents in send order (sent ones, then referenced ones), annotated."""
    by_id: dict[str, Document] = {}
    for document in documents:  # the same identity as the blocks: given id, else content hash
        by_id.setdefault(_document_id(document) or content_id(document.page_content), document)
    shared = {
        "request_id": prepared.request_id,
        "order_annotation": prepared.order_annotation,
        "separator": prepared.templates.separator,
    }
    ranks = {block.id: rank for rank, block in enumerate(prepared.ranking)}
    out = []
    for position, block in enumerate(prepared.blocks):
        rendered = render_block(block, prepared.templates)
        info = {**shared, "label": block.label, "rank": ranks[block.id], "position": position, "text": rendered}
        out.append(_annotated(by_id[block.id], {**info, "reference": None}))
    for reference in prepared.references:
        block = reference.block
        info = {**shared, "label": block.label, "rank": ranks[block.id], "position": None, "text": None}
        out.append(_annotated(by_id[block.id], {**info, "reference": reference.text}))
    return out


def _annotated(document: Document, info: dict[str, Any]) -> Document:
    return Document(
        page_content=document.page_content, id=document.id, metadata={**document.metadata, METADATA_KEY: info}
    )


def format_documents(documents: Sequence[Document]) -> str:
    """Prompt text for documents that went through ContextPilot: the blocks (the shared
    prefix), the location references, then the order annotation. Documents without
    ContextPilot metadata are rendered as plain text blocks."""
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


def _event_data(prepared: PreparedRequest) -> dict[str, Any]:
    return {
        "request_id": prepared.request_id,
        "conversation_id": prepared.conversation_id,
        "turn": prepared.turn,
        "sent": [b.id for b in prepared.blocks],
        "references": [r.block.id for r in prepared.references],
        "reordered": prepared.reordered,
        "predicted_cached_tokens": prepared.cached_tokens,
    }


class ContextPilotPostprocessor(BaseDocumentCompressor):
    """Reorders retrieved documents for prefix-cache reuse (a document compressor).

    Use it in ``ContextualCompressionRetriever(base_compressor=..., base_retriever=...)``
    or, through :meth:`as_runnable`, after a retriever in LCEL: ``retriever | pp.as_runnable()``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    pilot: ContextPilot = Field(default_factory=ContextPilot)
    conversation_id: str | None = None
    """A fixed conversation; otherwise it is read from the run's metadata/config."""

    def _conversation(self, callbacks: Callbacks) -> str | None:
        if self.conversation_id:
            return self.conversation_id
        metadata = getattr(callbacks, "metadata", None) or {}
        for key in CONVERSATION_KEYS:
            if metadata.get(key):
                return str(metadata[key])
        return conversation_id_from_config()

    def compress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        prepared = self.pilot.prepare(_to_blocks(documents), query, self._conversation(callbacks))
        if callbacks is not None:
            dispatch_custom_event(EVENT_NAME, _event_data(prepared), config={"callbacks": callbacks})
        return _documents(prepared, documents)

    async def acompress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        prepared = await self.pilot.aprepare(_to_blocks(documents), query, self._conversation(callbacks))
        if callbacks is not None:
            await adispatch_custom_event(EVENT_NAME, _event_data(prepared), config={"callbacks": callbacks})
        return _documents(prepared, documents)

    def as_runnable(self) -> RunnableLambda:
        """An LCEL step taking ``list[Document]`` or ``{"documents": [...], "question": str}``."""

        def reorder(value: Any, config: RunnableConfig) -> list[Document]:
            documents, query = _documents_and_query(value)
            prepared = self.pilot.prepare(
                _to_blocks(documents), query, self.conversation_id or conversation_id_from_config(config)
            )
            dispatch_custom_event(EVENT_NAME, _event_data(prepared), config=config)
            return _documents(prepared, documents)

        async def areorder(value: Any, config: RunnableConfig) -> list[Document]:
            documents, query = _documents_and_query(value)
            conversation = self.conversation_id or conversation_id_from_config(config)
            prepared = await self.pilot.aprepare(_to_blocks(documents), query, conversation)
            await adispatch_custom_event(EVENT_NAME, _event_data(prepared), config=config)
            return _documents(prepared, documents)

        return RunnableLambda(reorder, afunc=areorder, name="contextpilot_reorder")


def _documents_and_query(value: Any) -> tuple[list[Document], str]:
    if isinstance(value, dict):
        return list(value.get("documents") or value.get("docs") or []), str(
            value.get("question") or value.get("query") or ""
        )
    return list(value), ""


def contextpilot_reorder(pilot: ContextPilot | None = None, conversation_id: str | None = None) -> RunnableLambda:
    """The LCEL step ``retriever | contextpilot_reorder(pilot)``: documents in send order."""
    return ContextPilotPostprocessor(pilot=pilot or ContextPilot(), conversation_id=conversation_id).as_runnable()


format_documents_runnable = RunnableLambda(format_documents, name="contextpilot_format")
""":func:`format_documents` as a Runnable: ``retriever | format_documents_runnable``."""


class ContextPilotRetriever(BaseRetriever):
    """Wraps a retriever: the same documents (the first ``k``), in send order.

    The conversation id is read from the run config (see the module docstring).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    base_retriever: RetrieverLike
    pilot: ContextPilot = Field(default_factory=ContextPilot)
    k: int | None = None
    """Keep at most this many of the base retriever's documents (``None``: all)."""

    def invoke(self, input: str, config: RunnableConfig | None = None, **kwargs: Any) -> list[Document]:
        kwargs.setdefault("_cp_conversation", conversation_id_from_config(config))
        return super().invoke(input, config, **kwargs)

    async def ainvoke(self, input: str, config: RunnableConfig | None = None, **kwargs: Any) -> list[Document]:
        kwargs.setdefault("_cp_conversation", conversation_id_from_config(config))
        return await super().ainvoke(input, config, **kwargs)

    def _get_relevant_documents(
        self,
        query: str,
        *,
        run_manager: CallbackManagerForRetrieverRun,
        _cp_conversation: str | None = None,
        k: int | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        documents = self.base_retriever.invoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        documents = documents[: k or self.k or len(documents)]
        prepared = self.pilot.prepare(_to_blocks(documents), query, _cp_conversation)
        dispatch_custom_event(EVENT_NAME, _event_data(prepared), config={"callbacks": run_manager.get_child()})
        return _documents(prepared, documents)

    async def _aget_relevant_documents(
        self,
        query: str,
        *,
        run_manager: AsyncCallbackManagerForRetrieverRun,
        _cp_conversation: str | None = None,
        k: int | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        documents = await self.base_retriever.ainvoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        documents = documents[: k or self.k or len(documents)]
        prepared = await self.pilot.aprepare(_to_blocks(documents), query, _cp_conversation)
        await adispatch_custom_event(EVENT_NAME, _event_data(prepared), config={"callbacks": run_manager.get_child()})
        return _documents(prepared, documents)


class ChatSGLang(ChatOpenAI):
    """``ChatOpenAI`` for SGLang (and other OpenAI-compatible servers with a prefix cache).

    Each call sends a request id (``rid`` and ``session_id`` in the body): the one in the
    run config (``metadata["contextpilot_request_id"]``, e.g. from a document's
    ``metadata["contextpilot"]["request_id"]``) or a fresh one. Streaming reports usage,
    so ``usage_metadata["input_token_details"]["cache_read"]`` carries the server's cached
    tokens for invoke, ainvoke, stream, astream and batch alike.
    """

    stream_usage: bool | None = True

    @model_validator(mode="before")
    @classmethod
    def _local_server_needs_no_key(cls, values: Any) -> Any:
        """A local engine takes any key: use ``SGLANG_API_KEY`` or ``"EMPTY"``, never
        ``OPENAI_API_KEY`` (which would send an OpenAI key to another server)."""
        if isinstance(values, dict) and values.get("api_key") is None and values.get("openai_api_key") is None:
            values = {**values, "api_key": os.environ.get("SGLANG_API_KEY") or "EMPTY"}
        return values

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return False

    def _with_rid(self, config: RunnableConfig | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        config = ensure_config(config)
        rid = (config.get("metadata") or {}).get("contextpilot_request_id") or (config.get("configurable") or {}).get(
            "contextpilot_request_id"
        )
        rid = str(rid) if rid else f"cp-{uuid.uuid4().hex}"
        extra = {**(self.extra_body or {}), **(kwargs.get("extra_body") or {}), "rid": rid, "session_id": rid}
        return {**kwargs, "extra_body": extra}

    def invoke(
        self, input: Any, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any
    ) -> Any:
        return super().invoke(input, config, stop=stop, **self._with_rid(config, kwargs))

    async def ainvoke(
        self, input: Any, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any
    ) -> Any:
        return await super().ainvoke(input, config, stop=stop, **self._with_rid(config, kwargs))

    def stream(
        self, input: Any, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any
    ) -> Iterator[Any]:
        yield from super().stream(input, config, stop=stop, **self._with_rid(config, kwargs))

    async def astream(
        self, input: Any, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        async for chunk in super().astream(input, config, stop=stop, **self._with_rid(config, kwargs)):
            yield chunk


class ConversationalRAG:
    """Multi-turn RAG with memory: documents already shown in the conversation become
    location references, as long as the turn that showed them is still in the history.

    Each turn's user message (its context and question) and the answer stay in the
    conversation's history, which is a prefix the engine caches; the last ``max_turns``
    turns are sent, and a document whose turn fell out of that window is sent again.

    Args:
        retriever: any LangChain retriever (its documents, best first).
        llm: a chat model (``ChatSGLang`` reports cached tokens and sends the request id).
        pilot: the shared :class:`ContextPilot`.
        system_prompt: the first message of every call.
        max_turns: earlier turns kept in the messages sent.
    """

    def __init__(
        self,
        retriever: RetrieverLike,
        llm: Any,
        pilot: ContextPilot | None = None,
        *,
        system_prompt: str = "Answer the question using the context documents.",
        max_turns: int = 8,
    ) -> None:
        self.retriever = retriever
        self.llm = llm
        self.pilot = pilot or ContextPilot()
        self.system_prompt = system_prompt
        self.max_turns = max_turns
        self._turns: dict[str, list[tuple[int, str, str]]] = {}  # conversation -> (turn, user text, answer)
        self._lock = threading.Lock()

    def history(self, conversation_id: str) -> list[tuple[int, str, str]]:
        """(turn, user message, answer) of the turns kept for this conversation."""
        with self._lock:
            return list(self._turns.get(conversation_id, []))

    def reset(self, conversation_id: str) -> None:
        with self._lock:
            self._turns.pop(conversation_id, None)
        self.pilot.end_conversation(conversation_id)

    def _messages(self, conversation_id: str, prepared: PreparedRequest, kept: list[tuple[int, str, str]]) -> list[Any]:
        from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

        messages: list[Any] = [SystemMessage(self.system_prompt)]
        for _, user, answer in kept:
            messages += [HumanMessage(user), AIMessage(answer)]
        messages.append(HumanMessage(prepared.render()))
        return messages

    def _prepare(
        self, question: str, config: RunnableConfig | None, documents: list[Document]
    ) -> tuple[str, PreparedRequest, list[Any]]:
        conversation_id = conversation_id_from_config(config) or "default"
        kept = self.history(conversation_id)[-self.max_turns :]
        prepared = self.pilot.prepare(
            _to_blocks(documents), question, conversation_id, kept_turns={turn for turn, _, _ in kept}
        )
        return conversation_id, prepared, self._messages(conversation_id, prepared, kept)

    def _record(self, conversation_id: str, prepared: PreparedRequest, answer: Any) -> None:
        with self._lock:
            turns = self._turns.setdefault(conversation_id, [])
            turns.append((prepared.turn or 0, prepared.render(), str(answer.content)))
            del turns[: -self.max_turns]

    def _llm_config(self, config: RunnableConfig | None, prepared: PreparedRequest) -> RunnableConfig:
        config = ensure_config(config)
        return {
            **config,
            "metadata": {**(config.get("metadata") or {}), "contextpilot_request_id": prepared.request_id},
        }

    def invoke(self, question: str, config: RunnableConfig | None = None) -> Any:
        """One turn: retrieve, de-duplicate against the kept history, ask, remember."""
        documents = self.retriever.invoke(question, config=config)
        conversation_id, prepared, messages = self._prepare(question, config, documents)
        answer = self.llm.invoke(messages, config=self._llm_config(config, prepared))
        self._record(conversation_id, prepared, answer)
        return answer

    async def ainvoke(self, question: str, config: RunnableConfig | None = None) -> Any:
        """Async variant of :meth:`invoke`."""
        documents = await self.retriever.ainvoke(question, config=config)
        conversation_id, prepared, messages = self._prepare(question, config, documents)
        answer = await self.llm.ainvoke(messages, config=self._llm_config(config, prepared))
        self._record(conversation_id, prepared, answer)
        return answer
