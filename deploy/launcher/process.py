"""The processes of `pdserve up`: one `Slot` each (restarted in place), their command lines, their start
(each in a session of its own, output appended to its log) and the reader that takes a node's ready line
or etcd's endpoints from its stdout."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.deploy.launcher.config import REPO_ROOT, LauncherConfig
from pdserve.node_common.pinning import format_cpus
from pdserve.node_common.ready import READY_PREFIX
from pdserve.registry.etcd_server import free_port


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
    retiring: bool = False  # being drained for good (autoscaling): removed once it exits, never restarted
    retire_deadline: float = 0.0  # monotonic time past which a draining process is killed

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


def command(cfg: LauncherConfig, slot: Slot, etcd_endpoints: Sequence[str], logs_dir: Path) -> list[str]:
    """The command line of the slot's process."""
    py = [cfg.python, "-m"]
    if slot.pool == "etcd":
        return [*py, "pdserve.registry.etcd_server", "--data-dir", str(cfg.cluster_dir / "etcd")]
    etcd = ",".join(etcd_endpoints)
    tracing = ["--trace-sample-ratio", str(cfg.trace_sample_ratio)]
    if cfg.otlp_endpoint:
        tracing += ["--otlp-endpoint", cfg.otlp_endpoint]
    if slot.pool == "frontend":
        return [
            *py, "pdserve.frontend", "--etcd", etcd, "--cluster", cfg.cluster, "--host", cfg.host, "--port", str(cfg.port),
            "--model", f"{cfg.model_name}={cfg.model}", "--frontend-id", slot.name,
            "--request-log", str(logs_dir / "requests.log"),
            "--response-store", f"sqlite:///{(cfg.cluster_dir / 'responses.db').resolve()}", *tracing,
            *(["--limits-redis", cfg.limits_redis] if cfg.limits_redis else []), *cfg.frontend_args,
        ]
    cpus = cfg.node_cpus().get(slot.name, ())
    pinning = ["--cpus", format_cpus(cpus)] if cpus else []
    return [
        *py, f"pdserve.{slot.pool}_node", "--node-id", slot.name, "--cluster", cfg.cluster, "--etcd", etcd,
        "--model", cfg.model, "--model-name", cfg.model_name, "--dtype", cfg.dtype, *pinning,
        "--kv-cache-memory-mib", str(cfg.kv_memory_mib), "--kv-cache-dtype", cfg.kv_cache_dtype,
        "--speculative", cfg.speculative, "--num-speculative-tokens", str(cfg.num_speculative_tokens),
        "--num-threads", str(cfg.node_threads(slot.name)), "--tensor-parallel-size", str(cfg.node_tp(slot.name)),
        "--lease-ttl", str(cfg.lease_ttl_s), "--drain-timeout", str(cfg.drain_timeout_s),
        "--metrics-host", "127.0.0.1", "--metrics-port", str(slot.metrics_port), *tracing,
        *(["--colocated"] if slot.pool == "decode" and cfg.num_prefill == 0 else []),
        *(["--max-prefill-queue-tokens", str(cfg.decode_max_prefill_queue_tokens)] if slot.pool == "decode" else []),
        *(["--kv-tier-dir", str((cfg.cluster_dir / "kv-tier" / slot.name).resolve()), "--kv-tier-gib",
           f"{cfg.kv_tier_gib:g}"] if cfg.kv_tier_gib > 0 else []),
        *cfg.node_args,
    ]


def spawn(slot: Slot, num_threads: int, command: Callable[[Slot], list[str]], env_extra: Mapping[str, str]) -> None:
    """Starts (or restarts) the slot's process (`command(slot)`, after the slot's metrics port is chosen,
    with `env_extra` in its environment); its output is appended to its log."""
    if slot.pool in ("prefill", "decode") and (slot.metrics_port == 0 or not slot.was_ready):
        # Kept across restarts so the Prometheus target stays put; picked anew after a failed start.
        slot.metrics_port = free_port("127.0.0.1")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(num_threads), **env_extra)
    slot.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(slot.log_path, "ab") as log:
        log.write(f"\n=== pdserve up: starting {slot.name} (start #{slot.starts + 1})\n".encode())
        log.flush()
        reads_stdout = slot.pool != "frontend"
        slot.proc = subprocess.Popen(
            command(slot), cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if reads_stdout else log, stderr=log, start_new_session=True,
        )
    slot.starts += 1
    slot.started_at = time.monotonic()
    slot.info = {}
    slot.ready = False
    slot.restart_at = None
    slot.status = "starting"
    if reads_stdout:
        threading.Thread(target=read_stdout, args=(slot, slot.proc), daemon=True,
                         name=f"stdout-{slot.name}").start()


def read_stdout(slot: Slot, proc: subprocess.Popen[bytes]) -> None:
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


def send_signal(slot: Slot, sig: int) -> None:
    if slot.proc is not None and slot.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            slot.proc.send_signal(sig)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False
