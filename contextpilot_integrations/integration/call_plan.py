"""The cache plan of one bound call to a hosted API, for the framework adapters.

Each adapter finds, in its own message types, how many history tokens precede the documents
and how many markers the messages already carry; the plan and OpenAI's
``prompt_cache_key`` follow from those counts alone, the same for every framework:

- :func:`markers_left`: the provider allows 4 markers a request, and the request may carry
  some before ours: on the messages, on a tool definition (``cache_control`` on a tool,
  ``{"cachePoint": ...}`` among Bedrock's tools) and Anthropic's top-level ``cache_control``
  request parameter (its automatic marker takes a slot too); ours get what is left;
- :func:`callers_cache_key`, :func:`with_cache_key`: a ``prompt_cache_key`` the caller set
  (call argument, the model's field or ``model_kwargs``) wins and is sent as set; ours is
  then left out, with a :class:`~contextpilot_integrations.errors.CacheKeyWarning`. A
  conversation keeps the key of its first request
  (:class:`~contextpilot_integrations.providers.cache_key.ConversationKeys`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..errors import CacheKeyWarning
from ..pilot.binding import Binding
from ..providers.cache_key import ROUTING_TOKENS, ConversationKeys, leading_text_key
from ..providers.plan import CachePlan, plan_cache

__all__ = [
    "MAX_MARKERS",
    "MarkedCall",
    "callers_cache_key",
    "carried_markers",
    "conversation_cache_key",
    "mark_bound_call",
    "markers_left",
    "plan_bound_call",
    "with_cache_key",
]

MAX_MARKERS = 4
"""Cache markers a request may carry (Anthropic ``cache_control``, Bedrock ``cachePoint``,
OpenAI ``prompt_cache_breakpoint``): a fifth is refused with HTTP 400."""
_TOOL_MARKERS = {"anthropic": ("cache_control",), "bedrock": ("cachePoint", "cache_control")}

M = TypeVar("M")
"""A framework's message type."""


def carried_markers(provider: str, *, tools: Iterable[Any] = (), settings: Iterable[Mapping[str, Any]] = ()) -> int:
    """Markers a request carries outside its messages: one per marked tool definition
    (a dict with ``cache_control``, a Bedrock ``{"cachePoint": ...}`` entry, or a tool
    object whose ``extras`` carry ``cache_control``), and one for Anthropic's top-level
    ``cache_control`` found in any of ``settings`` (call arguments, ``model_kwargs``)."""
    names = _TOOL_MARKERS.get(provider, ())
    count = 0
    for tool in tools or ():
        fields = tool if isinstance(tool, Mapping) else getattr(tool, "extras", None) or {}
        count += any(fields.get(name) for name in names)
    top_level = provider == "anthropic" and any(setting.get("cache_control") for setting in settings if setting)
    return count + top_level


def markers_left(
    provider: str, in_messages: int, *, tools: Iterable[Any] = (), settings: Iterable[Mapping[str, Any]] = ()
) -> int:
    """Markers ours may add: the provider's 4 less those on the messages (``in_messages``)
    and those :func:`carried_markers` finds."""
    return max(MAX_MARKERS - in_messages - carried_markers(provider, tools=tools, settings=settings), 0)


def callers_cache_key(kwargs: Mapping[str, Any], model: Any = None) -> str | None:
    """The ``prompt_cache_key`` the caller set: a call argument, else the model's own field,
    ``model_kwargs`` (LangChain) or ``additional_kwargs`` (LlamaIndex); ``None``: none."""
    sources: list[Any] = [kwargs, {"prompt_cache_key": getattr(model, "prompt_cache_key", None)}]
    sources += [getattr(model, "model_kwargs", None), getattr(model, "additional_kwargs", None)]
    for source in sources:
        key = source.get("prompt_cache_key") if isinstance(source, Mapping) else None
        if isinstance(key, str) and key:
            return key
    return None


def plan_bound_call(
    binding: Binding, provider: str, model: str | None, *, history_tokens: int, max_breakpoints: int
) -> CachePlan:
    """The plan for ``binding``'s request: the prompt before its documents is the system
    part plus ``history_tokens`` of resent history; ``max_breakpoints`` markers are left."""
    prepared = binding.prepared
    depths = binding.pilot.shared_depths(prepared) if hasattr(binding.pilot, "shared_depths") else None
    return plan_cache(
        prepared,
        provider,  # type: ignore[arg-type]
        model,
        prefix_tokens=max(binding.before_tokens - history_tokens, 0),
        history_tokens=history_tokens if binding.before_tokens >= history_tokens else 0,
        max_breakpoints=max_breakpoints,
        shared_depths=depths,
    )


