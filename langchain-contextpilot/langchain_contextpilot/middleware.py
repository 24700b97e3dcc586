"""A LangChain v1 agent middleware: ContextPilot for agents whose tools return documents.

``create_agent(model, tools, middleware=[ContextPilotMiddleware(pilot=pilot)])`` (the
pattern of ``langchain-anthropic``'s ``AnthropicPromptCachingMiddleware``):

- **tool results**: a tool that returns documents as its artifact
  (``@tool(response_format="content_and_artifact")`` returning ``(text, documents)``) gets
  its result rewritten by the pilot: shared documents first, every document in full in the
  agent's state; documents that an earlier tool result carries are marked as location
  references to be;
- **every model call**: a marked document goes out as its location reference only where
  the very messages sent carry its text before it, so whatever rewrote the state
  (``SummarizationMiddleware``, a ``before_model`` trimmer, a ``wrap_model_call`` trimmer
  placed before this middleware), no reference ever leaves without its text, and the
  summarizer reads every document in full;
- **model calls**: the hosted provider's cache markers where the shared prefix ends
  (Anthropic ``cache_control``, Bedrock ``cachePoint``, OpenAI ``prompt_cache_key``; see
  :mod:`.cache_markers`), and the provider's cache reads and writes back to the pilot.

The conversation is the run's ``thread_id`` (or ``conversation_id``/``session_id``).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.messages import AIMessage, BaseMessage, SystemMessage, ToolMessage

try:
    from langchain.agents.middleware.types import AgentMiddleware, ModelRequest, ModelResponse
    from langgraph.prebuilt.tool_node import ToolCallRequest
    from langgraph.types import Command
except ImportError as exc:  # the base install has neither langchain nor langgraph
    raise ImportError("ContextPilotMiddleware needs langchain: pip install 'langchain-contextpilot[agents]'") from exc

from contextpilot_integrations.integration.call_plan import callers_cache_key, conversation_cache_key, mark_bound_call
from contextpilot_integrations.integration.implicit import own_pilot
from contextpilot_integrations.integration.model_call import ModelCall
from contextpilot_integrations.pilot.binding import Binding, prepare_bound
from contextpilot_integrations.pilot.ports import Preparer
from contextpilot_integrations.providers.cache_key import ConversationKeys

from . import cache_markers
from ._documents import conversation_id_from_config, is_blank, partition_from_config, to_blocks
from ._marker_limit import MarkerLimitWarning, limited
from ._model_calls import sent
from ._written import REFERENCES_KEY, REQUEST_KEY, TURN_KEY, as_sent, written_out
from .chat_models import ContextPilotChatModel

__all__ = [
    "MarkerLimitWarning",
    "REFERENCES_KEY",
    "REQUEST_KEY",
    "TURN_KEY",
    "ContextPilotMiddleware",
    "WrappedModelWarning",
]

_log = logging.getLogger(__name__)

MAX_PENDING = 1_000


class WrappedModelWarning(UserWarning):
    """The agent's model is a ``ContextPilotChatModel``: the middleware does its work in an
    agent, and the ecosystem's middleware (``AnthropicPromptCachingMiddleware``) accepts only
    the provider's own class."""


