"""Multi-turn RAG with memory: documents already shown become location references."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForChainRun, CallbackManagerForChainRun
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage
from langchain_core.retrievers import RetrieverLike
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from langchain_core.runnables.config import patch_config
from pydantic import ConfigDict, Field, PrivateAttr, SkipValidation

from contextpilot_integrations import BlockTypeError, PreparedRequest
from contextpilot_integrations.core.prepared import resolve_history
from contextpilot_integrations.integration.implicit import own_pilot
from contextpilot_integrations.pilot.binding import Binding, aprepare_bound, prepare_bound
from contextpilot_integrations.pilot.ports import Preparer

from ._binding import deposit
from ._documents import conversation_id_from_config, partition_from_config, to_blocks

__all__ = ["ConversationalRAG"]


@dataclass(frozen=True, slots=True)
class _Turn:
    user: str
    answer: str
    prepared: PreparedRequest
    known: bool = True
    """The pilot still knows this turn under ``prepared.turn`` (it numbers a conversation it
    ended or dropped afresh from 0: such turns stay in the history, never referred to)."""


_Turns = OrderedDict[int, _Turn]  # this conversation's turns, numbered in the order they were asked


class ConversationalRAG(RunnableSerializable[Any, BaseMessage]):
    """Multi-turn RAG with memory, as a Runnable: documents already shown in the
    conversation become location references, while the turn that showed them is in the
    messages sent.

    Input: the question, or ``{"question": ..., "history": [messages]}`` when the caller
    keeps the history (``RunnableWithMessageHistory(rag, ..., input_messages_key=
    "question", history_messages_key="history")``). Output: the model's ``AIMessage``.
    A caller's history de-duplicates only where it holds the user messages this component
    sent (context included); ``RunnableWithMessageHistory`` keeps the bare questions, so
    there is nothing in it to refer to and each turn sends its documents in full, as
    without ContextPilot. De-duplication needs this component's own memory (no history given).
    ``invoke``, ``ainvoke``, ``stream``, ``astream`` and ``batch`` all work, and it pipes.

    The conversation is the run config's ``configurable.conversation_id``, ``thread_id``
    or ``session_id``; without one, each call is a conversation of its own (nothing shared
    between callers). Without a caller's history, it keeps each conversation's last
    ``max_turns`` turns (user message with its context, and answer) and sends them; at most
    ``max_conversations`` conversations, each forgotten after ``conversation_ttl`` idle
    seconds. A reference is only made to a turn whose user message is in the history sent.

    Args:
        retriever: any LangChain retriever (best first); not a ``ContextPilotRetriever``:
            this component prepares the request itself.
        llm: a chat model; ``ContextPilotChatModel`` or ``ChatSGLang`` send the prepared
            request's id and report the engine's cached tokens.
        pilot: the shared :class:`ContextPilot` (or a router / micro-batcher).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: RetrieverLike
    llm: Any
    pilot: SkipValidation[Preparer[Any]] = Field(default_factory=lambda: own_pilot("ConversationalRAG"))
    system_prompt: str = "Answer the question using the context documents."
    max_turns: int = Field(default=8, ge=0)
    max_conversations: int = Field(default=10_000, ge=1)
    conversation_ttl: float | None = 3600.0

    _turns: OrderedDict[str, tuple[float, _Turns]] = PrivateAttr(default_factory=OrderedDict)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    def __init__(
        self, retriever: RetrieverLike | None = None, llm: Any = None, pilot: Any = None, **kwargs: Any
    ) -> None:
        """``ConversationalRAG(retriever, llm, pilot, ...)`` or all by keyword."""
        given: dict[str, Any] = {"retriever": retriever, "llm": llm, "pilot": pilot}
        super().__init__(**{name: value for name, value in given.items() if value is not None}, **kwargs)

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return False

    # ---- the kept history --------------------------------------------------------------------
    def history(self, conversation_id: str) -> list[tuple[int, str, str]]:
        """(turn, user message, answer) of the turns kept for this conversation, in the order
        they were asked (turns numbered from 0 by this component)."""
        with self._lock:
            self._expire()
            _, turns = self._turns.get(conversation_id, (0.0, OrderedDict()))
            return [(number, turn.user, turn.answer) for number, turn in turns.items()]

    def reset(self, conversation_id: str) -> None:
        """Forget a conversation (its kept turns and the pilot's record of what it showed)."""
        with self._lock:
            self._turns.pop(conversation_id, None)
        ender = getattr(self.pilot, "end_conversation", None)
        if ender is not None:
            ender(conversation_id)

    def _expire(self) -> None:
        if self.conversation_ttl is not None:
            horizon = time.monotonic() - self.conversation_ttl
            while self._turns and next(iter(self._turns.values()))[0] < horizon:
                self._turns.popitem(last=False)

    def _record(self, conversation_id: str | None, binding: Binding, user: str, answer: BaseMessage) -> None:
        if conversation_id is None or binding.prepared.turn is None:
            return
        turn = binding.prepared.turn
        with self._lock:
            _, turns = self._turns.pop(conversation_id, (0.0, OrderedDict()))
            if any(kept.known and (kept.prepared.turn or 0) >= turn for kept in turns.values()):
                # the pilot ended or dropped the conversation and numbers it afresh
                turns = OrderedDict((number, replace(kept, known=False)) for number, kept in turns.items())
            turns[next(reversed(turns)) + 1 if turns else 0] = _Turn(user, _text(answer), binding.prepared)
            while len(turns) > max(self.max_turns, 1):
                turns.popitem(last=False)
            self._turns[conversation_id] = (time.monotonic(), turns)
            while len(self._turns) > self.max_conversations:
                self._turns.popitem(last=False)

    # ---- one turn ----------------------------------------------------------------------------
    def _begin(self, input: Any, config: RunnableConfig) -> tuple[str, str | None, list[BaseMessage], set[int] | None]:
        """The question, the conversation, the history to send and the turns it carries.

        A kept turn's own references may point at a turn that left the window: those are
        sent as full text (the history sent never refers to what it does not carry)."""
        question, given = _question_and_history(input)
        conversation_id = conversation_id_from_config(config)
        if conversation_id is None:
            return question, None, list(given or []), None
        with self._lock:
            self._expire()
            _, turns = self._turns.get(conversation_id, (0.0, OrderedDict()))
            turns = OrderedDict(turns)
        if given is None:  # our own memory: the last max_turns turns
            sent = list(turns.values())[-self.max_turns :] if self.max_turns else []
            history: list[BaseMessage] = []
            for turn in sent:
                history += [HumanMessage(turn.user), AIMessage(turn.answer)]
        else:
            history = list(given)
            shown = {_text(message) for message in given if isinstance(message, HumanMessage)}
            sent = [turn for turn in turns.values() if turn.user in shown]
        kept = {turn.prepared.turn for turn in sent if turn.known and turn.prepared.turn is not None}
        return question, conversation_id, _resolved(history, [turn.prepared for turn in sent]), kept

    def _messages(self, binding: Binding, history: list[BaseMessage]) -> tuple[str, list[BaseMessage]]:
        user = binding.prepared.render()
        return user, [SystemMessage(self.system_prompt), *history, HumanMessage(user)]

    def _turn(
        self, input: Any, run_manager: CallbackManagerForChainRun, config: RunnableConfig
    ) -> tuple[str | None, Binding, str, list[BaseMessage], RunnableConfig]:
        question, conversation_id, history, kept = self._begin(input, config)
        child = patch_config(config, callbacks=run_manager.get_child())
        documents = _documents(self.retriever.invoke(question, config=child))
        binding = prepare_bound(
            self.pilot,
            to_blocks(documents),
            question,
            conversation_id,
            kept_turns=kept,
            partition=partition_from_config(config),
        )
        deposit(run_manager, run_manager.run_id, binding)
        return conversation_id, binding, *self._messages(binding, history), child

    async def _aturn(
        self, input: Any, run_manager: AsyncCallbackManagerForChainRun, config: RunnableConfig
    ) -> tuple[str | None, Binding, str, list[BaseMessage], RunnableConfig]:
        question, conversation_id, history, kept = self._begin(input, config)
        child = patch_config(config, callbacks=run_manager.get_child())
        documents = _documents(await self.retriever.ainvoke(question, config=child))
        binding = await aprepare_bound(
            self.pilot,
            to_blocks(documents),
            question,
            conversation_id,
            kept_turns=kept,
            partition=partition_from_config(config),
        )
        deposit(run_manager, run_manager.run_id, binding)
        return conversation_id, binding, *self._messages(binding, history), child

    def _invoke(self, input: Any, run_manager: CallbackManagerForChainRun, config: RunnableConfig) -> BaseMessage:
        conversation_id, binding, user, messages, child = self._turn(input, run_manager, config)
        answer = self.llm.invoke(messages, config=child)
        self._record(conversation_id, binding, user, answer)
        return answer  # type: ignore[no-any-return]

    async def _ainvoke(
        self, input: Any, run_manager: AsyncCallbackManagerForChainRun, config: RunnableConfig
    ) -> BaseMessage:
        conversation_id, binding, user, messages, child = await self._aturn(input, run_manager, config)
        answer = await self.llm.ainvoke(messages, config=child)
        self._record(conversation_id, binding, user, answer)
        return answer  # type: ignore[no-any-return]

    def _stream(
        self, inputs: Iterator[Any], run_manager: CallbackManagerForChainRun, config: RunnableConfig
    ) -> Iterator[BaseMessage]:
        for input in inputs:
            conversation_id, binding, user, messages, child = self._turn(input, run_manager, config)
            answer: Any = None
            for chunk in self.llm.stream(messages, config=child):
                answer = chunk if answer is None else answer + chunk
                yield chunk
            self._record(conversation_id, binding, user, answer if answer is not None else AIMessageChunk(content=""))

    async def _astream(
        self, inputs: AsyncIterator[Any], run_manager: AsyncCallbackManagerForChainRun, config: RunnableConfig
    ) -> AsyncIterator[BaseMessage]:
        async for input in inputs:
            conversation_id, binding, user, messages, child = await self._aturn(input, run_manager, config)
            answer: Any = None
            async for chunk in self.llm.astream(messages, config=child):
                answer = chunk if answer is None else answer + chunk
                yield chunk
            self._record(conversation_id, binding, user, answer if answer is not None else AIMessageChunk(content=""))

    # ---- the Runnable interface --------------------------------------------------------------
    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> BaseMessage:
        """One turn: retrieve, de-duplicate against the history sent, ask, remember."""
        return self._call_with_config(self._invoke, input, config, **kwargs)

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> BaseMessage:
        return await self._acall_with_config(self._ainvoke, input, config, **kwargs)

    def stream(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[BaseMessage]:
        yield from self._transform_stream_with_config(iter([input]), self._stream, config, **kwargs)

    async def astream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[BaseMessage]:
        async def one() -> AsyncIterator[Any]:
            yield input

        async for chunk in self._atransform_stream_with_config(one(), self._astream, config, **kwargs):
            yield chunk


def _question_and_history(input: Any) -> tuple[str, list[BaseMessage] | None]:
    if isinstance(input, str):
        return input, None
    if isinstance(input, dict):
        question = input.get("question", input.get("input"))
        history = input.get("history")
        if isinstance(question, BaseMessage):
            question = _text(question)
        if isinstance(question, str) and (history is None or isinstance(history, Sequence)):
            return question, None if history is None else list(history)
    raise BlockTypeError(f"expected a question (str) or {{'question': str, 'history': [messages]}}, got {input!r:.80}")


def _resolved(history: list[BaseMessage], requests: list[PreparedRequest]) -> list[BaseMessage]:
    """The history with every reference whose target it does not carry written out in full."""
    texts = [_text(message) for message in history]
    if not resolve_history(texts, requests):
        return history
    return [
        message if _text(message) == text else message.model_copy(update={"content": text})
        for message, text in zip(history, texts, strict=True)
    ]


def _documents(value: Any) -> list[Document]:
    return list(value)


def _text(message: Any) -> str:
    content = getattr(message, "content", message)
    if isinstance(content, str):
        return content
    return "".join(part if isinstance(part, str) else str(part.get("text", "")) for part in content)
