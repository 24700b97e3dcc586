"""The pilot an integration makes when given none, and the warning when that repeats.

The index models the engine: every request a process sends to it should go through one
pilot. An integration built without ``pilot=`` makes one of its own, which predicts only the
requests it prepared itself; built per request (a common web-handler pattern) it reuses
nothing, and with ``CONTEXTPILOT_SHARED`` set each one opens a broker client and replays the
log (each is closed when its pilot is dropped). The second such pilot in a process warns once,
naming the fix: make one :class:`ContextPilot` at start-up and pass it as ``pilot=``. No
hidden process-wide pilot is made instead: two chains may serve two engines, and a pilot
shared behind their backs would mix what each engine holds.
"""

from __future__ import annotations

import itertools
import warnings

from ..pilot import ContextPilot

__all__ = ["ImplicitPilotWarning", "own_pilot"]


class ImplicitPilotWarning(UserWarning):
    """Integrations made several pilots of their own: none reuses what another sent."""


_made = itertools.count(1)


def own_pilot(owner: str) -> ContextPilot:
    """A new pilot for ``owner`` (an integration given no ``pilot=``); warns at the second."""
    if next(_made) == 2:
        warnings.warn(
            f"{owner} made a ContextPilot of its own (no pilot=), and it is not the first one in this process: "
            "each predicts only the requests it prepared itself, so nothing is reused between them (and with "
            "CONTEXTPILOT_SHARED set each opens a broker client). Make one ContextPilot at start-up and pass it "
            "as pilot= to every integration that talks to the same engine.",
            ImplicitPilotWarning,
            stacklevel=3,
        )
    return ContextPilot()
