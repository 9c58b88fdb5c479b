"""`pdserve up`: the whole cluster on one machine, supervised.

Processes, each in a session of its own so that a Ctrl-C in the terminal reaches only the launcher, which
then stops them in order:

    etcd        python -m registry.etcd_server    (etcd's /metrics is on its client port)
    prefill-i   python -m node.prefill            (/metrics on a port the launcher picks)
    decode-i    python -m node.decode
    frontend    python -m frontend                (the OpenAI API and /metrics on --host:--port)

Start-up: etcd, then every node at once (progress shown while the models load), then the frontend once
the nodes are registered. A process that dies after it was ready is reported and restarted, with a
backoff that doubles up to 30 s. Ctrl-C (or SIGTERM) stops the frontend, then the decode nodes, then the
prefill nodes (each drains: deregisters, finishes its requests, exits), checks that the cluster's registry
prefix is empty (deleting what a killed process left), then stops etcd. A second Ctrl-C stops what is
left at once.

Files, under `<runs>/<cluster>/` (`runs/` in the repository root by default):
    logs/<process>.log           every process's output (logs/requests.log: the frontend's request log)
    prometheus_targets.json      Prometheus file-discovery targets (deploy/prometheus/README.md),
                                 rewritten atomically whenever a process starts, moves or stops
    cluster.json                 what `pdserve status` reads to find the cluster (removed at exit)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from node.ready import READY_PREFIX
from registry import cluster_prefix, parse_endpoint
from registry.etcd_server import free_port

if TYPE_CHECKING:
    from engine.default_model import ResolvedModel

REPO_ROOT = Path(__file__).resolve().parents[1]
POOLS = ("etcd", "prefill", "decode", "frontend")
_POLL_S = 0.2
_BACKOFF_MAX_S = 30.0
_STABLE_S = 60.0  # a process that ran this long before dying restarts after the shortest backoff


def default_runs_dir() -> Path:
    """`runs/` in the repository root when running from a checkout, else in the working directory."""
    return REPO_ROOT / "runs" if (REPO_ROOT / "pyproject.toml").is_file() else Path.cwd() / "runs"


def write_json_atomic(path: Path, data: object) -> None:
    """Writes JSON to a temporary file beside `path`, then renames it over `path` (readers never see
    half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


@dataclass(frozen=True)
class LauncherConfig:
    """Everything `pdserve up` was asked for; validated once."""

    model: str  # HF model directory
    model_name: str = ""  # the pool (and served) model name; "" = the directory's name
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"  # the frontend's address
    port: int = 8000
    dtype: str = "auto"
    kv_memory_mib: int = 512  # KV cache budget of each node
    num_threads: int = 1  # torch threads per node: several nodes share this machine's cores
    cluster: str = "default"
    runs_dir: Path = field(default_factory=default_runs_dir)
    lease_ttl_s: int = 3  # a killed node leaves the registry this fast
    drain_timeout_s: float = 20.0  # per node, at Ctrl-C
    startup_timeout_s: float = 600.0  # model loading on a slow disk or a cold cache
    restart: bool = True
    node_args: tuple[str, ...] = ()  # extra flags for every node
    frontend_args: tuple[str, ...] = ()  # extra flags for the frontend
    python: str = sys.executable

    def __post_init__(self) -> None:
        checks = [
            (Path(self.model).is_dir(), f"model directory {self.model!r} does not exist"),
            (self.num_prefill >= 0, "--prefill must be >= 0"),
            (self.num_decode >= 1, "--decode must be >= 1 (decode nodes serve every request)"),
            (0 < self.port < 65536, f"--port must be in [1, 65535], got {self.port}"),
            (self.dtype in ("auto", "float32", "bfloat16", "float16"), f"bad --dtype {self.dtype!r}"),
            (self.kv_memory_mib >= 1, "--kv-memory must be >= 1 MiB"),
            (self.num_threads >= 1, "--num-threads must be >= 1"),
            (bool(self.cluster) and "/" not in self.cluster, f"bad --cluster {self.cluster!r}"),
            (self.lease_ttl_s >= 1, "lease TTL must be >= 1 s"),
            (self.drain_timeout_s >= 0 and self.startup_timeout_s > 0, "timeouts must be positive"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"pdserve up: {msg}")
        if not self.model_name:
            object.__setattr__(self, "model_name", Path(self.model).resolve().name)

    @property
    def cluster_dir(self) -> Path:
        return self.runs_dir / self.cluster

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class ClusterState:
    """The contents of `cluster.json`: how `pdserve status` finds a running `pdserve up`."""

    cluster: str
    launcher_pid: int
    etcd_endpoints: list[str]
    url: str
    model: str
    started_at: float
    processes: list[dict[str, Any]]  # name, pool, pid, metrics, log, restarts

    @staticmethod
    def path(runs_dir: Path, cluster: str) -> Path:
        return runs_dir / cluster / "cluster.json"

    @classmethod
    def load(cls, runs_dir: Path, cluster: str) -> ClusterState | None:
        """The state of a launcher that is still running, else None."""
        try:
            obj = json.loads(cls.path(runs_dir, cluster).read_text(encoding="utf-8"))
            state = cls(**obj)
        except (OSError, ValueError, TypeError):
            return None
        return state if pid_alive(state.launcher_pid) else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(eq=False)
class Slot:
    """One process the launcher keeps running; restarted in place when it dies."""

    name: str  # also the node id (or frontend id)
    pool: str  # etcd | prefill | decode | frontend
    log_path: Path
    metrics_port: int = 0  # nodes: the /metrics port given on the command line
    proc: subprocess.Popen[bytes] | None = None
    ready: bool = False
    was_ready: bool = False  # ready at least once: a death is then a crash to restart, not a bad start
    info: dict[str, Any] = field(default_factory=dict)  # the ready line (nodes) or etcd's JSON line
    starts: int = 0
    started_at: float = 0.0
    restart_at: float | None = None
    backoff_s: float = 1.0
    status: str = "waiting"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.alive and self.proc is not None else None

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class StartupError(RuntimeError):
    """The cluster could not be started; the message says which process and shows its log tail."""


class Launcher:
    """Starts, supervises and stops one local cluster. `run()` blocks until Ctrl-C / SIGTERM."""

    def __init__(self, config: LauncherConfig, console: Console | None = None) -> None:
        self.config = config
        self.console = console or Console(stderr=True, highlight=False)
        self.out = Console(highlight=False)  # the banner goes to stdout
        self.logs_dir = config.cluster_dir / "logs"
        self.slots: list[Slot] = [Slot("etcd", "etcd", self.logs_dir / "etcd.log")]
        self.slots += [Slot(f"prefill-{i}", "prefill", self.logs_dir / f"prefill-{i}.log")
                       for i in range(config.num_prefill)]
        self.slots += [Slot(f"decode-{i}", "decode", self.logs_dir / f"decode-{i}.log")
                       for i in range(config.num_decode)]
        self.slots.append(Slot("frontend-0", "frontend", self.logs_dir / "frontend-0.log"))
        self._stop = threading.Event()
        self._force = threading.Event()
        self._started_at = time.time()
        self._etcd_endpoints: list[str] = []  # etcd keeps its ports across restarts

    # -- entry point ----------------------------------------------------------------------------------

    def run(self) -> int:
        """Starts the cluster, supervises it until a stop signal, stops it. Returns an exit code."""
        try:
            self._prepare()
        except StartupError as err:
            self.console.print(f"[red]pdserve up: {err}[/red]")
            return 1
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                self._start_all()
            except StartupError as err:
                self.console.print(f"[red]pdserve up: {err}[/red]")
                return 1
            if self._stop.is_set():
                return 130
            self._print_banner()
            self._supervise()
            return 0
        finally:
            self._shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._stop.is_set():
            self._force.set()
        self._stop.set()

    # -- start ----------------------------------------------------------------------------------------

    def _prepare(self) -> None:
        cfg = self.config
        running = ClusterState.load(cfg.runs_dir, cfg.cluster)
        if running is not None:
            raise StartupError(
                f"cluster {cfg.cluster!r} is already running (launcher pid {running.launcher_pid}, {running.url}); "
                f"see `pdserve status`, or pick another --cluster"
            )
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((cfg.host, cfg.port))
            except OSError as err:
                raise StartupError(f"cannot serve on {cfg.host}:{cfg.port} ({err}); pick another --port") from err
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        # The registry of a local cluster lives as long as the cluster: a new `up` starts from an empty one
        # (and from fresh ports, so that a port taken since the last run is no obstacle).
        etcd_dir = cfg.cluster_dir / "etcd"
        shutil.rmtree(etcd_dir / "data", ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (etcd_dir / "ports.json").unlink()
        self._write_files()

    def _start_all(self) -> None:
        etcd = self.slots[0]
        self._spawn(etcd)
        self._wait_ready([etcd], "starting etcd")
        if self._stop.is_set():
            return
        nodes = [s for s in self.slots if s.pool in ("prefill", "decode")]
        for slot in nodes:
            self._spawn(slot)
        self._wait_ready(nodes, "loading the model on every node")
        if self._stop.is_set():
            return
        frontend = self.slots[-1]
        self._spawn(frontend)
        self._wait_ready([frontend], "starting the frontend")

    def _command(self, slot: Slot) -> list[str]:
        cfg = self.config
        py = [cfg.python, "-m"]
        if slot.pool == "etcd":
            return [*py, "registry.etcd_server", "--data-dir", str(cfg.cluster_dir / "etcd")]
        etcd = ",".join(self.etcd_endpoints)
        if slot.pool == "frontend":
            return [
                *py, "frontend", "--etcd", etcd, "--cluster", cfg.cluster, "--host", cfg.host, "--port", str(cfg.port),
                "--model", f"{cfg.model_name}={cfg.model}", "--frontend-id", slot.name,
                "--request-log", str(self.logs_dir / "requests.log"), *cfg.frontend_args,
            ]
        return [
            *py, f"node.{slot.pool}", "--node-id", slot.name, "--cluster", cfg.cluster, "--etcd", etcd,
            "--model", cfg.model, "--model-name", cfg.model_name, "--dtype", cfg.dtype,
            "--kv-cache-memory-mib", str(cfg.kv_memory_mib), "--num-threads", str(cfg.num_threads),
            "--lease-ttl", str(cfg.lease_ttl_s), "--drain-timeout", str(cfg.drain_timeout_s),
            "--metrics-host", "127.0.0.1", "--metrics-port", str(slot.metrics_port), *cfg.node_args,
        ]

    @property
    def etcd_endpoints(self) -> list[str]:
        return list(self._etcd_endpoints)

    def _spawn(self, slot: Slot) -> None:
        """Starts (or restarts) the slot's process; its output is appended to its log."""
        if slot.pool in ("prefill", "decode") and (slot.metrics_port == 0 or not slot.was_ready):
            # Kept across restarts so the Prometheus target stays put; picked anew after a failed start.
            slot.metrics_port = free_port("127.0.0.1")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.config.num_threads))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        slot.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(slot.log_path, "ab") as log:
            log.write(f"\n=== pdserve up: starting {slot.name} (start #{slot.starts + 1})\n".encode())
            log.flush()
            reads_stdout = slot.pool != "frontend"
            slot.proc = subprocess.Popen(
                self._command(slot), cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if reads_stdout else log, stderr=log, start_new_session=True,
            )
        slot.starts += 1
        slot.started_at = time.monotonic()
        slot.info = {}
        slot.ready = False
        slot.restart_at = None
        slot.status = "starting"
        if reads_stdout:
            threading.Thread(target=self._read_stdout, args=(slot, slot.proc), daemon=True,
                             name=f"stdout-{slot.name}").start()

    @staticmethod
    def _read_stdout(slot: Slot, proc: subprocess.Popen[bytes]) -> None:
        """Takes the ready line (nodes) or etcd's JSON line; copies everything to the log."""
        assert proc.stdout is not None
        with open(slot.log_path, "ab") as log:
            for raw in proc.stdout:
                log.write(raw)
                log.flush()
                line = raw.decode(errors="replace").strip()
                if slot.proc is not proc:
                    continue
                if line.startswith(READY_PREFIX):
                    slot.info = json.loads(line[len(READY_PREFIX):])
                elif slot.pool == "etcd" and line.startswith("{"):
                    with contextlib.suppress(ValueError):
                        slot.info = json.loads(line)

    def _check_ready(self, slot: Slot) -> bool:
        if slot.ready or not slot.alive:
            return slot.ready
        if slot.pool == "frontend":
            ok = _http_ok(f"http://{self.config.host}:{self.config.port}/ready")
        else:
            ok = bool(slot.info)  # the reader takes only the current process's line
        if ok:
            if slot.pool == "etcd":
                self._etcd_endpoints = [str(e) for e in slot.info["endpoints"]]
            slot.ready = slot.was_ready = True
            slot.status = "ready"
            self._write_files()
        return ok

    def _wait_ready(self, slots: Sequence[Slot], what: str) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        with Live(self._progress_table(what), console=self.console, refresh_per_second=4, transient=True) as live:
            while not all(self._check_ready(s) for s in slots):
                if self._stop.is_set():
                    return
                for slot in slots:
                    if not slot.alive and not slot.ready:
                        code = slot.proc.returncode if slot.proc is not None else None
                        raise StartupError(f"{slot.name} exited with code {code} while starting; "
                                           f"log {slot.log_path}:\n{slot.log_tail()}")
                    if not slot.ready:
                        doing = "loading the model" if slot.pool in ("prefill", "decode") else "starting"
                        slot.status = f"{doing} ({time.monotonic() - slot.started_at:.0f}s)"
                if time.monotonic() > deadline:
                    late = [s.name for s in slots if not s.ready]
                    raise StartupError(f"{', '.join(late)} not ready after {self.config.startup_timeout_s:.0f}s; "
                                       f"logs in {self.logs_dir}")
                live.update(self._progress_table(what))
                time.sleep(_POLL_S)
        for slot in slots:
            self.console.print(f"  [green]ready[/green] {slot.name:<11} pid {slot.pid}  {self._endpoint(slot)}")

    def _progress_table(self, what: str) -> Table:
        table = Table(title=f"pdserve up: {what}", title_justify="left", box=None, pad_edge=False)
        for column in ("process", "pool", "pid", "status"):
            table.add_column(column)
        for slot in self.slots:
            table.add_row(slot.name, slot.pool, str(slot.pid or "-"), slot.status)
        return table

    def _endpoint(self, slot: Slot) -> str:
        if slot.pool == "etcd":
            return ",".join(self.etcd_endpoints)
        if slot.pool == "frontend":
            return self.config.base_url
        return f"grpc {slot.info.get('grpc_address')}  metrics {slot.info.get('metrics_address')}"

    def _print_banner(self) -> None:
        cfg = self.config
        url, model = cfg.base_url, cfg.model_name
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
        sdk = (
            "from openai import OpenAI\n"
            f'client = OpenAI(base_url="{url}/v1", api_key="local")\n'
            f'reply = client.chat.completions.create(model="{model}", max_tokens=32,\n'
            '                                        messages=[{"role": "user", "content": "Hello!"}])\n'
            "print(reply.choices[0].message.content)"
        )
        node_metrics = "\n".join(
            f"             {s.name:<11} http://{s.info.get('metrics_address')}/metrics"
            for s in self.slots if s.pool in ("prefill", "decode")
        )
        etcd_metrics = "".join(f"http://{e}/metrics" for e in self.etcd_endpoints[:1])
        self.out.print(
            f"\n[bold green]pdserve is up[/bold green]: {model}, {cfg.num_prefill} prefill + {cfg.num_decode} decode "
            f"node(s), cluster {cfg.cluster!r}\n\n"
            f"  URL        {url}/v1  (OpenAI-compatible)\n\n"
            f"  curl       curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"               -d '{body}'\n\n"
            f"  openai SDK (python)\n{_indent(sdk, 13)}\n\n"
            f"  logs       {self.logs_dir}/*.log\n"
            f"  /metrics   frontend    {url}/metrics\n{node_metrics}\n"
            f"             etcd        {etcd_metrics}\n"
            f"  Prometheus {cfg.cluster_dir / 'prometheus_targets.json'} "
            f"(deploy/prometheus/prometheus.yml reads it)\n"
            f"  status     pdserve status{self._status_flags()} [--json]\n\n"
            "Ctrl-C stops the cluster.\n",
            highlight=False, markup=True, soft_wrap=True,
        )

    def _status_flags(self) -> str:
        flags = "" if self.config.cluster == "default" else f" --cluster {self.config.cluster}"
        if self.config.runs_dir.resolve() != default_runs_dir().resolve():
            flags += f" --runs-dir {self.config.runs_dir}"
        return flags

    # -- supervise ------------------------------------------------------------------------------------

    def _supervise(self) -> None:
        while not self._stop.wait(_POLL_S):
            for slot in self.slots:
                self._tend(slot)

    def _tend(self, slot: Slot) -> None:
        """Notices a death (reports it, schedules a restart), restarts when due, and notices readiness."""
        now = time.monotonic()
        if slot.proc is not None and not slot.alive and slot.restart_at is None:
            code = slot.proc.returncode
            slot.ready = False
            if now - slot.started_at > _STABLE_S:
                slot.backoff_s = 1.0
            slot.status = f"exited ({code})"
            self._write_files()
            if not self.config.restart:
                self.console.print(f"[red]{slot.name} (pid {slot.proc.pid}) exited with code {code}; "
                                   f"not restarting (log {slot.log_path})[/red]")
                slot.proc = None
                return
            slot.restart_at = now + slot.backoff_s
            self.console.print(f"[yellow]{slot.name} (pid {slot.proc.pid}) exited with code {code}; restarting in "
                               f"{slot.backoff_s:.0f}s (log {slot.log_path})[/yellow]")
            slot.backoff_s = min(slot.backoff_s * 2, _BACKOFF_MAX_S)
        elif slot.restart_at is not None and now >= slot.restart_at:
            self._spawn(slot)
        elif slot.alive and not slot.ready and self._check_ready(slot):
            self.console.print(f"[green]{slot.name} is back[/green] (pid {slot.pid}, start #{slot.starts})")

    # -- files ----------------------------------------------------------------------------------------

    def _targets(self) -> list[dict[str, Any]]:
        groups = []
        for slot in self.slots:
            if slot.pool == "etcd":
                addresses = self.etcd_endpoints
            elif slot.pool == "frontend":
                addresses = [f"{self.config.host}:{self.config.port}"] if slot.was_ready else []
            else:
                addresses = [str(slot.info["metrics_address"])] if slot.was_ready and slot.info else []
            if addresses and slot.alive:
                labels = {"cluster": self.config.cluster, "pool": slot.pool, "node": slot.name}
                groups.append({"targets": addresses, "labels": labels})
        return groups

    def _write_files(self) -> None:
        """Rewrites the Prometheus targets and the cluster state (both atomically)."""
        cfg = self.config
        write_json_atomic(cfg.cluster_dir / "prometheus_targets.json", self._targets())
        processes = [{
            "name": s.name, "pool": s.pool, "pid": s.pid, "log": str(s.log_path), "restarts": max(0, s.starts - 1),
            "metrics": s.info.get("metrics_address") if s.pool in ("prefill", "decode") else None,
            "grpc": s.info.get("grpc_address"),
        } for s in self.slots]
        state = ClusterState(cfg.cluster, os.getpid(), self.etcd_endpoints, cfg.base_url, cfg.model_name,
                             self._started_at, processes)
        write_json_atomic(ClusterState.path(cfg.runs_dir, cfg.cluster), state.__dict__)

    # -- stop -----------------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        """Stops every process in order; checks (and if need be empties) the registry before etcd goes."""
        self._stop.set()
        self.console.print("[bold]pdserve: stopping[/bold] (Ctrl-C again to stop at once)")
        pools = [[s for s in self.slots if s.pool == pool] for pool in ("frontend", "decode", "prefill")]
        grace = {"frontend": 15.0, "decode": self.config.drain_timeout_s + 10, "prefill": self.config.drain_timeout_s + 10}
        for group in pools:
            if group:
                self._stop_group(group, grace[group[0].pool])
        etcd = self.slots[0]
        if etcd.alive and self.etcd_endpoints:
            leftovers = _empty_registry(self.etcd_endpoints, self.config.cluster)
            if leftovers:
                self.console.print(f"[yellow]removed {len(leftovers)} stale registry key(s): "
                                   f"{', '.join(leftovers)}[/yellow]")
            else:
                self.console.print("  registry: no key left")
        self._stop_group([etcd], 10.0)
        write_json_atomic(self.config.cluster_dir / "prometheus_targets.json", [])
        with contextlib.suppress(FileNotFoundError):
            ClusterState.path(self.config.runs_dir, self.config.cluster).unlink()
        left = [s.name for s in self.slots if s.alive]
        if left:
            self.console.print(f"[red]still running: {', '.join(left)}[/red]")
        else:
            self.console.print("[bold]pdserve: stopped[/bold]; every process exited")

    def _stop_group(self, group: Iterable[Slot], grace_s: float) -> None:
        group = [s for s in group if s.alive]
        for slot in group:
            slot.restart_at = None
            slot.status = "stopping"
            _signal(slot, signal.SIGKILL if self._force.is_set() else signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        killed = self._force.is_set()
        for slot in group:
            assert slot.proc is not None
            while slot.proc.poll() is None:
                if not killed and (self._force.is_set() or time.monotonic() > deadline):
                    for other in group:
                        _signal(other, signal.SIGKILL)
                    killed = True
                time.sleep(0.05)
            self.console.print(f"  stopped {slot.name:<11} (exit {slot.proc.returncode})")
            slot.status = "stopped"
        if group:
            self._write_files()


def _signal(slot: Slot, sig: int) -> None:
    if slot.proc is not None and slot.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            slot.proc.send_signal(sig)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _indent(text: str, n: int) -> str:
    return "\n".join(" " * n + line for line in text.splitlines())


def registry_keys(endpoints: Sequence[str], cluster: str, delete: bool = False) -> list[str]:
    """The keys under the cluster's registry prefix (deleted first when `delete`: returns what was there)."""
    return asyncio.run(_registry_keys(endpoints, cluster, delete))


async def _registry_keys(endpoints: Sequence[str], cluster: str, delete: bool) -> list[str]:
    import aetcd

    host, port = parse_endpoint(endpoints[0])
    prefix = cluster_prefix(cluster).encode()
    client = aetcd.Client(host=host, port=port, timeout=5)
    try:
        found = [kv.key.decode() for kv in await client.get_prefix(prefix, keys_only=True)]
        if delete and found:
            await client.delete_prefix(prefix)
        return found
    finally:
        await client.close()


def _empty_registry(endpoints: Sequence[str], cluster: str) -> list[str]:
    try:
        return registry_keys(endpoints, cluster, delete=True)
    except Exception as err:  # etcd is about to go anyway; say why the check could not run
        return [f"(registry check failed: {type(err).__name__}: {err})"]


def build_config(args: Any, resolve_model: Callable[[str | None], ResolvedModel]) -> LauncherConfig:
    """The LauncherConfig from `pdserve up` flags. `resolve_model(args.model)` turns the --model value into
    a directory and a served name (`engine.default_model.resolve_model`: fetches the default model
    before anything starts); --model-name overrides the name."""
    model = resolve_model(args.model)
    return LauncherConfig(
        model=str(model.path), model_name=args.model_name or model.name, num_prefill=args.prefill,
        num_decode=args.decode, host=args.host, port=args.port, dtype=args.dtype, kv_memory_mib=args.kv_memory,
        num_threads=args.num_threads, cluster=args.cluster,
        runs_dir=Path(args.runs_dir) if args.runs_dir else default_runs_dir(), lease_ttl_s=args.lease_ttl,
        drain_timeout_s=args.drain_timeout, restart=not args.no_restart,
        node_args=tuple(args.node_arg or ()), frontend_args=tuple(args.frontend_arg or ()),
    )
