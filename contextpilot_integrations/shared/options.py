"""Where and how a pilot shares its index: :class:`SharedOptions`, each setting checked.

A malformed URL, a weak or missing secret, retention too short for a late worker to catch
up: each fails when the options are made, with what to do, never later on the client's
thread. Nothing here talks to the broker, and no credential is ever shown
(:func:`redact`, :func:`names_credentials`).
"""

from __future__ import annotations

import math
import os
import re
import ssl
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import SharedSettingsError

__all__ = ["SECRET_ENV", "SharedOptions", "names_credentials", "redact"]

_TOKEN = re.compile(r"[^A-Za-z0-9_-]")
_STREAM_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SCHEMES = ("nats", "tls", "ws", "wss")
SECRET_ENV = "CONTEXTPILOT_SHARED_SECRET"

_MIN_SECRET = 16  # bytes: shorter ones can be guessed from any signed message
_MIN_DISTINCT = 5  # different bytes at least ("0" * 32 is no secret)
_MAX_SECRETS = 8
_MIN_MAX_AGE = 60.0  # seconds


def redact(url: str) -> str:
    """The broker URL(s) fit for logs: no user, password or token."""
    shown = []
    for one in url.split(","):
        parts = urllib.parse.urlsplit(one.strip())
        try:
            port = parts.port
        except ValueError:
            port = None
        host = parts.hostname or ""
        shown.append(f"{parts.scheme}://{host}" + (f":{port}" if port else ""))
    return ",".join(shown)


def _check_url(url: object) -> None:
    """Each comma-separated server a well-formed ``nats://host:port`` (or tls, ws, wss)."""
    if not isinstance(url, str) or not url:
        raise SharedSettingsError(f"shared: expected a nats:// URL, got {url!r}")
    for one in url.split(","):
        shown = redact(one)
        if one != one.strip() or any(c.isspace() for c in one):
            raise SharedSettingsError(f"shared: the broker URL {shown!r} contains white space")
        parts = urllib.parse.urlsplit(one)
        if parts.scheme not in _SCHEMES:
            raise SharedSettingsError(f"shared: expected a nats:// URL (or tls, ws, wss), got {shown!r}")
        try:
            port = parts.port
        except ValueError:
            raise SharedSettingsError(f"shared: the broker URL {shown!r} has no valid port (1-65535)") from None
        if not parts.hostname or port == 0:
            raise SharedSettingsError(f"shared: the broker URL {shown!r} needs a host and a port in 1-65535")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise SharedSettingsError(f"shared: the broker URL {shown!r} has a path or a query; give host:port")


