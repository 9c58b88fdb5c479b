"""Runs the frontend and the scripted decode node as real child processes on loopback, for tests and
benchmarks. Each process logs to its own file; a start that fails raises with the log's tail."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTED_NODE = "testing.scripted_decode_node"  # run as `python -m` from the repository root


class ProcessStartError(RuntimeError):
    """A child process exited or did not become ready; the message carries its log tail."""


@dataclass(eq=False)
class Proc:
    """A child process and its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode


def spawn(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Proc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with log_path.open("ab") as log:
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    return Proc(name, popen, log_path)


def wait_for_line(proc: Proc, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.log_text():
        if not proc.alive():
            raise ProcessStartError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise ProcessStartError(f"{proc.name} not ready after {timeout}s:\n{proc.tail()}")
        time.sleep(0.05)  # the poll interval


def wait_for_http(proc: Proc, url: str, timeout: float, status: int = 200, ca: str | None = None) -> None:
    deadline = time.monotonic() + timeout
    context = ssl.create_default_context(cafile=ca) if ca else None
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as resp:
                if resp.status == status:
                    return
        except urllib.error.HTTPError as err:
            if err.code == status:
                return
        except (urllib.error.URLError, OSError):
            pass
        if not proc.alive():
            raise ProcessStartError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise ProcessStartError(f"{proc.name}: {url} not answering {status} after {timeout}s:\n{proc.tail()}")
        time.sleep(0.1)  # the poll interval


def start_scripted_node(name: str, log_dir: Path, etcd: list[str], *args: str, timeout: float = 30.0) -> Proc:
    """Starts `python -m testing.scripted_decode_node` with `args`, registered in `etcd`; waits for "ready"."""
    argv = [sys.executable, "-m", SCRIPTED_NODE, *(f"--etcd={e}" for e in etcd), *args]
    proc = spawn(name, argv, log_dir)
    try:
        wait_for_line(proc, "ready", timeout)
    except ProcessStartError:
        proc.stop()
        raise
    return proc


@dataclass(eq=False)
class FrontendProc:
    proc: Proc
    host: str
    port: int
    ca: str | None = None  # the CA file of its certificate, when it serves HTTPS

    @property
    def base_url(self) -> str:
        return f"{'https' if self.ca else 'http'}://{self.host}:{self.port}"

    def stop(self) -> int | None:
        return self.proc.stop()


def start_frontend(name: str, log_dir: Path, etcd: list[str], port: int, *args: str,
                   ready: bool = True, timeout: float = 60.0, tls_ca: str | None = None,
                   env: dict[str, str] | None = None) -> FrontendProc:
    """Starts `python -m pdserve.frontend` on 127.0.0.1:`port`; waits for /health, and for /ready when `ready`
    (over HTTPS, trusting `tls_ca`, when it is given: the frontend was given --tls-cert/--tls-key)."""
    if "--response-store" not in args:  # stored responses beside the logs, never in the user's home
        args = (*args, "--response-store", str(log_dir / f"{name}-responses.db"))
    argv = [sys.executable, "-m", "pdserve.frontend", *(f"--etcd={e}" for e in etcd), "--host", "127.0.0.1",
            "--port", str(port), *args]
    proc = spawn(name, argv, log_dir, env)
    fp = FrontendProc(proc, "127.0.0.1", port, tls_ca)
    try:
        wait_for_http(proc, f"{fp.base_url}/health", timeout, ca=tls_ca)
        if ready:
            wait_for_http(proc, f"{fp.base_url}/ready", timeout, ca=tls_ca)
    except ProcessStartError:
        proc.stop()
        raise
    return fp


# The processes a test may start: `python -m` of these modules, these executables, and `pdserve` (the
# launcher). Other children (a compiler, multiprocessing's helpers) are not the harness's business.
_CLUSTER_MODULES = ("pdserve.prefill_node", "pdserve.decode_node", "pdserve.frontend", SCRIPTED_NODE, "pdserve.deploy")
_CLUSTER_EXECUTABLES = ("etcd", "prometheus", "pdserve")


def _is_cluster_process(argv: list[str]) -> bool:
    """Whether a command line (argv) is one of the processes above; judged by the module or executable
    it runs, never by a path that merely contains such a name."""
    if "-m" in argv[:-1]:
        module = argv[argv.index("-m") + 1]
        return any(module == m or module.startswith(m + ".") for m in _CLUSTER_MODULES)
    names = [Path(a).name for a in argv[:2]]  # the executable, or the script an interpreter runs
    return any(n in _CLUSTER_EXECUTABLES for n in names)


def _children(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc; empty where /proc is not Linux's)."""
    out = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 4 is the parent pid; the command name (field 2) may hold spaces, so split after it.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


def reap_cluster_processes(pid: int | None = None) -> list[str]:
    """Kills (SIGKILL) the cluster processes still running as children of `pid` (this process by
    default) and waits for them; returns a description of each, for the test that left them behind."""
    found = []
    for child in _children(os.getpid() if pid is None else pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if not args or not _is_cluster_process(args):
            continue
        command = " ".join(args)
        found.append(f"pid {child}: {command[:200]}")
        try:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    return found
