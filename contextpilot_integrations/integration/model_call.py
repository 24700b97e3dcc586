"""One model call of an adapter, around the provider's own call: the protocol both adapters share.

LangChain's chat models and agent middleware and LlamaIndex's LLMs do the same three things;
each framework supplies only how to read and rewrite its messages' texts
(:class:`MessageTexts`), the usage of its answers (:class:`EngineUsage`) and where its
run binder lets a retry take the request again (``retake``):

- before (:meth:`ModelCall.before`): the request prepared for the call, indexed in the cache
  partition its body names, every reference its messages do not carry written out in full,
  its prompt located; the body fields that carry the request id (:meth:`ModelCall.id_fields`).
  A hosted API's cache markers are :func:`~.call_plan.mark_bound_call`'s;
- served (:meth:`ModelCall.served`: an engine's usage; :meth:`ModelCall.served_hosted`: a
  hosted API's): the counts to the request's pilot and an OpenTelemetry span;
- failed (:meth:`ModelCall.failed`): the pilot forgets the request, a retry may take it again,
  and a connection that failed surfaces as the core's ``EngineUnavailable``.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NoReturn, TypeVar

from ..engines import wire
from ..engines.block_tokenizer import BlockTokenizer
from ..engines.engine_info import learn_engine_in_background
from ..engines.feedback import EngineUsage, EventTracker, report_call, report_failed
from ..errors import as_engine_error
from ..pilot.binding import Binding, checked_for_sending, partitioned
from ..providers.usage import ProviderUsage
from .hosted_feedback import report_provider_served

__all__ = ["EngineAccess", "EngineUsage", "MessageTexts", "ModelCall", "id_fields", "reraise"]

M = TypeVar("M")
"""A framework's message type."""
P = TypeVar("P")
"""Where a text sits in a framework's messages."""


@dataclass(frozen=True)
class MessageTexts(Generic[M, P]):
    """A framework's messages as texts, and the texts written back."""

    read: Callable[[Sequence[M]], tuple[list[str], list[P]]]
    """Every text of the messages in order, and where each came from."""
    rebuilt: Callable[[list[M], list[str], list[P]], list[M]]
    """Copies of the messages whose texts changed (the caller's objects stay untouched)."""


@dataclass(frozen=True)
class EngineAccess:
    """Where an OpenAI-compatible engine answers: for its ``/tokenize`` and what it says of itself."""

    url: str
    model: str = "default"
    headers: Mapping[str, str] = field(default_factory=dict)


class ModelCall:
    """One model call and the request prepared for it (``binding``; ``None``: none)."""

    def __init__(
        self,
        binding: Binding | None,
        *,
        tracker: EventTracker | None = None,
        retake: Callable[[Binding], None] | None = None,
    ) -> None:
        self.binding = binding
        self.tracker = tracker
        """Where the engine's KV events are mapped to requests (an event sink)."""
        self.retake = retake
        """The framework's binder: a retry of the failed call may take its request again."""

    @property
    def request_id(self) -> str:
        """The bound request's id, else one of this call's own (made when first asked)."""
        return self.binding.prepared.request_id if self.binding is not None else self._fresh

    @functools.cached_property
    def _fresh(self) -> str:
        return f"cp-{uuid.uuid4().hex}"

    def before(self, messages: list[M], texts: MessageTexts[M, Any], fields: Mapping[str, Any]) -> list[M]:
        """The messages to send: the request moved to the cache partition the body ``fields``
        name, every reference left resolvable, and the binding located in the prompt."""
        self.binding = partitioned(self.binding, fields)
        if self.binding is None:
            return messages
        segments, places = texts.read(messages)
        self.binding = checked_for_sending(self.binding, segments)
        return texts.rebuilt(messages, segments, places)

    def id_fields(
        self, engine: str | None, extra_body: Mapping[str, Any] | None, *, prompt_ids: bool
    ) -> dict[str, Any]:
        """The request body's ``extra_body`` with this call's request id (:func:`id_fields`)."""
        return id_fields(engine, self.request_id, extra_body, prompt_ids=prompt_ids)

    def learn_engine(self, engine: str | None, access: EngineAccess | None, discover: bool | None) -> None:
        """Once per pilot and engine, on a thread of its own: the engine's page size, KV pool
        and tokenizer for the request's pilot, where its user left them unset
        (:mod:`~contextpilot_integrations.engines.engine_info`; ``discover=False``: never)."""
        if self.binding is None or engine is None or access is None or not access.url or discover is False:
            return
        learn_engine_in_background(
            self.binding.pilot,
            access.url,
            engine=engine,
            model=access.model,
            headers=access.headers,
            discover=discover,
        )

    def served(
        self,
        usage: EngineUsage,
        *,
        usage_feedback: bool,
        tokenizer: BlockTokenizer | None = None,
        raw: Any = None,
    ) -> list[int] | None:
        """An engine's counts to the request's pilot, and a span of the call (``raw``: the
        answer, which names what ``usage`` does not). Returns where each block ends in the
        prompt's token ids (found with ``tokenizer``; ``None``: unknown, the conservative
        mapping)."""
        binding = self.binding
        if binding is None:
            return None
        ids = usage.input_ids
        ends = tokenizer.block_ends(binding.prepared, ids) if tokenizer is not None and ids else None
        report_call(
            binding.pilot,
            binding.prepared,
            usage,
            before_tokens=binding.before_tokens,
            usage_feedback=usage_feedback,
            tracker=self.tracker,
            block_ends=ends,
            raw=raw,
        )
        return None if ends is None else list(ends)

    def served_hosted(self, raw: object, provider: str | None, *, usage_feedback: bool) -> ProviderUsage | None:
        """A hosted API's usage in ``raw`` to the request's pilot
        (:func:`~.hosted_feedback.report_provider_served`; ``None``: unbound, or no usage)."""
        binding = self.binding
        if binding is None:
            return None
        return report_provider_served(
            binding.pilot,
            binding.prepared,
            raw,
            provider,
            before_tokens=binding.before_tokens,
            usage_feedback=usage_feedback,
        )

    def failed(self, exc: BaseException, where: str | None = None) -> BaseException:
        """The call failed: the pilot forgets the request and a retry may take it again.
        Returns the error to raise: with ``where`` (the caller's name), a broken connection
        as ``EngineUnavailable``; else ``exc`` as it is."""
        if self.binding is not None:
            report_failed(self.binding.pilot, self.binding.prepared, self.tracker)
            if self.retake is not None:
                self.retake(self.binding)
        return exc if where is None else as_engine_error(exc, where)


def id_fields(
    engine: str | None, rid: str, extra_body: Mapping[str, Any] | None, *, prompt_ids: bool
) -> dict[str, Any]:
    """The request body's ``extra_body``: ``engine``'s fields carrying the request id ``rid``,
    and (``prompt_ids``) the ask for the prompt's token ids."""
    extra = dict(extra_body or {})
    for name in wire.REQUEST_ID_FIELDS.get(engine or "", ()):
        extra[name] = rid
    if prompt_ids:
        extra.update(wire.PROMPT_IDS_REQUEST.get(engine or "", {}))
    return extra


def reraise(error: BaseException, original: BaseException) -> NoReturn:
    """Raise ``error`` (the original itself, or its typed form chained to it)."""
    if error is original:
        raise original
    raise error from original
