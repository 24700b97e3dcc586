"""A memory-aware RAG chat engine: documents already shown become location references."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole
from llama_index.core.chat_engine.types import AgentChatResponse, BaseChatEngine, StreamingAgentChatResponse
from llama_index.core.memory import Memory
from llama_index.core.schema import NodeWithScore

from contextpilot_integrations import ContextPilot, PreparedRequest

from .base import emit, in_send_order, to_blocks
from .llms import REQUEST_ID_KWARG, SGLangLLM

__all__ = ["ContextPilotChatEngine"]

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
            prepared = self._pilot.prepare(to_blocks(nodes), message, self._conversation_id, kept_turns=kept)
            user = ChatMessage(role=MessageRole.USER, content=prepared.render())
            self._turn_texts[prepared.turn or 0] = user.content  # type: ignore[assignment]
        emit(prepared, nodes)
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
            response=str(response.message.content), source_nodes=in_send_order(prepared, nodes), metadata=metadata
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
        response = StreamingAgentChatResponse(chat_stream=stream, source_nodes=in_send_order(prepared, nodes))
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
        response = StreamingAgentChatResponse(achat_stream=stream, source_nodes=in_send_order(prepared, nodes))
        response.awrite_response_to_history_task = asyncio.create_task(
            response.awrite_response_to_history(self._memory)
        )
        return response
