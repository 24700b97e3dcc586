"""What is plugged into a pilot from outside it, once it is made.

The shared log (:mod:`..shared`) is a plug-in below the pilot: it knows the pilot only as a
:class:`~..shared.replica.Replica`. This is where the pilot decides whether to plug it in:
``shared=`` given, else the ``CONTEXTPILOT_SHARED`` environment variable; the broker client
is imported only then.

What an engine says about itself (its page, its pool, its tokenizer:
:mod:`..engines.engine_info`) fills the pilot's settings the user left unset:
:func:`fill_engine_settings`, under the pilot's lock.
"""

from __future__ import annotations

import math
import os
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Protocol

from ..core.gain import TokenCounter, estimate_tokens
from ..core.validation import check_sizes

if TYPE_CHECKING:
    from ..shared.client import SharedIndex
    from ..shared.replica import Replica

__all__ = ["MAX_ENGINES_READ", "EngineSettings", "claim_engine", "fill_engine_settings", "read_engine_again", "share"]


def share(pilot: Replica, shared: Any) -> SharedIndex | None:
    """The shared-state client of ``pilot`` (``shared``: a ``nats://`` URL or
    :class:`~..shared.SharedOptions`; ``None``: the environment's), or ``None`` when off."""
    shared = shared if shared is not None else os.environ.get("CONTEXTPILOT_SHARED") or None
    if shared is None:
        return None
    from ..shared import attach  # imported only when sharing is on: no broker client otherwise

    held = weakref.ref(pilot)  # the pilot owns its client, not the reverse
    return attach(pilot, shared, lambda: getattr(held(), "_lock", None))


class EngineSettings(Protocol):
    """The settings of a pilot that describe its engine (:class:`~.facade.ContextPilot` has them)."""

    page_tokens: int | None
    cache_tokens: int | None
    token_counter: TokenCounter
    _lock: Any
    _engines_read: OrderedDict[str, float]


MAX_ENGINES_READ = 64
"""Engines a pilot remembers having read (the least recent forgotten: read again if asked)."""


def claim_engine(pilot: EngineSettings, root: str, now: float) -> bool:
    """Whether the caller is to read engine ``root`` for ``pilot`` now: not read yet (nor being
    read), or its retry time has come. The claim is kept on the pilot, under its lock."""
    with pilot._lock:
        engines = pilot._engines_read
        again = engines.get(root)
        if again is not None and now < again:
            return False
        engines[root] = math.inf
        engines.move_to_end(root)
        while len(engines) > MAX_ENGINES_READ:
            engines.popitem(last=False)
    return True


def read_engine_again(pilot: EngineSettings, root: str | None, when: float) -> None:
    """Engine ``root`` (every engine: ``None``) may be read for ``pilot`` again from ``when``
    (:func:`time.monotonic`), or at once after a forget (``root=None``)."""
    with pilot._lock:
        if root is None:
            pilot._engines_read.clear()
        elif root in pilot._engines_read:
            pilot._engines_read[root] = when


def fill_engine_settings(
    pilot: EngineSettings,
    *,
    page_tokens: int | None = None,
    cache_tokens: int | None = None,
    token_counter: TokenCounter | None = None,
) -> tuple[str, ...]:
    """Give ``pilot`` the values its user left unset (``page_tokens`` / ``cache_tokens``
    ``None``, ``token_counter`` the default estimate), under its lock; a value given by the
    user, or learned earlier (a KV-event sink's page), stays. Returns the names set.

    Raises:
        ValueError: a size that is not a positive number of tokens (nothing is set).
    """
    check_sizes(cache_tokens, page_tokens)
    filled: list[str] = []
    with pilot._lock:
        if page_tokens is not None and pilot.page_tokens is None:
            pilot.page_tokens = page_tokens
            filled.append("page_tokens")
        if cache_tokens is not None and pilot.cache_tokens is None:
            pilot.cache_tokens = cache_tokens
            filled.append("cache_tokens")
        if token_counter is not None and pilot.token_counter is estimate_tokens:
            pilot.token_counter = token_counter
            filled.append("token_counter")
    return tuple(filled)
