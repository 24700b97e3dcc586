"""Sharing a pilot's index across workers, wired as the pilot is made.

The shared log (:mod:`..shared`) is a plug-in below the pilot: it knows the pilot only as a
:class:`~..shared.replica.Replica`. This is where the pilot decides whether to plug it in:
``shared=`` given, else the ``CONTEXTPILOT_SHARED`` environment variable; the broker client
is imported only then.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..shared.client import SharedIndex
    from ..shared.replica import Replica

__all__ = ["share"]


def share(pilot: Replica, shared: Any) -> SharedIndex | None:
    """The shared-state client of ``pilot`` (``shared``: a ``nats://`` URL or
    :class:`~..shared.SharedOptions`; ``None``: the environment's), or ``None`` when off."""
    shared = shared if shared is not None else os.environ.get("CONTEXTPILOT_SHARED") or None
    if shared is None:
        return None
    from ..shared import attach  # imported only when sharing is on: no broker client otherwise

    held = weakref.ref(pilot)  # the pilot owns its client, not the reverse
    return attach(pilot, shared, lambda: getattr(held(), "_lock", None))
