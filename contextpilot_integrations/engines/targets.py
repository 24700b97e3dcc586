"""What routing speaks of: a :class:`Target` a request can go to, and a :class:`Routed` request.

Apart from the router so that the selector, the client and the router each name them
without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.prepared import PreparedRequest
from . import wire

__all__ = ["Routed", "Target"]


@dataclass(frozen=True, slots=True)
class Target:
    """Where a request can go: a server, or one slot of a llama-server (``id_slot``)."""

    name: str
    base_url: str
    slot: int | None = None
    """llama-server slot to pin (``id_slot``); ``None``: the server places it."""
    engine: str = "sglang"
    """``sglang``, ``vllm``, ``llamacpp`` or ``openai`` (see :data:`wire.ENGINES`)."""
    capacity_tokens: int | None = None
    """Its KV-cache size in tokens, if known: a larger request is cached nowhere."""

    def __post_init__(self) -> None:
        if self.engine not in wire.ENGINES:
            raise ValueError(f"target {self.name!r}: engine must be one of {', '.join(wire.ENGINES)}")


@dataclass(frozen=True, slots=True)
class Routed:
    """A prepared request and the target it was prepared for."""

    prepared: PreparedRequest
    target: Target
    reason: str
    """``balance``, ``cache``, ``room``, ``conversation``, ``oversized`` or ``fixed``."""
    kept_turns: frozenset[int] | None = None
    """The caller's ``kept_turns``: a failover prepares the request again with them."""