@dataclass(frozen=True)
class SharedOptions:
    """Where and how a pilot shares its index.

    Args:
        url: the NATS server (``nats://host:port``, ``tls://`` for TLS; several
            comma-separated for a cluster). Checked here: a malformed one fails at once.
        secret: the deployment's shared secret (default: ``CONTEXTPILOT_SHARED_SECRET``):
            every message and snapshot carries an HMAC under it, and a worker applies nothing
            it cannot authenticate. Required: without it anyone who can publish to the
            broker would write every worker's index. At least 16 bytes, e.g.
            ``openssl rand -hex 32``. A list (the variable: comma-separated) rotates it: the
            first signs, each one verifies, so a worker given ``[new, old]`` reads the workers
            still on ``old``.
        scope: the engine this pilot models: pilots with the same scope share one index
            (a router's pilots use their target names).
        stream: the JetStream stream holding every scope's log (letters, digits, ``_``, ``-``).
        max_age: seconds an entry stays in the stream (bounded retention; the snapshots
            cover what is older): at least 60, and twice ``snapshot_interval``. The broker's
            de-duplication window is 120 s, or ``max_age`` if shorter.
        max_entries: messages the stream keeps at most (the oldest go first).
        snapshot_interval: seconds between this worker's snapshots (0: never).
        max_unsent: entries kept while the broker is unreachable (the oldest dropped after).
        batch_entries: entries per message at most.
        user: the broker's user name (or in the URL, ``nats://user:pw@host:port``).
        password: that user's password (or in the URL).
        token: the broker's authentication token.
        creds: path of a NATS ``.creds`` file (a user JWT and its nkey: decentralised auth).
        nkey_seed: path of an nkey seed file (nkey auth).
        tls: the TLS context for ``tls://`` servers (client certificates, private CAs);
            ``None`` with ``tls://``: the system's default verification.
        tls_hostname: the name to verify the server's certificate against.
    """

    url: str = "nats://127.0.0.1:4222"
    secret: str | bytes | Sequence[str | bytes] | None = field(default=None, repr=False)
    scope: str = "default"
    stream: str = "CONTEXTPILOT"
    max_age: float = 3600.0
    max_entries: int = 1_000_000
    snapshot_interval: float = 60.0
    max_unsent: int = 1_000_000
    batch_entries: int = 512
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds: str | None = None
    nkey_seed: str | None = None
    tls: ssl.SSLContext | None = field(default=None, repr=False, compare=False)
    tls_hostname: str | None = None

    def __post_init__(self) -> None:
        _check_url(self.url)
        object.__setattr__(self, "secret", _secrets(self.secret))
        if not isinstance(self.scope, str) or not self.scope:
            raise SharedSettingsError("shared scope must be a non-empty str")
        if not isinstance(self.stream, str) or not _STREAM_NAME.fullmatch(self.stream):
            raise SharedSettingsError(
                f"shared: the stream name {self.stream!r} must be 1-64 letters, digits, '_' or '-' (NATS refuses "
                "others, and it names the log's subjects)"
            )
        for name in ("max_entries", "max_unsent", "batch_entries"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SharedSettingsError(f"shared: {name} must be an int of at least 1, got {value!r}")
        max_age, interval = _seconds("max_age", self.max_age), _seconds("snapshot_interval", self.snapshot_interval)
        if max_age < _MIN_MAX_AGE:
            raise SharedSettingsError(
                f"shared: max_age={max_age:g} s is too short: entries must stay at least {_MIN_MAX_AGE:g} s, so a "
                "worker restarting or cut off from the broker for a moment catches up from them"
            )
        if interval > 0 and max_age < 2 * interval:
            raise SharedSettingsError(
                f"shared: max_age={max_age:g} s must be at least twice snapshot_interval={interval:g} s: a worker "
                "starting late loads the newest snapshot and replays the stream after it, and entries between the "
                "two would be gone; raise max_age or lower snapshot_interval"
            )
        if self.tls is not None and not isinstance(self.tls, ssl.SSLContext):
            raise SharedSettingsError("tls must be an ssl.SSLContext")

    def __repr__(self) -> str:
        return f"SharedOptions(url={redact(self.url)!r}, scope={self.scope!r}, stream={self.stream!r})"

    @property
    def key(self) -> bytes:
        """The secret that signs (the first)."""
        return self.keys[0]

    @property
    def keys(self) -> tuple[bytes, ...]:
        """Every secret that verifies, the signing one first."""
        assert isinstance(self.secret, tuple)
        return self.secret

    @property
    def subject(self) -> str:
        return f"contextpilot.{self.stream.lower()}.{_TOKEN.sub('_', self.scope)}"

    @property
    def snapshot_name(self) -> str:
        return f"{self.stream}-{_TOKEN.sub('_', self.scope)}"

    def connect_options(self) -> dict[str, Any]:
        """The credentials and TLS settings, as ``nats.connect`` takes them."""
        given = {
            "user": self.user,
            "password": self.password,
            "token": self.token,
            "user_credentials": self.creds,
            "nkeys_seed": self.nkey_seed,
            "tls": self.tls,
            "tls_hostname": self.tls_hostname,
        }
        return {name: value for name, value in given.items() if value is not None}


def _secrets(given: object) -> tuple[bytes, ...]:
    """The deployment's secrets as bytes, the signing one first, each checked (never shown)."""
    if given is None:
        env = os.environ.get(SECRET_ENV)
        given = [part.strip() for part in env.split(",")] if env is not None else None
    missing = SharedSettingsError(
        f"shared: set a secret (SharedOptions(secret=...) or {SECRET_ENV}), the same for every worker: "
        "entries are signed with it, and a worker applies none it cannot authenticate"
    )
    if isinstance(given, (str, bytes)):
        given = [given]
    if not isinstance(given, (list, tuple)) or not given:
        raise missing
    keys: list[bytes] = []
    for position, item in enumerate(given, 1):
        key = item.encode() if isinstance(item, str) else item
        if not isinstance(key, bytes) or not key.strip():
            raise missing
        if len(key) < _MIN_SECRET or len(set(key)) < _MIN_DISTINCT:
            raise SharedSettingsError(
                f"shared: secret {position} of {len(given)} is too weak: a secret shorter than {_MIN_SECRET} bytes, or "
                f"of fewer than {_MIN_DISTINCT} different characters, can be guessed from any signed message; use "
                "e.g. `openssl rand -hex 32`"
            )
        if key not in keys:
            keys.append(key)
    if len(keys) > _MAX_SECRETS:
        raise SharedSettingsError(f"shared: at most {_MAX_SECRETS} secrets (the signing one, then those still read)")
    return tuple(keys)


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise SharedSettingsError(f"shared: {name} must be a finite number of seconds, at least 0, got {value!r}")
    return float(value)


def names_credentials(error: object, options: SharedOptions) -> bool:
    """Whether an error's text would show a credential (a client's message quoting the URL)."""
    text = str(error)
    secrets_ = [options.password, options.token, urllib.parse.urlsplit(options.url.split(",")[0]).password]
    return any(s and s in text for s in secrets_)
