"""The `Launcher`: starts the processes of one local cluster in order, supervises them (restarts with
backoff, keeps the Prometheus targets and cluster.json current) and stops them in order."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live

from pdserve.deploy.launcher.config import ClusterState, LauncherConfig, write_json_atomic
from pdserve.deploy.launcher.display import endpoint, print_banner, progress_table
from pdserve.deploy.launcher.process import Slot, StartupError, command, http_ok, send_signal, spawn
from pdserve.deploy.launcher.shutdown import STOP_ORDER, empty_registry, stop_grace_s, stop_group
from pdserve.registry.etcd_server import free_port
from pdserve.rpc import TOKEN_ENV

if TYPE_CHECKING:
    from pdserve.deploy.launcher.autoscaling import Autoscaler
    from pdserve.planner.sim import Shape

_POLL_S = 0.2
_BACKOFF_MAX_S = 30.0
_STABLE_S = 60.0  # a process that ran this long before dying restarts after the shortest backoff


def omp_wait_policy(pinned: bool) -> dict[str, str]:
    """Unpinned nodes share cores: an OpenMP thread spinning at a barrier then burns the core another
    node's thread needs (one stream on 2 shared cores measured 17x slower with libgomp's default spin), so
    their threads sleep at once. Pinned nodes own their cores and keep the spin. An operator's own
    OMP_WAIT_POLICY wins."""
    if pinned or "OMP_WAIT_POLICY" in os.environ:
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


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
        # Every process of the cluster authenticates its internal gRPC calls with this token: the
        # caller's $PDSERVE_CLUSTER_TOKEN, else a fresh one (kept in token_path for `pdserve drain`).
        self._cluster_token = os.environ.get(TOKEN_ENV, "").strip() or secrets.token_urlsafe(24)
        self.token_path = config.cluster_dir / "cluster-token"
        # --autoscale: the controller's thread reads the slots and asks for a shape under this lock; only
        # the supervising thread starts, drains and removes slots.
        self.lock = threading.RLock()
        self.wanted_shape: Shape | None = None
        self._next_index = {"prefill": config.num_prefill, "decode": config.num_decode}
        self.autoscaler: Autoscaler | None = None

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
            print_banner(self.out, self.config, self.slots, self.etcd_endpoints, self.logs_dir)
            if self.autoscaler is not None:
                self.autoscaler.start(self.config.host)
                a = self.autoscaler.config
                self.out.print(f"autoscale: on, node budget {a.node_budget}, SLOs "
                               f"{', '.join(f'{x.name}<={1000 * x.threshold_s:g}ms' for x in a.slos)}, every "
                               f"{a.interval_s:g}s over {a.window_s:g}s, cooldown {a.cooldown_s:g}s; its metrics "
                               f"on http://{self.config.host}:{self.autoscaler.metrics_port}/metrics")
                self._write_files()
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
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self._cluster_token + "\n")
        # The registry of a local cluster lives as long as the cluster: a new `up` starts from an empty one
        # (and from fresh ports, so that a port taken since the last run is no obstacle).
        etcd_dir = cfg.cluster_dir / "etcd"
        shutil.rmtree(etcd_dir / "data", ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (etcd_dir / "ports.json").unlink()
        if cfg.autoscale is not None:
            from pdserve.deploy.launcher.autoscaling import Autoscaler

            try:
                self.autoscaler = Autoscaler(self, cfg.autoscale, free_port(cfg.host))
            except (ValueError, OSError) as err:
                raise StartupError(f"--autoscale: {err}") from err
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

    @property
    def etcd_endpoints(self) -> list[str]:
        return list(self._etcd_endpoints)

    def _spawn(self, slot: Slot) -> None:
        spawn(slot, self.config.node_threads(slot.name), lambda s: command(self.config, s, self.etcd_endpoints, self.logs_dir),
              {TOKEN_ENV: self._cluster_token, **omp_wait_policy(self.config.pin)})

    def _check_ready(self, slot: Slot) -> bool:
        if slot.ready or not slot.alive:
            return slot.ready
        if slot.pool == "frontend":
            ok = http_ok(f"http://{self.config.host}:{self.config.port}/ready")
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
        with Live(progress_table(self.slots, what), console=self.console, refresh_per_second=4, transient=True) as live:
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
                live.update(progress_table(self.slots, what))
                time.sleep(_POLL_S)
        for slot in slots:
            self.console.print(f"  [green]ready[/green] {slot.name:<11} pid {slot.pid}  {endpoint(self.config, slot, self.etcd_endpoints)}")

    # -- supervise ------------------------------------------------------------------------------------

    def _supervise(self) -> None:
        while not self._stop.wait(_POLL_S):
            self._reshape()
            with self.lock:
                slots = list(self.slots)
            for slot in slots:
                self._tend(slot)

    # -- autoscaling ----------------------------------------------------------------------------------

    def _reshape(self) -> None:
        """Starts and drains nodes toward the shape the autoscaler asked for (the newest nodes drain first)."""
        with self.lock:
            want, self.wanted_shape = self.wanted_shape, None
        if want is None:
            return
        for pool, count in (("prefill", want.prefill), ("decode", want.decode)):
            live = [s for s in self.slots if s.pool == pool and not s.retiring]
            for _ in range(count - len(live)):
                self._add_node(pool)
            for slot in sorted(live, key=lambda s: int(s.name.rsplit("-", 1)[1]), reverse=True)[:max(0, len(live) - count)]:
                self._retire(slot)
        self._write_files()

    def _add_node(self, pool: str) -> None:
        index = self._next_index[pool]
        self._next_index[pool] += 1
        slot = Slot(f"{pool}-{index}", pool, self.logs_dir / f"{pool}-{index}.log")
        with self.lock:
            self.slots.insert(len(self.slots) - 1, slot)  # the frontend stays last
        self._spawn(slot)
        self.console.print(f"  starting {slot.name} (pid {slot.proc.pid if slot.proc else '-'}) for the autoscaler")

    def _retire(self, slot: Slot) -> None:
        """Drains the node for good: SIGTERM (it leaves the registry, finishes or hands over its requests and
        exits); `_tend` removes the slot once it has exited, or kills it past its stop grace."""
        with self.lock:
            slot.retiring = True
        slot.restart_at = None
        slot.status = "draining"
        slot.retire_deadline = time.monotonic() + stop_grace_s(slot.pool, self.config.drain_timeout_s)
        send_signal(slot, signal.SIGTERM)
        self.console.print(f"  draining {slot.name} (pid {slot.pid}) for the autoscaler")

    def _tend_retiring(self, slot: Slot) -> None:
        if slot.alive:
            if time.monotonic() > slot.retire_deadline:
                send_signal(slot, signal.SIGKILL)
            return
        code = slot.proc.returncode if slot.proc is not None else None
        with self.lock:
            self.slots.remove(slot)
        self.console.print(f"  drained {slot.name} (exit {code})")
        self._write_files()

    # -- supervise ------------------------------------------------------------------------------------

    def _tend(self, slot: Slot) -> None:
        """Notices a death (reports it, schedules a restart), restarts when due, and notices readiness."""
        now = time.monotonic()
        if slot.retiring:
            self._tend_retiring(slot)
        elif slot.proc is not None and not slot.alive and slot.restart_at is None:
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
            if slot.starts == 1:
                self.console.print(f"  [green]ready[/green] {slot.name:<11} pid {slot.pid}  "
                                   f"{endpoint(self.config, slot, self.etcd_endpoints)}")
            else:
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
        if self.autoscaler is not None and self.autoscaler.running:
            groups.append({"targets": [f"{self.config.host}:{self.autoscaler.metrics_port}"],
                           "labels": {"cluster": self.config.cluster, "pool": "autoscaler", "node": "autoscaler"}})
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
        if self.autoscaler is not None:
            self.autoscaler.stop()
        for pool in STOP_ORDER:
            group = [s for s in self.slots if s.pool == pool]
            if group:
                self._stop_group(group, stop_grace_s(pool, self.config.drain_timeout_s))
        etcd = self.slots[0]
        if etcd.alive and self.etcd_endpoints:
            leftovers = empty_registry(self.etcd_endpoints, self.config.cluster)
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


    def _stop_group(self, group: list[Slot], grace_s: float) -> None:
        if stop_group(group, grace_s, self._force, self.console):
            self._write_files()
