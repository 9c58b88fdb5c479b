"""A private, throwaway PostgreSQL server for tests that need a real one (no mocks).

`postgres_bin_dir()` finds the server binaries (on PATH, or Debian's /usr/lib/postgresql/<version>/bin),
installs Debian's `postgresql` package when they are missing and we are root with apt-get, else skips
the test. `PostgresServer` runs initdb into a temporary directory and a postmaster on a free loopback
port (its unix socket in that directory, fsync off: the data is disposable); `stop()`/`start()` take it
down and bring it back on the same port and data, for tests of a store losing its database. As root it
runs as an unprivileged user (the postmaster refuses to run as root).

Tests use the `postgres_server` fixture by importing it into their module:
`from testing.postgres import postgres_server  # noqa: F401`.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.registry.etcd_server import free_port
from testing.debian import require_package

USER = "pdserve"  # the database superuser initdb creates (trust authentication: no password)


def _find_bin_dir() -> Path | None:
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl", path=str(Path(found).parent)):
        return Path(found).parent

    def version(path: str) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", Path(path).parent.parent.name))

    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=version, reverse=True)
    return Path(candidates[0]).parent if candidates else None


def postgres_bin_dir() -> Path:
    """The directory of initdb/pg_ctl/postgres; installs Debian's package when missing and root (like
    tests/test_prometheus_live.py does for prometheus), else skips the calling test."""
    def find() -> str | None:
        found = _find_bin_dir()
        return None if found is None else str(found)

    return Path(require_package("postgresql", find, "the PostgreSQL server binaries (initdb, pg_ctl on PATH or in "
                                                    "/usr/lib/postgresql/*/bin)"))


def _unprivileged_user() -> pwd.struct_passwd | None:
    """Whom to run the server as: None (ourselves) unless we are root, which the postmaster refuses."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("running as root and found neither a `postgres` nor a `nobody` user to run PostgreSQL as")


class PostgresServer:
    """One private postmaster; `start()`/`stop()` may be repeated (same port, same data), `close()` stops
    it for good and removes its files."""

    def __init__(self, bin_dir: Path | None = None) -> None:
        self.bin_dir = bin_dir or postgres_bin_dir()
        self._as = _unprivileged_user()
        # Under /tmp itself when running as another user: pytest's own tmp dirs are private to root.
        parent = "/tmp" if self._as is not None and os.path.isdir("/tmp") else None
        self.root = Path(tempfile.mkdtemp(prefix="pdserve-pg-", dir=parent))
        self.data_dir = self.root / "data"
        self.log_path = self.root / "postgres.log"
        self.port = free_port()
        if self._as is not None:
            os.chown(self.root, self._as.pw_uid, self._as.pw_gid)
        try:
            self._initdb()
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise

    def _cmd(self, *argv: str) -> list[str]:
        if self._as is None:
            return list(argv)
        if shutil.which("setpriv"):
            return ["setpriv", f"--reuid={self._as.pw_uid}", f"--regid={self._as.pw_gid}", "--clear-groups", *argv]
        return ["runuser", "-u", self._as.pw_name, "--", *argv]

    def _run(self, *argv: str, timeout: float = 120) -> None:
        env = dict(os.environ, LC_ALL="C", LANG="C")
        if self._as is not None:
            env["HOME"] = str(self.root)
        result = subprocess.run(self._cmd(*argv), cwd=self.root, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        if result.returncode != 0:
            log = self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""
            raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{log}")

    def _initdb(self) -> None:
        self._run(str(self.bin_dir / "initdb"), "-D", str(self.data_dir), "-U", USER, "--auth=trust",
                  "--encoding=UTF8", "--locale=C", "--no-sync")
        with open(self.data_dir / "postgresql.conf", "a") as conf:
            conf.write(f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                       f"unix_socket_directories = '{self.root}'\n"
                       "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n"
                       "max_connections = 100\nshared_buffers = 16MB\n")

    @property
    def running(self) -> bool:
        pid = self._postmaster_pid()
        return pid is not None and _alive(pid)

    def _postmaster_pid(self) -> int | None:
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def start(self) -> None:
        """Starts the postmaster and waits until it accepts connections."""
        if not self.running:
            self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-l", str(self.log_path),
                      "-w", "-t", "60", "start")

    def stop(self) -> None:
        """Stops it at once (`-m fast`: open connections are cut, as when a database server goes down)."""
        pid = self._postmaster_pid()
        if pid is None or not _alive(pid):
            return
        try:
            self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", "fast", "-w", "-t", "30",
                      "stop", timeout=60)
        except (RuntimeError, subprocess.TimeoutExpired):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)  # its children exit when the postmaster goes
            deadline = time.monotonic() + 10
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)

    def close(self) -> None:
        """Stops the server for good and removes its data."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def dsn(self, dbname: str = "postgres", password: str | None = None) -> str:
        """A URL for `dbname` over TCP (trust authentication accepts any password)."""
        auth = USER if password is None else f"{USER}:{password}"
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str | None = None) -> str:
        """Creates a fresh database (a test's own) and returns its name."""
        import psycopg

        name = name or f"t_{uuid.uuid4().hex[:16]}"
        if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            raise ValueError(f"database name {name!r}: lowercase letters, digits and _ only")
        with psycopg.connect(self.dsn(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return name


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A running private PostgreSQL for the session (skips when none can be had); a test that stops it
    must start it again. Always stopped and removed at teardown."""
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.close()
