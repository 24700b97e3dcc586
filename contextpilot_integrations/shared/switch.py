"""Which sharing settings a pilot gets: the explicit argument, else ``CONTEXTPILOT_SHARED``.

Imported by the router without importing the broker client (that happens only in
:func:`contextpilot_integrations.shared.attach`, when sharing is on).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

__all__ = ["ENV", "per_target"]

ENV = "CONTEXTPILOT_SHARED"


def per_target(shared: Any, target: str) -> Any:
    """The settings of one router target's pilot: shared under the target's name (each
    engine has its own index), or ``None`` when sharing is off."""
    if shared is None:
        shared = os.environ.get(ENV) or None
    if shared is None:
        return None
    from .options import SharedOptions

    if isinstance(shared, str):
        return SharedOptions(url=shared, scope=target)
    if isinstance(shared, SharedOptions):
        return replace(shared, scope=target)
    raise TypeError(f"shared must be a nats:// URL or SharedOptions, got {type(shared).__name__}")