class ContextPilotMiddleware(AgentMiddleware):
    """ContextPilot's order, de-duplication and cache markers for a ``create_agent`` agent."""

    def __init__(
        self,
        pilot: Preparer[Any] | None = None,
        *,
        provider: str | None = "auto",
        document_tools: Sequence[str] | None = None,
        usage_feedback: bool = False,
    ) -> None:
        """
        Args:
            pilot: a :class:`ContextPilot` (a router or micro-batcher works too).
            provider: the hosted API whose cache to mark (``openai``, ``anthropic``,
                ``bedrock``, ``gemini``); ``"auto"``: from the agent's model class; ``None``:
                order and de-duplicate only.
            usage_feedback: take the provider's cache reads short of the prediction as
                evictions (off: a hosted API reads only at its entries, and in steps, so a
                short read is no eviction; forget requests on a timer with ``pilot.evict``).
            document_tools: names of the tools whose documents to handle (default: every tool that
                returns documents as its artifact).
        """
        super().__init__()
        if provider not in (None, "auto", *cache_markers.PROVIDERS):
            raise ValueError(f"provider must be one of {[*cache_markers.PROVIDERS, 'auto']} or None, got {provider!r}")
        self.pilot = pilot if pilot is not None else own_pilot("ContextPilotMiddleware")
        self.provider = provider
        self.document_tools = frozenset(document_tools) if document_tools is not None else None
        self.usage_feedback = usage_feedback
        self._pending: OrderedDict[str, Binding] = OrderedDict()  # request id -> prepared, until its model call
        self._lock = threading.Lock()
        self._keys = ConversationKeys()  # OpenAI: every call of a thread under the key of its first
        self._warned_wrapped = False

    # ---- tool results ----------------------------------------------------------------------------
    def _documents(self, request: ToolCallRequest, result: Any) -> list[Document] | None:
        if not isinstance(result, ToolMessage) or result.status == "error":
            return None
        names = self.document_tools
        if names is not None and result.name not in names and request.tool_call.get("name") not in names:
            return None
        artifact = result.artifact
        if isinstance(artifact, list) and artifact and all(isinstance(item, Document) for item in artifact):
            # blank documents show nothing: left out of the text; none but blank ones: the result as is
            return None if all(is_blank(item) for item in artifact) else artifact
        return None

    def _rewritten(self, request: ToolCallRequest, result: ToolMessage, documents: list[Document]) -> ToolMessage:
        state = request.state if isinstance(request.state, dict) else {}
        kept = {
            message.additional_kwargs[TURN_KEY]
            for message in state.get("messages") or []
            if isinstance(message, ToolMessage) and isinstance(message.additional_kwargs.get(TURN_KEY), int)
        }
        args = request.tool_call.get("args") or {}
        query = " ".join(str(value) for value in args.values() if isinstance(value, str)) or str(result.content)
        config = getattr(request.runtime, "config", None)
        binding = prepare_bound(
            self.pilot,
            to_blocks(documents),
            query,
            conversation_id_from_config(config),
            kept_turns=kept,
            partition=partition_from_config(config),
        )
        prepared = binding.prepared
        with self._lock:
            self._pending[prepared.request_id] = binding
            while len(self._pending) > MAX_PENDING:
                self._pending.popitem(last=False)
        content, spans = written_out(prepared)
        extra = {**result.additional_kwargs, REQUEST_KEY: prepared.request_id}
        if prepared.turn is not None:
            extra[TURN_KEY] = prepared.turn
        if spans:
            extra[REFERENCES_KEY] = spans
        return result.model_copy(update={"content": content, "additional_kwargs": extra})

    def wrap_tool_call(
        self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], ToolMessage | Command[Any]]
    ) -> ToolMessage | Command[Any]:
        result = handler(request)
        documents = self._documents(request, result)
        return result if documents is None else self._rewritten(request, result, documents)  # type: ignore[arg-type]

    async def awrap_tool_call(
        self,
        request: ToolCallRequest,
        handler: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]],
    ) -> ToolMessage | Command[Any]:
        result = await handler(request)
        documents = self._documents(request, result)
        return result if documents is None else self._rewritten(request, result, documents)  # type: ignore[arg-type]

    # ---- model calls -----------------------------------------------------------------------------
    def _take(self, messages: Sequence[BaseMessage]) -> tuple[Binding | None, str | None]:
        """The prepared request of this step's newest tool result (after the last AI
        message) that no call took yet, and the id that tool result carries."""
        for message in reversed(messages):
            if isinstance(message, AIMessage):
                break
            rid = message.additional_kwargs.get(REQUEST_KEY) if isinstance(message, ToolMessage) else None
            if isinstance(rid, str):
                with self._lock:
                    binding = self._pending.pop(rid, None)
                if binding is not None:
                    return binding, rid
        return None, None

    def _prepared_call(self, request: ModelRequest) -> tuple[ModelRequest, ModelCall, str | None]:
        """The request to send (markers placed), the call around it, and its provider."""
        self._check_model(request.model)
        binding, rid = self._take(request.messages)
        system = [request.system_message] if request.system_message is not None else []
        if binding is None or rid is None:
            messages, _ = as_sent([*system, *request.messages])
            history: dict[str, Any] = {"messages": messages[len(system) :]}
            return self._keyed(request.override(**history), messages), ModelCall(None), None
        call = ModelCall(binding, retake=lambda failed: self._retake(rid, failed))
        provider = self._resolve(request.model)
        settings = dict(request.model_settings)
        inner = getattr(request.model, "llm", request.model)
        body = {**self._model_kwargs(request.model), **(getattr(inner, "extra_body", None) or {}), **settings}
        # the engine's cache partition it goes to; rid: this call's tool result
        messages = sent(call, [*system, *request.messages], body, rid)
        bound = call.binding or binding
        if provider is not None:
            messages, settings = mark_bound_call(
                bound,
                messages,
                settings,
                lambda: cache_markers.mark_messages(
                    provider,
                    cache_markers.model_name(request.model),
                    bound,
                    messages,
                    settings,
                    conversation=True,
                    tools=request.tools,
                    settings=[self._model_kwargs(request.model)],
                    callers_key=callers_cache_key(settings, getattr(request.model, "llm", request.model)),
                    keys=self._keys,
                ),
                _log,
            )
        head = messages[0] if system else None
        overrides: dict[str, Any] = {"messages": messages[len(system) :], "model_settings": settings}
        if provider == "anthropic":  # middleware inside this one may add markers after ours
            overrides["model"] = limited(request.model)
        if isinstance(head, SystemMessage):
            overrides["system_message"] = head
        return request.override(**overrides), call, provider

    def _check_model(self, model: Any) -> None:
        if self._warned_wrapped or not isinstance(model, ContextPilotChatModel):
            return
        self._warned_wrapped = True
        warnings.warn(
            f"the agent's model is a ContextPilotChatModel around {type(model.llm).__name__}: pass "
            f"{type(model.llm).__name__} itself to create_agent. ContextPilotMiddleware does for tool results "
            "what ContextPilotChatModel does in a chain, and AnthropicPromptCachingMiddleware accepts only "
            "ChatAnthropic (wrapped, it places no marker); list it before ContextPilotMiddleware, which "
            "counts its markers",
            WrappedModelWarning,
            stacklevel=2,
        )

    def _keyed(self, request: ModelRequest, messages: Sequence[BaseMessage]) -> ModelRequest:
        """A call with no tool result of ours (the first of a turn): on OpenAI, in a thread,
        the thread's key, so every call of the conversation goes to one cache."""
        conversation = conversation_id_from_config(None)
        if self._resolve(request.model) != "openai" or conversation is None:
            return request
        settings = conversation_cache_key(
            request.model_settings,
            conversation,
            lambda: [cache_markers.text_of(message) for message in messages],
            self._keys,
            callers_key=callers_cache_key(request.model_settings, getattr(request.model, "llm", request.model)),
        )
        return request if settings == request.model_settings else request.override(model_settings=settings)

    @staticmethod
    def _model_kwargs(model: Any) -> dict[str, Any]:
        """The model's own ``model_kwargs`` (a top-level ``cache_control`` there takes a slot)."""
        inner = getattr(model, "llm", model)
        return dict(getattr(inner, "model_kwargs", None) or {})

    def _resolve(self, model: Any) -> str | None:
        if self.provider is None:
            return None
        if self.provider != "auto":
            return self.provider
        inner = getattr(model, "llm", model)  # a ContextPilotChatModel around a provider's model
        return cache_markers.provider_of(inner)

    def _report(self, call: ModelCall, provider: str | None, response: Any) -> None:
        if call.binding is None:
            return
        messages = getattr(response, "result", None) or []
        answer = next((message for message in messages if isinstance(message, AIMessage)), None)
        if answer is not None:
            call.served_hosted(cache_markers.raw_usage(answer, provider), provider, usage_feedback=self.usage_feedback)

    def _retake(self, rid: str, failed: Binding) -> None:
        """The call failed (the pilot forgot the request): a retry (``ModelRetryMiddleware``
        around this one) takes it again, under a new id."""
        retry = Binding(failed.pilot, failed.pilot.adopt(failed.prepared, fresh_id=True))
        with self._lock:
            self._pending[rid] = retry

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]) -> Any:
        request, call, provider = self._prepared_call(request)
        try:
            response = handler(request)
        except BaseException as exc:
            call.failed(exc)
            raise
        self._report(call, provider, response)
        return response

    async def awrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
    ) -> Any:
        request, call, provider = self._prepared_call(request)
        try:
            response = await handler(request)
        except BaseException as exc:  # cancelled too: the request may never have left
            call.failed(exc)
            raise
        self._report(call, provider, response)
        return response
