"""An engine started from a command line, with an empty cache: :class:`ServerProcess`.

What ``demo --engine-cmd`` (:mod:`.engine_compare`) needs of an engine process: start it on a
free 127.0.0.1 port, wait for ``/health``, stop it with its workers. The harnesses that build
and start a test engine (llama-server, vLLM, SGLang) are in ``contextpilot_integrations.testing``.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

__all__ = ["ServerProcess", "free_port"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """An engine started from a command line, waited for until ``/health`` answers 200.

    Used where a cache must start empty and the engine cannot flush it: stop the process
    and start it again. ``{port}`` in the command is replaced by a free port.
    """

    def __init__(self, command: str | Sequence[str], log: Path | None = None, startup_timeout: float = 120.0) -> None:
        args = shlex.split(command) if isinstance(command, str) else list(command)
        self.port = free_port()
        self.args = [arg.replace("{port}", str(self.port)) for arg in args]
        self.url = f"http://127.0.0.1:{self.port}"
        for i, arg in enumerate(self.args[:-1]):
            if arg == "--port":
                self.port = int(self.args[i + 1])
                self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("w") if log is not None else subprocess.DEVNULL
        # its own process group: stop() ends the workers an engine starts (SGLang, vLLM) too
        self.process = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:  # whatever stops the wait (a timeout, Ctrl-C) stops the engine: none is left behind
            self._wait_healthy(log, startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, log: Path | None, startup_timeout: float) -> None:
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = log.read_text()[-2000:] if log is not None else ""
                raise RuntimeError(f"the engine exited with status {self.process.returncode}: {tail}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the engine did not answer {self.url}/health within {startup_timeout:.0f} s")

    def stop(self) -> None:
        """Terminate the process group; kill what is left after 20 s."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                continue
            try:  # the leader is gone; its workers may take a moment longer
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    os.killpg(self.process.pid, 0)
                    time.sleep(0.2)
            except ProcessLookupError:
                break
        if self._log is not subprocess.DEVNULL:
            self._log.close()  # type: ignore[union-attr]

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
