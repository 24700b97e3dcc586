"""A memory-aware RAG chat engine: documents already shown become location references."""

from __future__ import annotations

import asyncio
import math
import threading
import uuid
import warnings
from collections.abc import Callable
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole
from llama_index.core.chat_engine.types import AgentChatResponse, BaseChatEngine, StreamingAgentChatResponse
from llama_index.core.memory import Memory
from llama_index.core.schema import NodeWithScore

from contextpilot_integrations import ContextPilot, PreparedRequest, render_block
from contextpilot_integrations.core.prepared import resolve_history
from contextpilot_integrations.integration.implicit import own_pilot
from contextpilot_integrations.pilot.binding import Binding

from ._llm_calls import BINDING_KWARG, usage_of
from .base import emit, in_send_order, to_blocks
from .llms import ContextPilotLLM, SGLangLLM

__all__ = ["ContextPilotBindingWarning", "ContextPilotChatEngine"]


class ContextPilotBindingWarning(UserWarning):
    """The chat engine's LLM cannot send ContextPilot's request ids or report cached tokens."""


DEFAULT_ANSWER_TOKENS = 256
"""Room kept for the answer when the LLM does not say how long its answers are."""

_Turn = tuple[list[NodeWithScore], PreparedRequest, list[ChatMessage], ChatMessage]