def with_cache_key(
    plan: CachePlan,
    kwargs: Mapping[str, Any],
    binding: Binding,
    texts: Callable[[], Sequence[str]],
    *,
    follows_conversation: bool = False,
    callers_key: str | None = None,
    keys: ConversationKeys | None = None,
) -> dict[str, Any]:
    """The call's arguments with the plan's ``prompt_cache_key``.

    A key the caller set (in ``kwargs`` or ``callers_key``, see :func:`callers_cache_key`)
    wins: ours is left out, with a :class:`CacheKeyWarning`. Documents after a
    conversation's start are keyed by the prompt's leading text (``texts``: the outgoing
    messages' texts, in order; see :mod:`contextpilot_integrations.providers.cache_key`); with
    ``keys``, every request of a conversation goes under the key of its first."""
    call_kwargs = dict(kwargs)
    conversation = binding.prepared.conversation_id if keys is not None else None
    if not plan.prompt_cache_key and conversation is None:
        return call_kwargs
    own = kwargs.get("prompt_cache_key") or callers_key
    if own:
        _warn_kept(own)
        return call_kwargs

    def first() -> str | None:
        if follows_conversation or binding.before_tokens >= ROUTING_TOKENS or not plan.prompt_cache_key:
            return leading_text_key(texts())
        return plan.prompt_cache_key

    key = keys.key_for(conversation, first) if keys is not None and conversation is not None else first()
    if key is not None:
        call_kwargs["prompt_cache_key"] = key
    return call_kwargs


def conversation_cache_key(
    kwargs: Mapping[str, Any],
    conversation_id: str | None,
    texts: Callable[[], Sequence[str]],
    keys: ConversationKeys,
    *,
    callers_key: str | None = None,
) -> dict[str, Any]:
    """A call with no documents of ours (an agent's first model call of a turn), in a
    conversation: its arguments with the conversation's key (the key of its first request,
    or this prompt's leading text for a first one). A caller's own key stays, as sent."""
    call_kwargs = dict(kwargs)
    if conversation_id is None or kwargs.get("prompt_cache_key") or callers_key:
        return call_kwargs
    key = keys.key_for(conversation_id, lambda: leading_text_key(texts()))
    if key is not None:
        call_kwargs["prompt_cache_key"] = key
    return call_kwargs


def _warn_kept(callers: str) -> None:
    warnings.warn(
        f"the caller's prompt_cache_key {callers!r} is sent as set; ContextPilot's own key "
        "(shared by requests with the same leading documents) is not. Drop yours to let "
        "ContextPilot route requests that share a prefix to one cache",
        CacheKeyWarning,
        stacklevel=3,
    )


@dataclass(frozen=True)
class MarkedCall(Generic[M]):
    """The messages to send (copies, markers written), the call's extra arguments, and the
    plan they follow: what an adapter's marking function returns."""

    messages: list[M]
    kwargs: dict[str, Any]
    plan: CachePlan
    placed: int
    """Markers written (block markers and the history marker)."""


def mark_bound_call(
    binding: Binding,
    messages: list[M],
    kwargs: dict[str, Any],
    mark: Callable[[], MarkedCall[M]],
    log: logging.Logger,
) -> tuple[list[M], dict[str, Any]]:
    """Plan and write one bound call's cache markers (``mark``: the adapter's own, in its
    message types) and count the plan in the request's pilot. A model or request the rules
    do not cover (``mark`` raises ``TypeError`` or ``ValueError``) is sent unmarked, with a
    warning on the adapter's ``log``, and counts nothing: a marker is an optimisation, never
    a reason to fail the call. Returns the messages and arguments to send."""
    try:
        marked = mark()
    except (TypeError, ValueError) as exc:
        log.warning("no cache markers for request %r: %s", binding.prepared.request_id, exc)
        return messages, kwargs
    binding.pilot.note_cache_plan(marked.plan)
    return marked.messages, marked.kwargs
