"""`pdserve up` as a real subprocess, for tests and benchmarks: start it, read what it prints, run
`pdserve status`, press Ctrl-C, and find every process it started (their command lines carry the
cluster's unique name), so that teardown leaves none behind even when a test fails half-way.

    up = UpCluster.start(tmp_path)
    ...                             # up.base_url serves the OpenAI API
    assert up.interrupt() == 0      # Ctrl-C: the launcher stops everything in order
    up.close()                      # kills whatever is still running (nothing, normally)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.registry.etcd_server import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(eq=False)
class UpCluster:
    """One `pdserve up` process and the files it writes."""

    proc: subprocess.Popen[bytes]
    runs_dir: Path
    cluster: str
    port: int
    stdout_path: Path
    stderr_path: Path

    @classmethod
    def start(cls, workdir: Path, extra: Sequence[str] = (), timeout_s: float = 240.0,
              env: dict[str, str] | None = None) -> UpCluster:
        """Runs `pdserve up` on a free port with a unique cluster name (and `env` added to its
        environment, which its processes inherit); returns once it printed its banner. Raises
        RuntimeError (with its output) if it exits or takes longer."""
        cluster = f"up-{uuid.uuid4().hex[:8]}"
        port = free_port()
        runs_dir = workdir / "runs"
        stdout_path, stderr_path = workdir / "up.stdout", workdir / "up.stderr"
        argv = [sys.executable, "-m", "pdserve.deploy", "up", "--port", str(port), "--cluster", cluster,
                "--runs-dir", str(runs_dir), *extra]
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            # A session of its own, like a shell job: Ctrl-C (SIGINT to its process group) reaches it alone.
            proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, env=dict(os.environ, COLUMNS="200", **(env or {})))
        up = cls(proc, runs_dir, cluster, port, stdout_path, stderr_path)
        try:
            up.wait_for("pdserve is up", timeout_s, stream="stdout")
        except BaseException:
            up.close()
            raise
        return up

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cluster_dir(self) -> Path:
        return self.runs_dir / self.cluster

    def stdout(self) -> str:
        return self.stdout_path.read_text(encoding="utf-8", errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(encoding="utf-8", errors="replace")

    def wait_for(self, text: str, timeout_s: float, stream: str = "stderr", count: int = 1) -> None:
        """Waits until `text` appears `count` times in the launcher's stdout or stderr."""
        read = self.stdout if stream == "stdout" else self.stderr
        deadline = time.monotonic() + timeout_s
        while read().count(text) < count:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve up exited with {self.proc.returncode} before {text!r}:\n"
                                   f"{self.stdout()[-3000:]}\n{self.stderr()[-5000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {text!r} after {timeout_s}s:\n{self.stdout()[-3000:]}\n{self.stderr()[-5000:]}")
            time.sleep(0.1)  # the poll interval

    def state(self) -> dict[str, Any]:
        """The launcher's cluster.json."""
        return dict(json.loads((self.cluster_dir / "cluster.json").read_text(encoding="utf-8")))

    def targets(self) -> list[dict[str, Any]]:
        return list(json.loads((self.cluster_dir / "prometheus_targets.json").read_text(encoding="utf-8")))

    def status(self, *flags: str) -> subprocess.CompletedProcess[str]:
        """`pdserve status` for this cluster (the launcher's state file tells it where etcd is)."""
        return subprocess.run(
            [sys.executable, "-m", "pdserve.deploy", "status", "--cluster", self.cluster, "--runs-dir", str(self.runs_dir),
             *flags], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        )

    def status_json(self) -> dict[str, Any]:
        result = self.status("--json")
        if result.returncode != 0:
            raise RuntimeError(f"pdserve status failed: {result.stderr}")
        return dict(json.loads(result.stdout))

    def nodes(self) -> dict[str, dict[str, Any]]:
        """The launcher's live node processes by name (cluster.json: pool, pid, grpc, metrics)."""
        return {p["name"]: p for p in self.state()["processes"]
                if p["pool"] in ("prefill", "decode") and p["pid"] and p.get("grpc")}

    def _loads(self, names: list[str]) -> dict[str, Any]:
        from pdserve.rpc import RpcSecurity
        from pdserve.rpc import pdserve_pb2 as pb
        from pdserve.rpc import pdserve_pb2_grpc as pb_grpc

        nodes, out = self.nodes(), {}
        for name in names:
            with RpcSecurity.from_env().channel(nodes[name]["grpc"]) as channel:
                stub = (pb_grpc.DecodeNodeStub if nodes[name]["pool"] == "decode" else pb_grpc.PrefillNodeStub)(channel)
                out[name] = stub.GetLoad(pb.LoadRequest(), timeout=10)
        return out

    def check_integrity(self) -> None:
        """NodeControl/CheckIntegrity on every live node of the cluster (testing.cluster.LocalCluster's
        check: KV blocks, engine requests, streams, reservations agree). Raises AssertionError."""
        from pdserve.rpc import RpcSecurity
        from pdserve.rpc import pdserve_pb2 as pb
        from pdserve.rpc import pdserve_pb2_grpc as pb_grpc

        problems = {}
        for name, node in self.nodes().items():
            with RpcSecurity.from_env().channel(node["grpc"]) as channel:
                report = pb_grpc.NodeControlStub(channel).CheckIntegrity(pb.IntegrityRequest(), timeout=10)
            if not report.ok:
                problems[name] = report.problem
        assert not problems, f"node integrity: {problems}"

    def wait_clean(self, timeout_s: float = 30.0) -> None:
        """Waits until every live node has no request in flight and zero used KV blocks, then checks their
        integrity (testing.cluster.LocalCluster.wait_clean for `pdserve up`'s nodes)."""
        from testing.cluster import _clean

        deadline = time.monotonic() + timeout_s
        while True:
            loads = self._loads(list(self.nodes()))
            if all(_clean(load) for load in loads.values()):
                self.check_integrity()
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"nodes not clean after {timeout_s}s: {loads}")
            time.sleep(0.05)  # the poll interval

    def interrupt(self, timeout_s: float = 120.0) -> int:
        """Ctrl-C: SIGINT to the launcher's process group; returns its exit code."""
        os.killpg(self.proc.pid, signal.SIGINT)
        return self.proc.wait(timeout=timeout_s)

    def processes(self) -> dict[int, str]:
        """pid -> command line of every live process this cluster started (the launcher included)."""
        found: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                raw = (entry / "cmdline").read_bytes()
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if stat.rsplit(")", 1)[-1].split()[0] == "Z":
                continue  # a zombie has exited; its parent just has not reaped it yet
            cmdline = raw.replace(b"\0", b" ").decode(errors="replace")
            if self.cluster in cmdline and "deploy status" not in cmdline:
                found[int(entry.name)] = cmdline
        return found

    def close(self) -> None:
        """Stops the launcher if it still runs, then kills any process of this cluster left over."""
        if self.proc.poll() is None:
            try:
                self.interrupt(timeout_s=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