class ContextPilotChatEngine(BaseChatEngine):
    """Memory-aware RAG chat: each turn's context stays in the history; documents already
    shown become location references while the turn that showed them is in the messages sent.

    The history sent is sized to the LLM: ``metadata.context_window`` minus the answer
    (``metadata.num_output``), the system prompt and this turn's message (counted as if every
    document were sent in full); older turns are left out whole, and a document whose turn
    was left out is sent in full again. Tokens are estimated from characters, calibrated on
    the engine's own ``prompt_tokens`` after each answer (or counted by ``token_counter``).

    Build it with :meth:`from_defaults`, like the stock chat engines.
    """

    def __init__(
        self,
        retriever: Any,
        llm: Any,
        memory: Any,
        pilot: ContextPilot,
        system_prompt: str | None = None,
        token_counter: Callable[[str], int] | None = None,
    ) -> None:
        from llama_index.core.callbacks import CallbackManager

        self._retriever = retriever
        self._llm = llm
        self._memory = memory
        self._pilot = pilot
        self._system_prompt = system_prompt
        self._token_counter = token_counter
        self._tokens_per_char = 0.5  # cautious until the engine reports its first count
        self._conversation_id = f"li-{uuid.uuid4().hex}"
        # the turns in memory: their user messages as sent, and their prepared requests
        self._turns: dict[int, tuple[str, PreparedRequest]] = {}
        self._lock = threading.Lock()
        self.callback_manager = CallbackManager([])
        if not isinstance(llm, (SGLangLLM, ContextPilotLLM)):
            warnings.warn(
                f"{type(llm).__name__} cannot send ContextPilot's request ids or report the engine's cached "
                "tokens: wrap it, ContextPilotLLM(llm=...), or use SGLangLLM.",
                ContextPilotBindingWarning,
                stacklevel=3,
            )

    @classmethod
    def from_defaults(
        cls,
        retriever: Any,
        llm: Any | None = None,
        memory: Any | None = None,
        pilot: ContextPilot | None = None,
        system_prompt: str | None = "Answer the question using the context documents.",
        token_limit: int | None = None,
        token_counter: Callable[[str], int] | None = None,
    ) -> ContextPilotChatEngine:
        """Args: the retriever, the LLM (default ``Settings.llm``), the memory (default a
        ``Memory`` of ``token_limit`` tokens, by default the LLM's context window), the shared
        pilot, the system prompt and an optional exact token counter."""
        from llama_index.core import Settings

        llm = llm or Settings.llm
        limit = token_limit or max(llm.metadata.context_window - _answer_tokens(llm), 1)
        return cls(
            retriever,
            llm,
            memory or Memory.from_defaults(token_limit=limit),
            pilot if pilot is not None else own_pilot("ContextPilotChatEngine"),
            system_prompt,
            token_counter,
        )

    @property
    def chat_history(self) -> list[ChatMessage]:
        return self._memory.get_all()

    def reset(self) -> None:
        self._memory.reset()
        with self._lock:
            self._pilot.end_conversation(self._conversation_id)
            self._conversation_id = f"li-{uuid.uuid4().hex}"
            self._turns.clear()

    # ---- one turn ------------------------------------------------------------------------
    def _tokens(self, text: str) -> int:
        if self._token_counter is not None:
            return self._token_counter(text)
        return math.ceil(len(text) * self._tokens_per_char)

    def _fitting(self, message: str, nodes: list[NodeWithScore], history: list[ChatMessage]) -> list[ChatMessage]:
        """The latest whole turns of ``history`` that fit the context window beside the
        answer, the system prompt and this turn (counted with every document in full)."""
        blocks = to_blocks(nodes)
        this_turn = "\n\n".join([*(render_block(block, self._pilot.templates) for block in blocks), message])
        room = self._llm.metadata.context_window - _answer_tokens(self._llm)
        room -= self._tokens(self._system_prompt or "") + self._tokens(this_turn) + 16 * (len(history) + 2)
        turns: list[list[ChatMessage]] = []
        for item in history:  # a turn: a user message and what follows it
            if item.role == MessageRole.USER or not turns:
                turns.append([])
            turns[-1].append(item)
        kept: list[ChatMessage] = []
        for turn in reversed(turns):
            size = sum(self._tokens(str(item.content or "")) for item in turn)
            if size > room:
                break
            room -= size
            kept = turn + kept
        return kept

    def _calibrate(self, messages: list[ChatMessage], response: ChatResponse) -> None:
        """Learn tokens per character from the engine's own prompt count (with a margin)."""
        prompt_tokens, _, _ = usage_of(response.raw)
        chars = sum(len(str(m.content or "")) for m in messages)
        if prompt_tokens and chars:
            self._tokens_per_char = 1.1 * prompt_tokens / chars

    def _prepare(
        self, message: str, nodes: list[NodeWithScore], history: list[ChatMessage]
    ) -> tuple[PreparedRequest, list[ChatMessage], ChatMessage]:
        history = self._fitting(message, nodes, history)
        shown = {m.content for m in history if m.role == MessageRole.USER}
        with self._lock:
            kept = {turn for turn, (text, _) in self._turns.items() if text in shown}
            for turn in set(self._turns) - kept:  # left the memory: it never comes back
                del self._turns[turn]
            earlier = [self._turns[turn][1] for turn in sorted(kept)]
            prepared = self._pilot.prepare(to_blocks(nodes), message, self._conversation_id, kept_turns=kept)
            user = ChatMessage(role=MessageRole.USER, content=prepared.render())
            self._turns[prepared.turn or 0] = (str(user.content), prepared)
        texts = [str(m.content or "") for m in history]
        if resolve_history(texts, earlier):  # a kept turn referred to one the memory dropped
            history = [
                m
                if str(m.content or "") == t
                else ChatMessage(role=m.role, content=t, additional_kwargs=m.additional_kwargs)
                for m, t in zip(history, texts, strict=True)
            ]
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
        """The prepared request, for our LLM classes (other LLMs take no extra argument)."""
        if isinstance(self._llm, (SGLangLLM, ContextPilotLLM)):
            return {BINDING_KWARG: Binding(self._pilot, prepared)}
        return {}

    @staticmethod
    def _response(prepared: PreparedRequest, nodes: list[NodeWithScore], response: ChatResponse) -> AgentChatResponse:
        metadata = {"request_id": prepared.request_id, "cached_tokens": response.additional_kwargs.get("cached_tokens")}
        return AgentChatResponse(
            response=str(response.message.content), source_nodes=in_send_order(prepared, nodes), metadata=metadata
        )

    def chat(self, message: str, chat_history: list[ChatMessage] | None = None) -> AgentChatResponse:
        nodes, prepared, messages, user = self._begin(message, chat_history)
        response = self._llm.chat(messages, **self._call_kwargs(prepared))
        self._calibrate(messages, response)
        self._memory.put(user)
        self._memory.put(response.message)
        return self._response(prepared, nodes, response)

    async def achat(self, message: str, chat_history: list[ChatMessage] | None = None) -> AgentChatResponse:
        nodes, prepared, messages, user = await self._abegin(message, chat_history)
        response = await self._llm.achat(messages, **self._call_kwargs(prepared))
        self._calibrate(messages, response)
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


def _answer_tokens(llm: Any) -> int:
    """Room the answer needs: the LLM's ``num_output`` (or ``max_tokens``), else a default."""
    for value in (getattr(llm.metadata, "num_output", None), getattr(llm, "max_tokens", None)):
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_ANSWER_TOKENS


def _with_text(message: ChatMessage, text: str) -> ChatMessage:
    """``message``, or a copy of it with ``text`` where its text differs."""
    if str(message.content or "") == text:
        return message
    return ChatMessage(role=message.role, content=text, additional_kwargs=message.additional_kwargs)
