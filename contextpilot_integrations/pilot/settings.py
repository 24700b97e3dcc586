"""The pilot's settings that the send decision reads, held as one frozen value.

The :class:`~.planner.Planner` holds a :class:`PilotSettings` and reads it at each decision,
with no reference back to its pilot. A pilot still shows each setting as an attribute of its
own (:class:`Setting`): setting one, by its user or by :mod:`.wiring` once an engine has said
its page and tokenizer, checks it as the pilot's arguments are checked and swaps in a new
value under the pilot's lock.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol, TypeVar, overload

from ..core.annotations import DEFAULT_TEMPLATES, Templates
from ..core.gain import FORMS, Form, TokenCounter, estimate_tokens
from ..core.validation import check_sizes

__all__ = ["PilotSettings", "Setting"]

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class PilotSettings:
    """What the planner reads of its pilot's settings (the defaults are a pilot's; see
    :class:`~.facade.ContextPilot` for each)."""

    templates: Templates = DEFAULT_TEMPLATES
    annotate_order: bool = False
    plain_prompts: bool = True
    order_form: Form = "positions"
    token_counter: TokenCounter = estimate_tokens
    cache_tokens: int | None = None
    page_tokens: int | None = None
    keep_top: bool = True

    def __post_init__(self) -> None:
        if self.order_form not in FORMS:
            raise ValueError(f"order_form must be one of {FORMS}")
        check_sizes(self.cache_tokens, self.page_tokens)


class _Holder(Protocol):
    """Where a pilot's settings live: its planner's."""

    settings: PilotSettings


class _Pilot(Protocol):
    _lock: Any

    @property
    def _planner(self) -> _Holder: ...


class Setting(Generic[_T]):
    """A pilot's attribute read from its planner's :class:`PilotSettings`; set, a new one
    with it replaced (checked: :class:`ValueError` or :class:`TypeError`, nothing changed)."""

    name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, pilot: None, owner: type) -> Setting[_T]: ...

    @overload
    def __get__(self, pilot: _Pilot, owner: type) -> _T: ...

    def __get__(self, pilot: _Pilot | None, owner: type) -> Setting[_T] | _T:
        if pilot is None:
            return self
        value: _T = getattr(pilot._planner.settings, self.name)
        return value

    def __set__(self, pilot: _Pilot, value: _T) -> None:
        changed: dict[str, Any] = {self.name: value}
        with pilot._lock:
            pilot._planner.settings = replace(pilot._planner.settings, **changed)


class _SettingsAttributes:
    """A pilot's settings as its attributes (a base of :class:`~.facade.ContextPilot`)."""

    templates = Setting[Templates]()
    annotate_order = Setting[bool]()
    plain_prompts = Setting[bool]()
    order_form = Setting[Form]()
    token_counter = Setting[TokenCounter]()
    cache_tokens = Setting[int | None]()
    page_tokens = Setting[int | None]()
    keep_top = Setting[bool]()
