"""A real local cluster for tests and benchmarks: one etcd server plus prefill and decode node processes on
free loopback ports, a gRPC client, and teardown that kills every process it started.

    with LocalCluster(tmp_path, model_dir) as cluster:
        cluster.start(num_prefill=2, num_decode=2)
        result = cluster.generate("d0", prompt_ids, SamplingParams(max_tokens=8))
        cluster.wait_clean()          # every node: no request in flight, zero used KV blocks
        cluster.check_integrity()     # every node: blocks, requests, streams and reservations agree

Nodes print one ready line (see `node_common.ready`) once they serve and are registered; the
harness reads it to learn each node's ports. Node logs go to `<workdir>/<node_id>.log`.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node_common.convert import params_to_proto
from pdserve.node_common.ready import parse_ready_line
from pdserve.registry import EtcdServer, Member, RegistryView
from pdserve.rpc import RpcSecurity
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as pb_grpc
from pdserve.rpc.enums import finish_reason_name
from testing.waits import wait_until

if TYPE_CHECKING:
    from testing.faults import FaultSpec

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(eq=False)
class NodeProcess:
    """One node process the harness started."""

    role: str
    node_id: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready: threading.Event = field(default_factory=threading.Event)
    info: dict[str, object] = field(default_factory=dict)  # the node's ready line

    @property
    def grpc_address(self) -> str:
        return str(self.info["grpc_address"])

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass(frozen=True)
class GenerateResult:
    """What one Generate stream delivered."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    error: str
    messages: list[pb.GenerateResponse]
    ttft_s: float  # request sent -> first message with a token
    prefill_node_id: str
    num_cached_tokens: int


