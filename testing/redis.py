"""A private, throwaway Redis server for tests that need a real one (no mocks).

`redis_server_bin()` finds `redis-server` (installing Debian's `redis-server` package when it is missing
and we are root with apt-get, else skipping the test). `RedisServer` runs one on a free loopback port in a
temporary directory (no persistence: the data is disposable); `stop()` / `start()` take it down and bring
it back on the same port, for tests of a store that loses its server mid-run.

Tests use the `redis_server` fixture by importing it into their module:
`from testing.redis import redis_server  # noqa: F401`.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.registry.etcd_server import free_port
from testing.debian import require_package


def redis_server_bin() -> str:
    """The path of `redis-server`; installs Debian's package when missing and root, else skips."""
    return require_package("redis-server", lambda: shutil.which("redis-server") or
                           ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None),
                           "the Redis server (redis-server)")


class RedisServer:
    """One private redis-server; `start()` / `stop()` may be repeated (same port), `close()` stops it for
    good and removes its directory."""

    def __init__(self, binary: str | None = None) -> None:
        self.binary = binary or redis_server_bin()
        self.root = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
        self.port = free_port()
        self.log_path = self.root / "redis.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 20.0) -> None:
        """Starts the server and waits until it answers PING."""
        if self.running:
            return
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.root),
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "yes",
                "--logfile", str(self.log_path)]
        self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self._pings():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                log = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}:\n{log}")
            time.sleep(0.05)

    def _pings(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Stops it at once (SIGKILL: connections are cut, nothing is saved), as when a server dies."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A running private Redis for the module (skips when none can be had); a test that stops it must
    start it again. Always stopped and removed at teardown."""
    server = RedisServer()
    try:
        server.start()
        yield server
    finally:
        server.close()
