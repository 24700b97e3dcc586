"""``ServerProcess`` never leaves an engine behind: the whole process group goes, also when
the wait for ``/health`` is interrupted (Ctrl-C in a long benchmark)."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from contextpilot_integrations.whatif import server_process
from contextpilot_integrations.whatif.server_process import ServerProcess

# a "server" that never answers /health and starts a worker of its own, as SGLang and vLLM do
NEVER_HEALTHY = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                 "'import time; time.sleep(60)']); time.sleep(60)"]  # fmt: skip


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pgid: int, limit: float = 10.0) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return True
        time.sleep(0.05)
    return False


def test_an_interrupted_start_stops_the_engine_and_its_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[int] = []
    original = server_process.subprocess.Popen

    def popen(*args: object, **kwargs: object) -> object:
        process = original(*args, **kwargs)  # type: ignore[call-overload]
        started.append(process.pid)
        return process

    def interrupted(*args: object, **kwargs: object) -> None:  # Ctrl-C while polling /health
        threading.Event().wait(0.5)  # the worker is up by now
        raise KeyboardInterrupt

    monkeypatch.setattr(server_process.subprocess, "Popen", popen)
    monkeypatch.setattr(server_process.httpx, "get", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ServerProcess(NEVER_HEALTHY, startup_timeout=30)
    monkeypatch.undo()
    assert started and wait_gone(started[0])


def test_a_start_that_times_out_stops_the_engine_and_its_workers() -> None:
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="did not answer"):
        ServerProcess(NEVER_HEALTHY, startup_timeout=1)
    assert time.monotonic() - started < 40
