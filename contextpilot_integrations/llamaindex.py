"""LlamaIndex components: ContextPilot in query engines and a memory-aware chat engine.

- :class:`ContextPilotPostprocessor` goes where ``LongContextReorder`` goes
  (``index.as_query_engine(node_postprocessors=[...])``): nodes come back in send order,
  scores and metadata kept; each node is a copy labelled ``contextpilot_label`` (shown to
  the LLM, not embedded) and the order annotation joins the query string, which the QA
  template places after the context;
- :class:`ContextPilotChatEngine` keeps each turn's context in the chat history and sends
  documents already shown as location references, until the memory's token limit drops
  the turn that showed them;
- :class:`SGLangLLM` is ``OpenAILike`` (chat) that sends the request id and exposes the
  server's cached tokens in ``response.additional_kwargs["cached_tokens"]``.

Each step emits a :class:`ContextPilotEvent` through LlamaIndex's instrumentation
dispatcher. Needs the ``llamaindex`` extra.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole
from llama_index.core.bridge.pydantic import Field
from llama_index.core.chat_engine.types import AgentChatResponse, BaseChatEngine, StreamingAgentChatResponse
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.base import BaseEvent
from llama_index.core.memory import Memory
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle
from llama_index.llms.openai_like import OpenAILike

from .blocks import Block
from .pilot import ContextPilot
from .prepared import PreparedRequest

__all__ = ["ContextPilotChatEngine", "ContextPilotEvent", "ContextPilotPostprocessor", "SGLangLLM"]

dispatcher = get_dispatcher(__name__)
LABEL_KEY = "contextpilot_label"
REQUEST_ID_KWARG = "contextpilot_request_id"


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


def _blocks(nodes: Sequence[NodeWithScore]) -> list[Block]:
    return [
        Block(id=item.node.node_id, text=item.node.get_content(metadata_mode=MetadataMode.NONE) or " ", metadata={})
        for item in nodes
    ]


def _event(prepared: PreparedRequest, nodes: Sequence[NodeWithScore]) -> ContextPilotEvent:
    return ContextPilotEvent(
        request_id=prepared.request_id,
        conversation_id=prepared.conversation_id,
        turn=prepared.turn,
        retrieved=[n.node.node_id for n in nodes],
        sent=[b.id for b in prepared.blocks],
        references=[r.block.id for r in prepared.references],
    )


def _in_send_order(prepared: PreparedRequest, nodes: Sequence[NodeWithScore]) -> list[NodeWithScore]:
    """Copies of the nodes in send order, labelled; originals (and docstore) untouched."""
    by_id = {item.node.node_id: item for item in nodes}
    out = []
    for block in [*prepared.blocks, *(r.block for r in prepared.references)]:
        item = by_id[block.id]
        node = item.node.model_copy(deep=False)
        node.metadata = {**item.node.metadata, LABEL_KEY: block.label}
        node.excluded_embed_metadata_keys = [*item.node.excluded_embed_metadata_keys, LABEL_KEY]
        out.append(NodeWithScore(node=node, score=item.score))
    return out


class ContextPilotPostprocessor(BaseNodePostprocessor):
    """Reorders retrieved nodes so shared ones form a common prefix (drop-in like
    ``LongContextReorder``)."""

    pilot: ContextPilot = Field(default_factory=ContextPilot, exclude=True)
    conversation_id: str | None = None
    annotate_query: bool = True
    """Append the order annotation to the query string (the QA template shows it after the context)."""

    @classmethod
    def class_name(cls) -> str:
        return "ContextPilotPostprocessor"

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        if not nodes:
            return []
        query = query_bundle.query_str if query_bundle else ""
        prepared = self.pilot.prepare(_blocks(nodes), query, self.conversation_id)
        dispatcher.event(_event(prepared, nodes))
        annotation = prepared.order_annotation
        if query_bundle is not None and self.annotate_query and annotation and annotation not in query_bundle.query_str:
            query_bundle.query_str = f"{annotation}\n{query_bundle.query_str}"
        return _in_send_order(prepared, nodes)


class SGLangLLM(OpenAILike):
    """``OpenAILike`` chat model that sends a request id and reports cached tokens.

    The id is the one the chat engine passes for the call (``contextpilot_request_id=``),
    else a fresh one; it goes out as ``rid`` and ``session_id``.
    """

    is_chat_model: bool = True

    def __init__(self, **kwargs: Any) -> None:
        # a local engine takes any key: "EMPTY" unless one is given (never OPENAI_API_KEY)
        if kwargs.get("api_key") is None:
            kwargs["api_key"] = os.environ.get("SGLANG_API_KEY") or "EMPTY"
        super().__init__(**kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "SGLangLLM"

    def _get_model_kwargs(self, **kwargs: Any) -> dict[str, Any]:
        rid = kwargs.pop(REQUEST_ID_KWARG, None) or f"cp-{uuid.uuid4().hex}"
        model_kwargs = super()._get_model_kwargs(**kwargs)
        model_kwargs["extra_body"] = {**(model_kwargs.get("extra_body") or {}), "rid": rid, "session_id": rid}
        if model_kwargs.get("stream"):
            model_kwargs.setdefault("stream_options", {"include_usage": True})
        return model_kwargs

    @staticmethod
    def _with_cached_tokens(response: ChatResponse) -> ChatResponse:
        usage = getattr(response.raw, "usage", None) if response.raw is not None else None
        if isinstance(response.raw, dict):
            usage = response.raw.get("usage")
        details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else getattr(details, "cached_tokens", None)
        if cached is not None:
            response.additional_kwargs["cached_tokens"] = cached
        return response

    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._with_cached_tokens(super().chat(messages, **kwargs))

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._with_cached_tokens(await super().achat(messages, **kwargs))

    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Generator[ChatResponse, None, None]:
        for response in super().stream_chat(messages, **kwargs):
            yield self._with_cached_tokens(response)

    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> AsyncGenerator[ChatResponse, None]:
        stream = await super().astream_chat(messages, **kwargs)

        async def gen() -> AsyncGenerator[ChatResponse, None]:
            async for response in stream:
                yield self._with_cached_tokens(response)

        return gen()


_Turn = tuple[list[NodeWithScore], PreparedRequest, list[ChatMessage], ChatMessage]


class ContextPilotChatEngine(BaseChatEngine):
    """Memory-aware RAG chat: each turn's context stays in the history; documents already
    shown become location references while the turn that showed them is in memory.

    Build it with :meth:`from_defaults`, like the stock chat engines.
    """

    def __init__(
        self,
        retriever: Any,
        llm: Any,
        memory: Any,
        pilot: ContextPilot,
        system_prompt: str | None = None,
    ) -> None:
        from llama_index.core.callbacks import CallbackManager

        self._retriever = retriever
        self._llm = llm
        self._memory = memory
        self._pilot = pilot
        self._system_prompt = system_prompt
        self._conversation_id = f"li-{uuid.uuid4().hex}"
        self._turn_texts: dict[int, str] = {}
        self._lock = threading.Lock()
        self.callback_manager = CallbackManager([])

    @classmethod
    def from_defaults(
        cls,
        retriever: Any,
        llm: Any | None = None,
        memory: Any | None = None,
        pilot: ContextPilot | None = None,
        system_prompt: str | None = "Answer the question using the context documents.",
        token_limit: int = 30_000,
    ) -> ContextPilotChatEngine:
        """Args: the retriever, the LLM (default ``Settings.llm``), the memory (default a
        ``Memory`` with ``token_limit``), the shared pilot and the system prompt."""
        from llama_index.core import Settings

        return cls(
            retriever,
            llm or Settings.llm,
            memory or Memory.from_defaults(token_limit=token_limit),
            pilot or ContextPilot(),
            system_prompt,
        )

    @property
    def chat_history(self) -> list[ChatMessage]:
        return self._memory.get_all()

    def reset(self) -> None:
        self._memory.reset()
        with self._lock:
            self._pilot.end_conversation(self._conversation_id)
            self._conversation_id = f"li-{uuid.uuid4().hex}"
            self._turn_texts.clear()

    # ---- one turn ------------------------------------------------------------------------
    def _prepare(
        self, message: str, nodes: list[NodeWithScore], history: list[ChatMessage]
    ) -> tuple[PreparedRequest, list[ChatMessage], ChatMessage]:
        shown = {m.content for m in history if m.role == MessageRole.USER}
        with self._lock:
            kept = {turn for turn, text in self._turn_texts.items() if text in shown}
            prepared = self._pilot.prepare(_blocks(nodes), message, self._conversation_id, kept_turns=kept)
            user = ChatMessage(role=MessageRole.USER, content=prepared.render())
            self._turn_texts[prepared.turn or 0] = user.content  # type: ignore[assignment]
        dispatcher.event(_event(prepared, nodes))
        messages = [ChatMessage(role=MessageRole.SYSTEM, content=self._system_prompt)] if self._system_prompt else []
        return prepared, [*messages, *history, user], user

    def _begin(self, message: str, chat_history: list[ChatMessage] | None) -> _Turn:
        """Retrieve and prepare a turn: (nodes, prepared request, messages to send, user message)."""
        if chat_history is not None:
            self._memory.set(chat_history)
        nodes = self._retriever.retrieve(message)
        return (nodes, *self._prepare(message, nodes, self._memory.get()))

    async def _abegin(self, message: str, chat_history: list[ChatMessage] | None) -> _Turn:
        if chat_history is not None:
            await self._memory.aset(chat_history)
        nodes = await self._retriever.aretrieve(message)
        return (nodes, *self._prepare(message, nodes, await self._memory.aget()))

    def _call_kwargs(self, prepared: PreparedRequest) -> dict[str, Any]:
        """The request id for :class:`SGLangLLM` (other LLMs take no extra argument)."""
        return {REQUEST_ID_KWARG: prepared.request_id} if isinstance(self._llm, SGLangLLM) else {}

    @staticmethod
    def _response(prepared: PreparedRequest, nodes: list[NodeWithScore], response: ChatResponse) -> AgentChatResponse:
        metadata = {"request_id": prepared.request_id, "cached_tokens": response.additional_kwargs.get("cached_tokens")}
        return AgentChatResponse(
            response=str(response.message.content), source_nodes=_in_send_order(prepared, nodes), metadata=metadata
        )

    def chat(self, message: str, chat_history: list[ChatMessage] | None = None) -> AgentChatResponse:
        nodes, prepared, messages, user = self._begin(message, chat_history)
        response = self._llm.chat(messages, **self._call_kwargs(prepared))
        self._memory.put(user)
        self._memory.put(response.message)
        return self._response(prepared, nodes, response)

    async def achat(self, message: str, chat_history: list[ChatMessage] | None = None) -> AgentChatResponse:
        nodes, prepared, messages, user = await self._abegin(message, chat_history)
        response = await self._llm.achat(messages, **self._call_kwargs(prepared))
        await self._memory.aput(user)
        await self._memory.aput(response.message)
        return self._response(prepared, nodes, response)

    def stream_chat(self, message: str, chat_history: list[ChatMessage] | None = None) -> StreamingAgentChatResponse:
        nodes, prepared, messages, user = self._begin(message, chat_history)
        stream = self._llm.stream_chat(messages, **self._call_kwargs(prepared))
        self._memory.put(user)
        response = StreamingAgentChatResponse(chat_stream=stream, source_nodes=_in_send_order(prepared, nodes))
        thread = threading.Thread(target=response.write_response_to_history, args=(self._memory,))
        response.write_response_to_history_thread = thread
        thread.start()
        return response

    async def astream_chat(
        self, message: str, chat_history: list[ChatMessage] | None = None
    ) -> StreamingAgentChatResponse:
        nodes, prepared, messages, user = await self._abegin(message, chat_history)
        stream = await self._llm.astream_chat(messages, **self._call_kwargs(prepared))
        await self._memory.aput(user)
        response = StreamingAgentChatResponse(achat_stream=stream, source_nodes=_in_send_order(prepared, nodes))
        response.awrite_response_to_history_task = asyncio.create_task(
            response.awrite_response_to_history(self._memory)
        )
        return response