class LocalCluster:
    """Owns an etcd server and node processes; `close()` kills every one of them."""

    def __init__(
        self,
        workdir: Path,
        model_dir: Path | str,
        *,
        cluster: str = "test",
        lease_ttl_s: int = 3,
        node_args: Sequence[str] = (),
        python: str = sys.executable,
        rpc: RpcSecurity | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.rpc = rpc or RpcSecurity.from_env()  # what this client's channels to the nodes present
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model_dir = str(model_dir)
        self.cluster = cluster
        self.lease_ttl_s = lease_ttl_s
        self.node_args = list(node_args)
        self.python = python
        self.etcd: EtcdServer | None = None
        self.nodes: dict[str, NodeProcess] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._stopped: set[str] = set()  # nodes sent SIGSTOP (and no SIGCONT since)

    # -- processes ------------------------------------------------------------------------------------

    def start_etcd(self) -> EtcdServer:
        if self.etcd is None:
            self.etcd = EtcdServer(self.workdir / "etcd", log_level="warn")
        self.etcd.start()
        return self.etcd

    @property
    def etcd_endpoints(self) -> list[str]:
        assert self.etcd is not None, "etcd is not started"
        return self.etcd.endpoints

    def node_command(self, role: str, node_id: str, extra: Sequence[str] = (), etcd: str | None = None) -> list[str]:
        return [
            self.python, "-m", f"pdserve.{role}_node", "--node-id", node_id, "--cluster", self.cluster,
            "--etcd", etcd or ",".join(self.etcd_endpoints), "--model", self.model_dir,
            # float32 unless a test asks otherwise: the references are fp32 engines and transformers
            "--lease-ttl", str(self.lease_ttl_s), "--dtype", "float32", *self.node_args, *extra,
        ]

    def spawn_node(
        self, role: str, node_id: str, extra: Sequence[str] = (), *, prefix: Sequence[str] = (),
        etcd: str | None = None, faults: FaultSpec | None = None,
    ) -> NodeProcess:
        """Starts a node process without waiting for it (see `wait_ready`), with the fault hook `faults`
        (`testing.faults`) if given."""
        if node_id in self.nodes and self.nodes[node_id].alive:
            raise ValueError(f"node {node_id} is already running")
        log_path = self.workdir / f"{node_id}.log"
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if faults is not None:
            env.update(faults.env())
            extra = [*extra, *faults.node_args()]
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(
                [*prefix, *self.node_command(role, node_id, extra, etcd)], cwd=REPO_ROOT, env=env,
                stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL,
            )
        node = NodeProcess(role, node_id, proc, log_path)
        self.nodes[node_id] = node
        threading.Thread(target=self._read_stdout, args=(node,), daemon=True).start()
        return node

    @staticmethod
    def _read_stdout(node: NodeProcess) -> None:
        assert node.proc.stdout is not None
        for raw in node.proc.stdout:
            info = parse_ready_line(raw.decode(errors="replace"))
            if info is not None:
                node.info = info
                node.ready.set()

    def wait_ready(self, nodes: Iterable[NodeProcess], timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        for node in nodes:
            while not node.ready.wait(0.1):
                if not node.alive:
                    raise RuntimeError(
                        f"node {node.node_id} exited with {node.proc.returncode}:\n{node.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node {node.node_id} not ready after {timeout_s}s:\n{node.log_tail()}")

    def start(
        self, num_prefill: int, num_decode: int, *, prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
    ) -> None:
        """Starts etcd and the nodes p0.. and d0.. (in parallel), returning once all are ready."""
        self.start_etcd()
        started = [self.spawn_node("prefill", f"p{i}", prefill_args) for i in range(num_prefill)]
        started += [self.spawn_node("decode", f"d{i}", decode_args) for i in range(num_decode)]
        self.wait_ready(started)
        # Ready means registered; a node learns of its peers through its registry watch a moment later,
        # so a request sent at once could find its decode node not yet knowing the prefill nodes.
        ids = {n.node_id for n in started}
        self.wait_registry(lambda m: ids <= m.keys(), timeout_s=30, what="every node in the registry")
        for node_id in sorted(ids):  # each node's own view (GetLoad's members), which its registry watch fills
            wait_until(lambda n=node_id: ids <= set(self.get_load(n).members), 30, f"node {node_id} seeing every node")

    def is_stopped(self, node_id: str) -> bool:
        """Whether the node was sent SIGSTOP (and no SIGCONT since)."""
        return node_id in self._stopped

    def kill(self, node_id: str, sig: int = signal.SIGKILL) -> None:
        node = self.nodes[node_id]
        if node.alive:
            node.proc.send_signal(sig)
        if sig == signal.SIGSTOP:
            self._stopped.add(node_id)
        elif sig == signal.SIGCONT:
            self._stopped.discard(node_id)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            node.proc.wait(timeout=30)
        channel = self._channels.pop(node_id, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        """Stops every node (SIGTERM, then SIGKILL after a grace period) and etcd."""
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
        for node in self.nodes.values():
            if node.alive:
                with_suppressed(lambda n=node: n.proc.send_signal(signal.SIGCONT))
                with_suppressed(lambda n=node: n.proc.terminate())
        deadline = time.monotonic() + 10.0
        for node in self.nodes.values():
            try:
                node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait(timeout=10)
        if self.etcd is not None:
            self.etcd.close()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- clients --------------------------------------------------------------------------------------

    def channel(self, node_id: str) -> grpc.Channel:
        channel = self._channels.get(node_id)
        if channel is None:
            channel = self.rpc.channel(self.nodes[node_id].grpc_address)
            self._channels[node_id] = channel
        return channel

    def decode_stub(self, node_id: str) -> pb_grpc.DecodeNodeStub:
        return pb_grpc.DecodeNodeStub(self.channel(node_id))

    def prefill_stub(self, node_id: str) -> pb_grpc.PrefillNodeStub:
        return pb_grpc.PrefillNodeStub(self.channel(node_id))

    def get_load(self, node_id: str) -> pb.LoadResponse:
        node = self.nodes[node_id]
        if node.role == "decode":
            return self.decode_stub(node_id).GetLoad(pb.LoadRequest(), timeout=10)
        return self.prefill_stub(node_id).GetLoad(pb.LoadRequest(), timeout=10)

    def generate(
        self, decode_id: str, prompt: list[int], params: SamplingParams, *, request_id: str = "",
        prefill_node_id: str = "", force_local_prefill: bool = False, return_text: bool = True,
        timeout_s: float = 120.0, resume_token_ids: Sequence[int] = (), resume_text_chars: int = 0,
    ) -> GenerateResult:
        request = pb.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, params=params_to_proto(params),
            prefill_node_id=prefill_node_id, force_local_prefill=force_local_prefill, return_text=return_text,
            resume_token_ids=resume_token_ids, resume_text_chars=resume_text_chars,
        )
        start = time.monotonic()
        messages: list[pb.GenerateResponse] = []
        ttft = 0.0
        for msg in self.decode_stub(decode_id).Generate(request, timeout=timeout_s):
            if not ttft and msg.token_ids:
                ttft = time.monotonic() - start
            messages.append(msg)
        last = messages[-1]
        return GenerateResult(
            request_id=last.request_id, token_ids=[t for m in messages for t in m.token_ids],
            text="".join(m.text for m in messages), finish_reason=finish_reason_name(last.finish_reason) or "", error=last.error,
            messages=messages, ttft_s=ttft, prefill_node_id=messages[0].prefill_node_id,
            num_cached_tokens=max(m.num_cached_tokens for m in messages),
        )

    def metric(self, node_id: str, sample: str, **labels: str) -> float:
        """The sum of a node's /metrics samples named `sample` whose labels include `labels`."""
        address = self.nodes[node_id].info["metrics_address"]
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return sum(
            s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == sample and all(s.labels.get(k) == want for k, want in labels.items())
        )

    # -- accounting -----------------------------------------------------------------------------------

    def wait_clean(self, node_ids: Iterable[str] | None = None, timeout_s: float = 30.0) -> dict[str, pb.LoadResponse]:
        """Waits until every (live) node has no request in flight and zero used KV blocks (evictable
        prefix-cache blocks are free), then checks their integrity; returns the loads. Raises
        AssertionError with the last loads."""
        ids = [n for n in (node_ids or self.nodes) if self.nodes[n].alive]
        deadline = time.monotonic() + timeout_s
        while True:
            loads = {n: self.get_load(n) for n in ids}
            if all(_clean(load) for load in loads.values()):
                self.check_integrity(ids)
                return loads
            if time.monotonic() > deadline:
                raise AssertionError(f"nodes not clean after {timeout_s}s: {loads}")
            time.sleep(0.05)  # the poll interval

    def check_integrity(self, node_ids: Iterable[str] | None = None, timeout_s: float = 10.0) -> None:
        """Runs NodeControl/CheckIntegrity on every live, running node: its KV blocks, engine requests,
        output streams, reservations, metric records and request objects agree (`NodeService.check_integrity`).
        Raises AssertionError naming each node that disagrees and why."""
        ids = [n for n in (node_ids or self.nodes) if self.nodes[n].alive and n not in self._stopped]
        problems = {}
        for n in ids:
            report = pb_grpc.NodeControlStub(self.channel(n)).CheckIntegrity(pb.IntegrityRequest(), timeout=timeout_s)
            if not report.ok:
                problems[n] = report.problem
        assert not problems, f"node integrity: {problems}"

    def registry_members(self, timeout_s: float = 10.0) -> dict[str, Member]:
        """The cluster's registry membership as a fresh view sees it (its event loop in a thread of its own
        when this thread already runs one, as under Playwright's sync API)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self._members(timeout_s))
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(lambda: asyncio.run(self._members(timeout_s))).result()

    async def _members(self, timeout_s: float) -> dict[str, Member]:
        view = RegistryView(self.etcd_endpoints, self.cluster)
        await view.start(sync_timeout_s=timeout_s)
        try:
            return view.snapshot()
        finally:
            await view.close()

    def wait_registry(
        self, predicate: Callable[[dict[str, Member]], bool], timeout_s: float, what: str
    ) -> dict[str, Member]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                members = self.registry_members()
            except ConnectionError:
                members = {}
            if predicate(members):
                return members
            if time.monotonic() > deadline:
                raise AssertionError(f"registry: {what} not reached after {timeout_s}s: {sorted(members)}")
            time.sleep(0.2)  # the poll interval


def _clean(load: pb.LoadResponse) -> bool:
    return (
        load.kv_blocks_used == 0 and load.in_flight == 0 and load.running == 0 and load.waiting == 0
        and load.kv_blocks_held_for_transfer == 0 and load.kv_blocks_reserved == 0 and load.reservation_queue == 0
    )


def with_suppressed(fn: Callable[[], object]) -> None:
    """Runs fn, ignoring a process that is already gone."""
    try:
        fn()
    except (ProcessLookupError, OSError):
        pass


def random_prompt(n: int, seed: int, high: int = 4000) -> list[int]:
    """`n` token ids in [5, high) drawn from `seed`: a fresh prompt no prefix cache holds."""
    rng = random.Random(seed)
    return [rng.randrange(5, high) for _ in range(n)]


def reference_engine(model_dir: Path | str, num_kv_blocks: int = 512) -> LLMEngine:
    """The single-process fp32 engine whose greedy tokens the cluster tests compare against."""
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=num_kv_blocks, num_threads=1))
