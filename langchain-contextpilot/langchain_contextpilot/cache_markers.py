"""The hosted providers' prompt-cache markers, on LangChain messages.

ContextPilot orders the shared documents first; a hosted API then needs to be told where
that shared prefix ends (``plan_cache`` of the core says where). This module writes the
plan in each provider's own LangChain form, on copies of the outgoing messages:

- Anthropic (``ChatAnthropic``): the text up to the end of a planned block becomes its own
  content block with ``cache_control`` (LangChain passes it to the API as is; on a tool
  result, ``langchain-anthropic`` moves it to the ``tool_result``);
- Bedrock (``ChatBedrockConverse``): a ``{"cachePoint": {"type": "default"}}`` block right
  after that text;
- OpenAI (``ChatOpenAI``): the plan's ``prompt_cache_key`` as a call argument; for GPT-5.6
  and later, ``prompt_cache_breakpoint`` on the text up to a planned block (and
  ``prompt_cache_options={"mode": "explicit"}`` where the plan asks for explicit mode);
- Gemini (``ChatGoogleGenerativeAI``): nothing to write, the order is all that helps.

Every marker the request carries besides ours counts against the provider's limit of four:
on the messages, on a bound tool definition, and ``ChatAnthropic``'s top-level
``cache_control`` (call argument or ``model_kwargs``; see
:func:`~contextpilot_integrations.integration.call_plan.markers_left`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage

from contextpilot_integrations.core.annotations import render_block
from contextpilot_integrations.core.blocks import CHARS_PER_TOKEN
from contextpilot_integrations.integration.call_plan import MarkedCall, markers_left, plan_bound_call, with_cache_key
from contextpilot_integrations.pilot.binding import Binding
from contextpilot_integrations.providers.cache_key import ConversationKeys

from ._marker_limit import OwnMark

__all__ = ["PROVIDERS", "MarkedCall", "mark_messages", "model_name", "provider_of", "raw_usage", "text_of"]

PROVIDERS = ("openai", "anthropic", "bedrock", "gemini")
_BY_CLASS = {
    "ChatOpenAI": "openai",
    "AzureChatOpenAI": "openai",
    "ChatAnthropic": "anthropic",
    "ChatAnthropicVertex": "anthropic",
    "ChatBedrockConverse": "bedrock",
    "ChatGoogleGenerativeAI": "gemini",
}
_ANTHROPIC_MARK = {"type": "ephemeral"}
_BEDROCK_MARK = {"cachePoint": {"type": "default"}}


def provider_of(llm: Any) -> str | None:
    """The hosted provider a chat model talks to, from its class (``None``: not a known one,
    or an OpenAI-compatible model pointed at a server other than OpenAI's)."""
    for cls in type(llm).__mro__:
        provider = _BY_CLASS.get(cls.__name__)
        if provider is None:
            continue
        if provider == "openai":
            base = str(getattr(llm, "openai_api_base", None) or "")
            if base and "api.openai.com" not in base and cls.__name__ == "ChatOpenAI":
                return None  # a local engine speaking OpenAI's format: it has its own cache rules
        return provider
    return None


def model_name(llm: Any) -> str | None:
    for name in ("model_name", "model", "model_id"):
        value = getattr(llm, name, None)
        if isinstance(value, str) and value:
            return value
    return None


def raw_usage(message: Any, provider: str | None) -> Any:
    """What to read a provider's usage from: OpenAI's own ``usage`` where LangChain kept it
    (``response_metadata["token_usage"]``: it has ``cache_write_tokens``, which LangChain's
    ``usage_metadata`` drops), else the message (its ``usage_metadata``)."""
    raw = (getattr(message, "response_metadata", None) or {}).get("token_usage")
    return raw if provider == "openai" and isinstance(raw, dict) and "prompt_tokens" in raw else message


def mark_messages(
    provider: str,
    model: str | None,
    binding: Binding,
    messages: Sequence[BaseMessage],
    kwargs: dict[str, Any],
    *,
    conversation: bool = False,
    tools: Iterable[Any] = (),
    settings: Sequence[Mapping[str, Any]] = (),
    callers_key: str | None = None,
    keys: ConversationKeys | None = None,
) -> MarkedCall[BaseMessage]:
    """The plan for ``binding``'s request on ``provider``, written on copies of ``messages``
    (and into ``kwargs`` for OpenAI). The caller's messages are never changed.

    ``tools`` (besides ``kwargs["tools"]``) and ``settings`` (besides ``kwargs``: the
    model's ``model_kwargs``) may carry markers too; ``callers_key``: a ``prompt_cache_key``
    the model sends of its own; ``keys``: the conversations' keys (see
    :func:`~contextpilot_integrations.integration.call_plan.with_cache_key`).

    ``conversation``: the documents follow a conversation (an agent's tool results):
    OpenAI's key then comes from the prompt's leading text
    (:mod:`~contextpilot_integrations.providers.cache_key`), and with a marker left the end of the
    last message is marked too (its next turn reads the conversation so far, as
    ``AnthropicPromptCachingMiddleware`` does)."""
    prepared = binding.prepared
    out = list(messages)
    existing = sum(_markers_in(message, provider) for message in out)
    budget = markers_left(
        provider, existing, tools=[*(kwargs.get("tools") or ()), *tools], settings=[kwargs, *settings]
    )
    needles = [render_block(block, prepared.templates, prepared.labels) for block in prepared.blocks]
    first = _locate(out, needles[0], prepared.blocks[0].text, provider) if needles else None
    last_human = max((i for i, m in enumerate(out) if isinstance(m, HumanMessage)), default=-1)
    start = 1 if out and isinstance(out[0], SystemMessage) else 0
    in_last_turn = first is not None and first[0][0] == last_human
    history = out[start:last_human] if in_last_turn and last_human > start else []
    history_tokens = sum(len(text_of(message)) for message in history) // CHARS_PER_TOKEN
    plan = plan_bound_call(binding, provider, model, history_tokens=history_tokens, max_breakpoints=budget)
    call_kwargs = dict(kwargs)
    if provider == "openai":
        texts = [text_of(message) for message in out]
        call_kwargs = with_cache_key(
            plan,
            call_kwargs,
            binding,
            lambda: texts,
            follows_conversation=conversation,
            callers_key=callers_key,
            keys=keys,
        )
    if provider == "openai" and plan.explicit_only and "prompt_cache_options" not in call_kwargs:
        call_kwargs["prompt_cache_options"] = {"mode": "explicit"}
    last_message = conversation and provider in ("anthropic", "bedrock")
    if provider == "gemini" or not (plan.block_breakpoints or plan.mark_history or plan.mark_prefix or last_message):
        return MarkedCall(out, call_kwargs, plan, 0)
    if budget <= 0:
        return MarkedCall(out, call_kwargs, plan, 0)
    placed = 0
    cuts: dict[tuple[int, int], list[int]] = {}
    ends_to_mark: list[int] = []
    for index in plan.block_breakpoints[:budget]:
        found = _locate(out, needles[index], prepared.blocks[index].text, provider)
        if found is None:
            continue
        if isinstance(out[found[0][0]], ToolMessage):
            # a tool result is not split (the API marks a tool result as a whole, and the
            # next turn resends it unsplit from the state: the same blocks, the same prefix)
            if found[0][0] not in ends_to_mark:
                ends_to_mark.append(found[0][0])
        else:
            cuts.setdefault(found[0], []).append(found[1])
    for (message_index, part_index), ends in sorted(cuts.items(), reverse=True):
        out[message_index], count = _split(out[message_index], part_index, sorted(set(ends)), provider)
        placed += count
    if plan.mark_history and history:
        ends_to_mark.append(last_human - 1)
    if plan.mark_prefix and start == 1 and (first is None or first[0][0] != 0):
        ends_to_mark.append(0)
    if last_message and out and len(out) - 1 not in ends_to_mark:
        ends_to_mark.append(len(out) - 1)  # the conversation so far, for its next turn
    if provider == "anthropic" and any(setting.get("cache_control") for setting in [kwargs, *settings] if setting):
        # the top-level (automatic) marker goes on the last block: ours there would take a second slot
        ends_to_mark = [index for index in ends_to_mark if index != len(out) - 1]
    for index in ends_to_mark:
        marked = _mark_end(out[index], provider) if placed < budget else None
        if marked is not None:
            out[index] = marked
            placed += 1
    return MarkedCall(out, call_kwargs, plan, placed)


# ---- reading messages ----------------------------------------------------------------------------
def parts_of(message: BaseMessage) -> list[Any]:
    """The message's content as a list of parts (a string content: one text part)."""
    content = message.content
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def part_text(part: Any) -> str | None:
    """A content part's text (``None``: not a text part)."""
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return str(part["text"])
    return None


def text_of(message: BaseMessage) -> str:
    """The message's text parts, joined."""
    return "".join(text for part in parts_of(message) if (text := part_text(part)) is not None)


def _markers_in(message: BaseMessage, provider: str) -> int:
    if isinstance(message.content, str):
        return 0
    key = {"bedrock": "cachePoint", "openai": "prompt_cache_breakpoint"}.get(provider, "cache_control")
    return sum(1 for part in message.content if isinstance(part, dict) and part.get(key))


def _markable(message: BaseMessage, provider: str) -> bool:
    if isinstance(message, AIMessage):
        return not message.tool_calls and isinstance(message.content, str)
    if isinstance(message, ToolMessage):
        return provider != "bedrock"  # Bedrock takes no cache point inside a tool result
    return True


def _locate(
    messages: Sequence[BaseMessage], rendered: str, text: str, provider: str
) -> tuple[tuple[int, int], int] | None:
    """Where a block ends in the messages: its rendered text (``[label] text``), or, where a
    prompt shows documents its own way, its own text."""
    return _find(messages, rendered, provider) or (_find(messages, text, provider) if text else None)


def _find(messages: Sequence[BaseMessage], needle: str, provider: str) -> tuple[tuple[int, int], int] | None:
    """Where the text ``needle`` ends: (message, content part) and the offset in that part."""
    for message_index, message in enumerate(messages):
        if not _markable(message, provider):
            continue
        for part_index, part in enumerate(parts_of(message)):
            text = part_text(part)
            position = -1 if text is None else text.find(needle)
            if position != -1:
                return (message_index, part_index), position + len(needle)
    return None


# ---- writing markers -------------------------------------------------------------------------------
def _split(message: BaseMessage, part_index: int, ends: list[int], provider: str) -> tuple[BaseMessage, int]:
    """``message`` with its text part cut after each of ``ends``, a marker after each cut."""
    parts = parts_of(message)
    part = parts[part_index]
    text = part_text(part) or ""
    base = {k: v for k, v in part.items() if k not in ("text", "cache_control")} if isinstance(part, dict) else {}
    base.setdefault("type", "text")
    pieces: list[Any] = []
    start = count = 0
    for end in ends:
        if end <= start:
            continue
        pieces += _marked({**base, "text": text[start:end]}, provider)
        start, count = end, count + 1
    if start < len(text):
        rest = {**base, "text": text[start:]}
        if isinstance(part, dict) and part.get("cache_control"):
            rest["cache_control"] = part["cache_control"]  # the caller's own marker stays where it was
        pieces.append(rest)
    return message.model_copy(update={"content": [*parts[:part_index], *pieces, *parts[part_index + 1 :]]}), count


def _marked(part: dict[str, Any], provider: str) -> list[dict[str, Any]]:
    if provider == "anthropic":
        return [{**part, "cache_control": OwnMark(_ANTHROPIC_MARK)}]
    if provider == "openai":  # GPT-5.6 and later: an explicit breakpoint on the content part
        return [{**part, "prompt_cache_breakpoint": {"mode": "explicit"}}]
    return [part, dict(_BEDROCK_MARK)]


def _mark_end(message: BaseMessage, provider: str) -> BaseMessage | None:
    """``message`` with a marker after its last text part (``None``: it cannot take one, or
    has one there already)."""
    if not _markable(message, provider):
        return None
    parts = parts_of(message)
    if not parts or part_text(parts[-1]) is None or not part_text(parts[-1]):
        return None
    last = parts[-1] if isinstance(parts[-1], dict) else {"type": "text", "text": parts[-1]}
    if last.get("cache_control") or last.get("prompt_cache_breakpoint"):
        return None
    return message.model_copy(update={"content": [*parts[:-1], *_marked(dict(last), provider)]})
