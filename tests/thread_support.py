"""Calls that must not hang the suite: run in a daemon thread, bounded in time."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def in_thread(call: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Run ``call`` in a daemon thread; its result, or its exception raised here. Fails,
    instead of hanging, if it has not finished within ``timeout`` (a deadlock)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except BaseException as exc:  # handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{getattr(call, '__name__', call)} did not return within {timeout} s (deadlock?)"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
