"""Checks of the arguments every entry point takes (pilot, router, micro-batcher, cache
plans): one definition, so each refuses the same inputs with the same message."""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from ..errors import BlockTypeError, InvalidBlockError

__all__ = [
    "MAX_BLOCKS",
    "check_conversation_id",
    "check_count",
    "check_kept_turns",
    "check_query",
    "check_request_id",
    "retries_resend_ids",
    "refuse_unknown",
    "unknown_argument",
]

MAX_BLOCKS = 262_144
"""The most blocks one message from outside may name: a request's block ids (a trace line,
a shared-log entry or message) or an engine's KV-event batch (HTTP listener, ZMQ subscriber).
Larger ones are refused before anything is applied; no real prompt or engine step comes near it."""


def check_query(query: object) -> None:
    if not isinstance(query, str):
        raise BlockTypeError(f"query must be str, got {type(query).__name__}")
    try:
        query.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidBlockError(
            f"query is not valid Unicode: a lone surrogate {query[exc.start]!r} at character {exc.start}"
        ) from None


def check_conversation_id(conversation_id: object) -> None:
    if conversation_id is not None and (not isinstance(conversation_id, str) or not conversation_id):
        raise TypeError(f"conversation_id must be a non-empty str or None, got {conversation_id!r}")


MAX_PARTITION_CHARS = 256


def check_partition(partition: object) -> None:
    """A cache partition's name (:mod:`.partitions`): ``None``, or a non-empty str of at
    most :data:`MAX_PARTITION_CHARS` printable characters (no control character: the index
    keys end the name with a NUL)."""
    if partition is None:
        return
    if not isinstance(partition, str) or not partition:
        raise TypeError(f"partition must be a non-empty str or None, got {partition!r}")
    if len(partition) > MAX_PARTITION_CHARS or not partition.isprintable():
        raise ValueError(
            f"partition must be at most {MAX_PARTITION_CHARS} printable characters, got {partition[:40]!r}"
        )


def check_request_id(request_id: object) -> None:
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")


def check_sizes(cache_tokens: object, page_tokens: object) -> None:
    """A pilot's engine sizes: each a count, or ``None`` (unknown)."""
    for name, value in (("cache_tokens", cache_tokens), ("page_tokens", page_tokens)):
        if value is not None:
            check_count(name, value)


def check_count(name: str, value: object) -> None:
    """A count of blocks or tokens: an int >= 0 (not a bool, a float or NaN)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


_TURN_COLLECTIONS = (list, tuple, set, frozenset, range)
_INT_ONLY = frozenset({int})


def check_kept_turns(kept_turns: object) -> frozenset[int] | None:
    """``None`` or a collection of turn numbers (ints >= 0), as a frozenset."""
    if kept_turns is None:
        return None
    if isinstance(kept_turns, _TURN_COLLECTIONS) and _INT_ONLY.issuperset(map(type, kept_turns)):
        given = frozenset(kept_turns)  # the common case, checked in C: plain ints
        if not given or min(given) >= 0:
            return given
    if isinstance(kept_turns, (str, bytes, Mapping)) or not isinstance(kept_turns, Iterable):
        raise TypeError(f"kept_turns must be a collection of turn numbers (e.g. {{0, 2}}) or None, got {kept_turns!r}")
    turns = list(kept_turns)
    for turn in turns:
        if isinstance(turn, bool) or not isinstance(turn, int) or turn < 0:
            raise TypeError(f"kept_turns must hold turn numbers (ints >= 0), got {turn!r}")
    return frozenset(turns)


def refuse_unknown(
    owner: type[BaseModel],
    given: Iterable[str],
    pilot_hint: str,
    *,
    also: Collection[str] = (),
    where: str = "base_url=",
) -> None:
    """Refuse, with :func:`unknown_argument`'s reason, a name given to the framework class
    ``owner`` that is none of its fields (or their aliases) nor of ``also``: a framework that
    keeps or forwards unknown names would drop them silently or send them to the engine."""
    fields = owner.model_fields
    known = {*fields, *(field.alias for field in fields.values() if field.alias), *also}
    for name in given:
        if name not in known:
            raise ValueError(unknown_argument(owner.__name__, name, sorted(known), pilot_hint, where))


_ENGINE_NAMES = ("server", "backend")
"""Names used elsewhere for what this project calls ``engine`` everywhere."""


def unknown_argument(owner: str, name: str, known: Sequence[str], pilot_hint: str, where: str = "base_url=") -> str:
    """Why a framework class refuses the argument ``name`` (a misspelt field is never silently
    ignored), and what was probably meant; ``pilot=`` gets ``pilot_hint``: who takes the pilot;
    ``server=`` and the like: ``engine=``, and ``where``, the argument saying where it is."""
    if name == "pilot":
        hint = f": the pilot belongs to {pilot_hint}"
    elif name in _ENGINE_NAMES and "engine" in known:
        hint = f": it takes engine= (which engine: sglang, vllm, llamacpp, openai); where it is goes in {where}"
    else:
        close = difflib.get_close_matches(name, list(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f"; it takes: {', '.join(known)}"
    return f"{owner} got an unknown argument {name!r}{hint}"


def retries_resend_ids(owner: str, engine: str, llm: Any, retry_hint: str) -> str | None:
    """Why ``owner``, sending ``engine``'s request ids in the body, refuses ``llm``: a model
    that retries inside a call (``max_retries`` not 0; ``None`` is its SDK's default) sends
    the same id again, and an engine that may still run the first attempt (a time-out)
    refuses it (SGLang: "Duplicate request ID"). ``None`` when each id goes out once;
    ``retry_hint``: how to retry instead (a retry takes the request again under a new id)."""
    retries = getattr(llm, "max_retries", 0)
    if retries == 0:
        return None
    said = "its SDK's default" if retries is None else str(retries)
    return (
        f"{owner}(engine={engine!r}) sends each request id once, but {type(llm).__name__} retries inside "
        f"a call (max_retries={said}) and would send it again, which the engine refuses: "
        f"build it with max_retries=0 and {retry_hint}"
    )
