"""Anthropic's limit of four cache markers, kept at the last moment.

In an agent, middleware listed after ``ContextPilotMiddleware`` runs inside it: LangChain's
``AnthropicPromptCachingMiddleware`` there tags the system prompt, the last tool and the
message tail after ours has counted, and the API refuses a body with more than four
(HTTP 400). So the agent's ``ChatAnthropic`` is sent as a copy whose request payload, built
as the call leaves, keeps at most four: ours (:class:`OwnMark`) give way first, the deepest
first; the caller's and other middleware's stay.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

from contextpilot_integrations.integration.call_plan import MAX_MARKERS

__all__ = ["MarkerLimitWarning", "OwnMark", "limited"]


class OwnMark(dict):  # type: ignore[type-arg]
    """A ``cache_control`` value this package wrote: told apart from the caller's in the
    payload (the client keeps the value's object as it builds the body)."""


class MarkerLimitWarning(UserWarning):
    """Markers another middleware added after ours took the slots of some of ours."""


def limited(model: Any) -> Any:
    """``model`` (a ``ChatAnthropic``) as a copy that keeps the payload within the limit;
    ``model`` itself where its class builds no payload we know."""
    if not callable(getattr(type(model), "_get_request_payload", None)):
        return model
    for client in ("_client", "_async_client"):  # built once on the original, shared by every copy
        getattr(model, client, None)
    copy = model.model_copy()
    object.__setattr__(copy, "__class__", _limited_class(type(model)))
    return copy


_CLASSES: dict[type, type] = {}  # one subclass per model class (there are few)
_CLASSES_LOCK = threading.Lock()


def _limited_class(cls: type) -> type:
    if getattr(cls, "_contextpilot_limited", False):
        return cls
    with _CLASSES_LOCK:
        known = _CLASSES.get(cls)
        if known is None:
            known = _CLASSES[cls] = _subclass(cls)
        return known


def _subclass(cls: type) -> type:
    def _get_request_payload(self: Any, input_: Any, *, stop: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        payload: dict[str, Any] = cls._get_request_payload(self, input_, stop=stop, **kwargs)  # type: ignore[attr-defined]
        dropped = within_limit(payload)
        if dropped:
            warnings.warn(
                f"{dropped} of ContextPilot's cache markers gave way to markers added after them (Anthropic "
                f"takes {MAX_MARKERS}): list AnthropicPromptCachingMiddleware before ContextPilotMiddleware, "
                "which then places its own within what is left",
                MarkerLimitWarning,
                stacklevel=2,
            )
        return payload

    return type(
        cls.__name__,
        (cls,),
        {"_get_request_payload": _get_request_payload, "_contextpilot_limited": True, "__module__": __name__},
    )


def within_limit(payload: dict[str, Any]) -> int:
    """Drop ours, deepest first, until the payload carries at most the limit (the top-level
    ``cache_control`` takes a slot). Returns how many were dropped."""
    holders: list[dict[str, Any]] = []
    for part in ("system", "tools", "messages"):
        _collect(payload.get(part), holders)
    excess = len(holders) + bool(payload.get("cache_control")) - MAX_MARKERS
    dropped = 0
    for holder in reversed(holders):
        if dropped >= excess:
            break
        if isinstance(holder["cache_control"], OwnMark):
            del holder["cache_control"]
            dropped += 1
    return dropped


def _collect(node: Any, holders: list[dict[str, Any]]) -> None:
    """The dicts under ``node`` that carry a ``cache_control``, in payload order."""
    if isinstance(node, dict):
        if node.get("cache_control"):
            holders.append(node)
        for key, value in node.items():
            if key != "cache_control":
                _collect(value, holders)
    elif isinstance(node, list):
        for value in node:
            _collect(value, holders)
