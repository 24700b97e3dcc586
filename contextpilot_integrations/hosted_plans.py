"""The cache plan of one bound call to a hosted API, for the framework adapters.

Each adapter finds, in its own message types, how many history tokens precede the documents
and how many markers the messages already carry; the plan and OpenAI's
``prompt_cache_key`` follow from those counts alone, the same for every framework.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .binding import Binding
from .hosted_keys import leading_text_key
from .providers import CachePlan, plan_cache
from .providers.cache_key import ROUTING_TOKENS

__all__ = ["plan_bound_call", "with_cache_key"]


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
) -> dict[str, Any]:
    """The call's arguments with the plan's ``prompt_cache_key`` (a caller's own key wins).
    Documents after a conversation's start are keyed by the prompt's leading text
    (``texts``: the outgoing messages' texts, in order; see :mod:`.hosted_keys`)."""
    call_kwargs = dict(kwargs)
    if plan.prompt_cache_key and "prompt_cache_key" not in call_kwargs:
        key = plan.prompt_cache_key
        if follows_conversation or binding.before_tokens >= ROUTING_TOKENS:
            key = leading_text_key(texts())
        call_kwargs["prompt_cache_key"] = key
    return call_kwargs
