"""The hosted providers' prompt-cache markers, on LlamaIndex chat messages.

The core's ``plan_cache`` says where the shared prefix of a prepared request ends; this
module writes it in LlamaIndex's own form, on copies of the outgoing messages:

- Anthropic (``llama_index.llms.anthropic.Anthropic``): the text up to the end of a planned
  block becomes its own ``TextBlock``, followed by a ``CachePoint`` (the Anthropic
  integration turns it into ``cache_control`` on that block);
- OpenAI (``llama_index.llms.openai.OpenAI``): the plan's ``prompt_cache_key`` as a call
  argument (it goes into the request body).

Every marker the request carries besides ours counts against Anthropic's limit of four:
``CachePoint`` blocks, a message's own ``additional_kwargs["cache_control"]``, the messages
``Anthropic(cache_idx=...)`` marks, and a ``cache_control`` request argument.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import CacheControl, CachePoint, ChatMessage, MessageRole, TextBlock

from contextpilot_integrations.core.annotations import render_block
from contextpilot_integrations.core.blocks import CHARS_PER_TOKEN
from contextpilot_integrations.integration.call_plan import MarkedCall, markers_left, plan_bound_call, with_cache_key
from contextpilot_integrations.pilot.binding import Binding
from contextpilot_integrations.providers.cache_key import ConversationKeys

__all__ = ["PROVIDERS", "MarkedChat", "mark_chat", "model_name", "provider_of"]

PROVIDERS = ("openai", "anthropic")


def provider_of(llm: Any) -> str | None:
    """The hosted provider a LlamaIndex LLM talks to, from its class (``OpenAI`` only at
    OpenAI's own URL; ``OpenAILike`` and other engines: ``None``)."""
    for cls in type(llm).__mro__:
        if cls.__name__ == "Anthropic" and cls.__module__.startswith("llama_index.llms.anthropic"):
            return "anthropic"
        if cls.__name__ == "OpenAILike":
            return None
        if cls.__name__ == "OpenAI" and cls.__module__.startswith("llama_index.llms.openai"):
            base = str(getattr(llm, "api_base", "") or "")
            return "openai" if not base or "api.openai.com" in base else None
    return None


def model_name(llm: Any) -> str | None:
    value = getattr(llm, "model", None)
    return value if isinstance(value, str) and value else None


MarkedChat = MarkedCall[ChatMessage]
"""The messages to send, the call's extra arguments, and the plan they follow."""


def mark_chat(
    provider: str,
    model: str | None,
    binding: Binding,
    messages: Sequence[ChatMessage],
    kwargs: dict[str, Any],
    *,
    settings: Sequence[Mapping[str, Any]] = (),
    cache_idx: int | None = None,
    callers_key: str | None = None,
    keys: ConversationKeys | None = None,
) -> MarkedChat:
    """The plan for ``binding``'s request on ``provider``, written on copies of ``messages``.

    ``settings`` (besides ``kwargs``: the LLM's ``additional_kwargs``) and ``cache_idx``
    (``Anthropic``'s own) may carry markers too; ``callers_key``: a ``prompt_cache_key`` the
    LLM sends of its own; ``keys``: the conversations' keys (see
    :func:`~contextpilot_integrations.integration.call_plan.with_cache_key`)."""
    prepared = binding.prepared
    out = list(messages)
    existing = sum(_markers_in(index, message, cache_idx) for index, message in enumerate(out))
    budget = markers_left(provider, existing, settings=[kwargs, *settings])
    needles = [render_block(block, prepared.templates, prepared.labels) for block in prepared.blocks]
    users = [i for i, m in enumerate(out) if m.role == MessageRole.USER]
    last_user = users[-1] if users else -1
    first = _locate(out, needles[0], prepared.blocks[0].text) if needles else None
    start = 1 if out and out[0].role == MessageRole.SYSTEM else 0
    history = out[start:last_user] if first is not None and first[0] == last_user and last_user > start else []
    history_tokens = sum(len(_text(message)) for message in history) // CHARS_PER_TOKEN
    plan = plan_bound_call(binding, provider, model, history_tokens=history_tokens, max_breakpoints=budget)
    call_kwargs = dict(kwargs)
    if provider == "openai":
        texts = [_text(message) for message in out]
        call_kwargs = with_cache_key(plan, call_kwargs, binding, lambda: texts, callers_key=callers_key, keys=keys)
    if provider != "anthropic" or budget <= 0:
        return MarkedChat(out, call_kwargs, plan, 0)
    cuts: dict[tuple[int, int], list[int]] = {}
    for index in plan.block_breakpoints[:budget]:
        found = _locate(out, needles[index], prepared.blocks[index].text)
        if found is not None:
            cuts.setdefault((found[0], found[1]), []).append(found[2])
    placed = 0
    for (message_index, block_index), ends in sorted(cuts.items(), reverse=True):
        out[message_index], count = _split(out[message_index], block_index, sorted(set(ends)))
        placed += count
    ends_to_mark = [last_user - 1] if plan.mark_history and history else []
    if plan.mark_prefix and start == 1 and (first is None or first[0] != 0):
        ends_to_mark.append(0)
    for index in ends_to_mark:
        blocks = out[index].blocks
        if placed < budget and blocks and isinstance(blocks[-1], TextBlock) and blocks[-1].text:
            out[index] = out[index].model_copy(update={"blocks": [*blocks, _point()]})
            placed += 1
    return MarkedChat(out, call_kwargs, plan, placed)


def _markers_in(index: int, message: ChatMessage, cache_idx: int | None) -> int:
    """Markers a message will carry: its ``CachePoint`` blocks, and one on its last block for
    its own ``cache_control`` or ``Anthropic(cache_idx=...)`` reaching it."""
    points = sum(1 for block in message.blocks if isinstance(block, CachePoint))
    marked = bool(message.additional_kwargs.get("cache_control")) or (
        cache_idx is not None and (cache_idx == -1 or index <= cache_idx)
    )
    return points + marked


def _point() -> CachePoint:
    return CachePoint(cache_control=CacheControl(type="ephemeral"))


def _text(message: ChatMessage) -> str:
    return "".join(block.text for block in message.blocks if isinstance(block, TextBlock))


def _locate(messages: Sequence[ChatMessage], rendered: str, text: str) -> tuple[int, int, int] | None:
    """Where a block ends in the messages: its rendered text (``[label] text``), or, as a
    query engine shows a node (its metadata, then its text), its own text."""
    return _find(messages, rendered) or (_find(messages, text) if text else None)


def _find(messages: Sequence[ChatMessage], needle: str) -> tuple[int, int, int] | None:
    for message_index, message in enumerate(messages):
        if message.role not in (MessageRole.SYSTEM, MessageRole.USER, MessageRole.DEVELOPER):
            continue
        for block_index, block in enumerate(message.blocks):
            if isinstance(block, TextBlock):
                position = block.text.find(needle)
                if position != -1:
                    return message_index, block_index, position + len(needle)
    return None


def _split(message: ChatMessage, block_index: int, ends: list[int]) -> tuple[ChatMessage, int]:
    blocks = list(message.blocks)
    text = blocks[block_index].text  # type: ignore[union-attr]
    pieces: list[Any] = []
    start = count = 0
    for end in ends:
        if end <= start:
            continue
        pieces += [TextBlock(text=text[start:end]), _point()]
        start, count = end, count + 1
    if start < len(text):
        pieces.append(TextBlock(text=text[start:]))
    return message.model_copy(update={"blocks": [*blocks[:block_index], *pieces, *blocks[block_index + 1 :]]}), count
