"""What both node servers share on the control plane: message conversion, the common part of their
configuration and command line, and the serving lifecycle (engine thread, KV channel manager, gRPC
server, registry view and registration, /metrics, gRPC health, drain, clean shutdown).

A node prints exactly one line to stdout once it serves and is registered:
``PDSERVE_READY {"node_id": ..., "role": ..., "grpc_address": ..., "kv_address": ...,
"metrics_address": ..., "pid": ...}``; launchers and the test harness read it to learn the ports the node
picked. Logs go to stderr. A node refused by its pool (e.g. a model fingerprint that disagrees) exits
with EXIT_REFUSED.

Health (grpc.health.v1 on the gRPC port): the overall status ``""`` is SERVING while the server runs; the
node's own service (``pdserve.v1.PrefillNode`` / ``pdserve.v1.DecodeNode``) is SERVING only while the
node is registered and takes new work.

Drain (SIGTERM, SIGINT, or the ``pdserve.v1.NodeControl/Drain`` call of ``pdserve drain``): the node turns
NOT_SERVING, stops taking new work (UNAVAILABLE), waits until no request depends on a peer seeing it in
the registry, revokes its lease, and lets the requests it still runs finish, all within
``--drain-timeout``. After a signal the node then exits; after a Drain call it idles until signalled. A
second signal skips what is left of the drain.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import disable_created_metrics

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import EngineLoad
from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprob
from kv_transfer import ChannelConfig, ChannelManager
from node.metrics import EngineGauges, MetricLabels, MetricsServer, NodeMetrics, ObservedEngine
from node.ready import EXIT_REFUSED, EXIT_UNAVAILABLE, ready_line
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from registry import (
    NodeCapacity,
    NodeLoad,
    NodeRecord,
    NodeRegistration,
    RegistrationRefused,
    RegistryUnavailable,
    RegistryView,
    ViewChange,
)

log = logging.getLogger(__name__)


GRPC_OPTIONS = (
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),
)

# `pdserve drain` calls this method: request LoadRequest, response LoadResponse (the node's load once the
# drain ended or the call's deadline came).


# ---------------------------------------------------------------------------------------- messages


def params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError for out-of-range values (SamplingParams validates)."""
    return SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p if p.top_p > 0 else 1.0,
        top_k=p.top_k if p.top_k > 0 else -1,
        seed=p.seed if p.HasField("seed") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty > 0 else 1.0,
        max_tokens=p.max_tokens if p.max_tokens > 0 else 16,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
    )


def params_to_proto(sp: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k if sp.top_k > 0 else 0,
        presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty, max_tokens=sp.max_tokens, stop=sp.stop,
        stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
    )
    if sp.seed is not None:
        msg.seed = sp.seed
    if sp.logprobs is not None:
        msg.logprobs = sp.logprobs
    return msg


def logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top_token_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top],
    )


def logprob_from_proto(p: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(p.token_id, p.logprob, list(zip(p.top_token_ids, p.top_logprobs, strict=True)))


# ---------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class NodeConfig:
    """Fields every node process has; `PrefillNodeConfig` / `DecodeNodeConfig` add their own."""

    node_id: str
    cluster: str
    etcd_endpoints: tuple[str, ...]
    engine: EngineConfig
    model_name: str = ""  # the pool's model name; "" = the model directory's name
    grpc_host: str = "127.0.0.1"  # address the gRPC server binds
    grpc_port: int = 0  # 0 picks a free port (reported in the ready line and the registry)
    advertise_host: str = ""  # host others use to reach this node's gRPC server; "" = grpc_host
    kv_host: str = "127.0.0.1"  # KV channel rendezvous (TCPStore) host, also where gloo binds
    kv_port: int = 0
    kv_interface: str | None = None  # bind gloo to this NIC instead of kv_host's
    lease_ttl_s: int = 5  # registry lease: a dead node leaves every view within this
    load_interval_s: float = 1.0
    join_timeout_s: float = 30.0  # how long to wait for etcd at start-up
    transfer_timeout_s: float = 30.0  # last-resort bound on one KV transfer (queue + wire)
    metrics_host: str = "127.0.0.1"  # where /metrics is served
    metrics_port: int = 0  # 0 picks a free port (reported in the ready line)
    drain_timeout_s: float = 30.0  # how long a drain waits for the work in flight before giving up

    def __post_init__(self) -> None:
        checks = [
            (bool(self.node_id) and "/" not in self.node_id, f"bad node_id {self.node_id!r}"),
            (bool(self.cluster) and "/" not in self.cluster, f"bad cluster {self.cluster!r}"),
            (bool(self.etcd_endpoints), "at least one etcd endpoint is required"),
            (all(0 <= p < 65536 for p in (self.grpc_port, self.kv_port, self.metrics_port)),
             "ports must be in [0, 65535]"),
            (self.lease_ttl_s >= 1, "lease_ttl_s must be >= 1"),
            (self.load_interval_s > 0, "load_interval_s must be > 0"),
            (self.join_timeout_s > 0, "join_timeout_s must be > 0"),
            (self.transfer_timeout_s > 0, "transfer_timeout_s must be > 0"),
            (self.drain_timeout_s >= 0, "drain_timeout_s must be >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"{type(self).__name__}: {msg}")
        if not self.model_name:
            object.__setattr__(self, "model_name", Path(self.engine.model).name)

    @property
    def grpc_public_host(self) -> str:
        return self.advertise_host or self.grpc_host


def add_node_args(parser: argparse.ArgumentParser) -> None:
    """The command-line options of `NodeConfig` (and of its EngineConfig)."""
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--cluster", default="default")
    parser.add_argument("--etcd", required=True, help="comma-separated etcd endpoints host:port")
    parser.add_argument("--model", required=True, help="model directory")
    parser.add_argument("--model-name", default="", help="pool model name (default: the directory name)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kernel-backend", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory-mib", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--prefix-hash-seed", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--grpc-host", default="127.0.0.1")
    parser.add_argument("--grpc-port", type=int, default=0)
    parser.add_argument("--advertise-host", default="")
    parser.add_argument("--kv-host", default="127.0.0.1")
    parser.add_argument("--kv-port", type=int, default=0)
    parser.add_argument("--kv-interface", default=None)
    parser.add_argument("--lease-ttl", type=int, default=5)
    parser.add_argument("--load-interval", type=float, default=1.0)
    parser.add_argument("--join-timeout", type=float, default=30.0)
    parser.add_argument("--transfer-timeout", type=float, default=30.0)
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address /metrics is served on")
    parser.add_argument("--metrics-port", type=int, default=0, help="/metrics port (0: a free one)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds a drain (SIGTERM, pdserve drain) waits for requests in flight")
    parser.add_argument("--log-level", default="INFO")


def node_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """`NodeConfig` keyword arguments from parsed `add_node_args` options."""
    engine = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, kernel_backend=args.kernel_backend,
        block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_mib << 20,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, prefix_hash_seed=args.prefix_hash_seed,
        seed=args.seed, num_threads=args.num_threads,
    )
    return dict(
        node_id=args.node_id, cluster=args.cluster,
        etcd_endpoints=tuple(e.strip() for e in args.etcd.split(",") if e.strip()), engine=engine,
        model_name=args.model_name, grpc_host=args.grpc_host, grpc_port=args.grpc_port,
        advertise_host=args.advertise_host, kv_host=args.kv_host, kv_port=args.kv_port,
        kv_interface=args.kv_interface, lease_ttl_s=args.lease_ttl, load_interval_s=args.load_interval,
        join_timeout_s=args.join_timeout, transfer_timeout_s=args.transfer_timeout,
        metrics_host=args.metrics_host, metrics_port=args.metrics_port, drain_timeout_s=args.drain_timeout,
    )


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )


# ---------------------------------------------------------------------------------------- runtime

# The gRPC service each role serves, whose health status says whether the node takes new work.
ROLE_SERVICES = {"prefill": "PrefillNode", "decode": "DecodeNode"}
_POLL_S = 0.05


@dataclass(eq=False)
class NodeContext:
    """What a node's servicer gets from the runtime: all built before the gRPC server starts."""

    config: NodeConfig
    role: str
    engine: AsyncEngine
    channels: ChannelManager
    view: RegistryView
    fingerprint: str
    metrics: NodeMetrics
    record: NodeRecord | None = None  # set once the gRPC port is bound
    background: set[asyncio.Task[None]] = field(default_factory=set)

    def spawn(self, coro: object, name: str) -> asyncio.Task[None]:
        """Runs a background coroutine, keeping a reference until it ends (errors are logged)."""
        task: asyncio.Task[None] = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        task.set_name(name)
        self.background.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self.background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("background task %s failed", name, exc_info=t.exception())

        task.add_done_callback(done)
        return task


class NodeService(ABC):
    """One node kind's servicer logic on top of the shared runtime."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.accepting = True  # False once a drain stops new work: new calls get UNAVAILABLE
        self.draining = False  # published in the load record, so peers stop choosing this node

    @abstractmethod
    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Registers the gRPC service(s) on `server`."""

    @abstractmethod
    def load_extra(self) -> Mapping[str, float]:
        """Role-specific gauges for the registry load record and GetLoad."""

    @abstractmethod
    def on_member_left(self, node_id: str) -> None:
        """A peer's registry lease disappeared (while etcd is reachable): drop what is held for it."""

    @abstractmethod
    async def quiesce(self, deadline: float) -> None:
        """First part of a drain: stops taking new work (sets `accepting` False) and returns once no
        request of this node needs a peer to still see it registered, or at `deadline` (loop time).
        Peers drop the work they share with a node whose lease goes, so the lease waits for this."""

    @abstractmethod
    async def close(self) -> None:
        """Ends every request (freeing its blocks) before the engine stops."""

    def in_flight(self) -> int:
        """Requests this node is serving, at any stage (the drain waits for 0)."""
        return int(self.load_extra().get("in_flight", 0))

    def queued_outside_engine(self) -> int:
        """Requests waiting to enter the engine (e.g. for KV blocks); must be safe from any thread."""
        return 0

    async def refuse_if_draining(self, context: grpc.aio.ServicerContext) -> None:
        """Aborts the call with UNAVAILABLE (callers try another node) once new work is refused."""
        if not self.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"node {self.ctx.config.node_id} is draining")

    def node_load(self) -> NodeLoad:
        load = self.ctx.engine.load()
        extra = dict(self.load_extra())
        if self.draining:
            extra["draining"] = 1.0
        return NodeLoad(
            queue_len=load.waiting + int(extra.get("admission_queue", 0)),
            running=load.running, kv_blocks_used=load.kv_blocks_used, kv_blocks_free=load.kv_blocks_free,
            kv_blocks_cached=load.kv_blocks_cached, tokens_per_s=self.ctx.engine.tokens_per_s(), extra=extra,
        )

    def load_response(self) -> pb.LoadResponse:
        load: EngineLoad = self.ctx.engine.load()
        extra = self.load_extra()
        return pb.LoadResponse(
            node_id=self.ctx.config.node_id, role=self.ctx.role, waiting=load.waiting, running=load.running,
            kv_blocks_total=load.kv_blocks_total, kv_blocks_used=load.kv_blocks_used,
            kv_blocks_free=load.kv_blocks_free, kv_blocks_cached=load.kv_blocks_cached,
            kv_blocks_held_for_transfer=int(extra.get("kv_blocks_held_for_transfer", 0)),
            tokens_per_s=self.ctx.engine.tokens_per_s(),
            kv_blocks_reserved=int(extra.get("kv_blocks_reserved", 0)),
            admission_queue=int(extra.get("admission_queue", 0)), in_flight=int(extra.get("in_flight", 0)),
        )


class Drainer:
    """Runs a node's drain at most once (signals and Drain calls share it) and owns the deregistration."""

    def __init__(self, service: NodeService, health: health_aio.HealthServicer, service_name: str,
                 timeout_s: float) -> None:
        self._service = service
        self._health = health
        self._service_name = service_name
        self._timeout_s = timeout_s
        self.registration: NodeRegistration | None = None  # set once the node joined
        self._drain: asyncio.Task[bool] | None = None
        self._deregister: asyncio.Task[None] | None = None

    def start(self) -> asyncio.Task[bool]:
        """Starts the drain (if not started); the task's result says whether the node ended idle."""
        if self._drain is None:
            self._drain = asyncio.create_task(self._run(), name="drain")
        return self._drain

    def deregister(self) -> asyncio.Task[None]:
        """Revokes the lease (once); a task of its own, so cancelling a drain never cuts it short."""
        if self._deregister is None:
            registration = self.registration
            self._deregister = asyncio.create_task(
                registration.close() if registration is not None else asyncio.sleep(0), name="deregister")
        return self._deregister

    async def _run(self) -> bool:
        service, node_id = self._service, self._service.ctx.config.node_id
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        log.info("node %s: draining (timeout %gs)", node_id, self._timeout_s)
        service.draining = True
        await self._health.set(self._service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await service.quiesce(deadline)
        service.accepting = False
        await asyncio.shield(self.deregister())
        while service.in_flight() and loop.time() < deadline:
            await asyncio.sleep(_POLL_S)
        left = service.in_flight()
        if left:
            log.warning("node %s: drain timed out with %d request(s) in flight", node_id, left)
        else:
            log.info("node %s: drained", node_id)
        return left == 0


class NodeControlServicer(pb_grpc.NodeControlServicer):
    """The NodeControl service of every node: Drain starts the node's one drain (or joins it)."""

    def __init__(self, drainer: Drainer, service: NodeService) -> None:
        self.drainer, self.service = drainer, service

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:  # noqa: N802
        if self.drainer.registration is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the node has not joined the registry")
        task = self.drainer.start()
        try:
            await asyncio.wait_for(asyncio.shield(task), context.time_remaining())
        except TimeoutError:
            pass  # the caller's deadline came first; the drain goes on
        return self.service.load_response()


async def run_node(
    config: NodeConfig, role: str, make_service: type[NodeService],
    make_metrics: Callable[[MetricLabels], NodeMetrics],
) -> int:
    """Runs one node until SIGTERM/SIGINT (drained, then stopped); returns the process exit code."""
    # Process-wide switch of prometheus_client: `*_created` series only double the series count, and no
    # dashboard or rule reads them.
    disable_created_metrics()
    metrics = make_metrics(MetricLabels(role, config.node_id, config.model_name))
    try:
        # Up before the model loads, so a scrape during start-up finds the process.
        metrics_server = metrics.serve(config.metrics_host, config.metrics_port)
    except OSError as err:
        print(f"pdserve {role} node {config.node_id}: cannot serve /metrics on "
              f"{config.metrics_host}:{config.metrics_port}: {err}", file=sys.stderr)
        return 1
    try:
        return await _serve(config, role, make_service, metrics, metrics_server)
    finally:
        metrics_server.close()


async def _serve(
    config: NodeConfig, role: str, make_service: type[NodeService], metrics: NodeMetrics,
    metrics_server: MetricsServer,
) -> int:
    engine = await asyncio.to_thread(ObservedEngine, config.engine, metrics)
    fingerprint = engine.model_config.fingerprint()
    aengine = AsyncEngine(engine, name=config.node_id)
    aengine.start()
    channels = ChannelManager(ChannelConfig(
        node_id=config.node_id, role=role, kv_address=f"{config.kv_host}:{config.kv_port}",  # type: ignore[arg-type]
        device=config.engine.device, interface=config.kv_interface,
        connect_timeout_s=config.transfer_timeout_s,
    ))
    view = RegistryView(config.etcd_endpoints, config.cluster)
    ctx = NodeContext(config, role, aengine, channels, view, fingerprint, metrics)
    service = make_service(ctx)
    metrics.bind(lambda: EngineGauges(aengine.load(), service.queued_outside_engine()))
    server = grpc.aio.server(options=GRPC_OPTIONS)
    service.add_to_server(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    service_name = pb.DESCRIPTOR.services_by_name[ROLE_SERVICES[role]].full_name
    await health.set(service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
    drainer = Drainer(service, health, service_name, config.drain_timeout_s)
    pb_grpc.add_NodeControlServicer_to_server(NodeControlServicer(drainer, service), server)
    try:
        port = server.add_insecure_port(f"{config.grpc_host}:{config.grpc_port}")
        if port == 0:
            raise OSError(f"cannot bind gRPC to {config.grpc_host}:{config.grpc_port}")
        await server.start()
        ctx.record = NodeRecord(
            role=role, node_id=config.node_id, cluster=config.cluster,  # type: ignore[arg-type]
            grpc_address=f"{config.grpc_public_host}:{port}", kv_address=channels.kv_address,
            model=config.model_name, model_fingerprint=fingerprint,
            dtype=str(engine.dtype).removeprefix("torch."), block_size=config.engine.block_size,
            prefix_hash_seed=config.engine.prefix_hash_seed,
            capacity=NodeCapacity(engine.num_blocks, config.engine.max_num_seqs, config.engine.max_num_batched_tokens),
        )
        await view.start(sync_timeout_s=config.join_timeout_s)

        def on_change(change: ViewChange) -> None:
            # A disconnected view reports no departures; a resync after an outage reports real ones.
            if change.kind == "left" and change.node_id != config.node_id and view.connected:
                service.on_member_left(change.node_id)

        view.subscribe(on_change)
        registration = NodeRegistration(
            config.etcd_endpoints, ctx.record, service.node_load, ttl_s=config.lease_ttl_s,
            load_interval_s=config.load_interval_s, join_timeout_s=config.join_timeout_s,
        )
        await registration.start()
        drainer.registration = registration
    except RegistrationRefused as err:
        log.error("registration refused: %s", err)
        print(f"pdserve {role} node {config.node_id}: refused by the registry: {err}", file=sys.stderr)
        await _shutdown(service, server, aengine, channels, view, drainer, health)
        return EXIT_REFUSED
    except RegistryUnavailable as err:
        log.error("registry unavailable: %s", err)
        await _shutdown(service, server, aengine, channels, view, drainer, health)
        return EXIT_UNAVAILABLE
    await health.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    ready = {
        "node_id": config.node_id, "role": role, "grpc_address": ctx.record.grpc_address,
        "kv_address": ctx.record.kv_address, "metrics_address": metrics_server.address, "pid": os.getpid(),
        "fingerprint": fingerprint,
    }
    print(ready_line(ready), flush=True)
    signals: asyncio.Queue[int] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    first = await signals.get()
    log.info("node %s: %s received", config.node_id, signal.Signals(first).name)
    drain = drainer.start()
    second = asyncio.ensure_future(signals.get())
    await asyncio.wait({drain, second}, return_when=asyncio.FIRST_COMPLETED)
    if not drain.done():
        log.warning("node %s: second signal, stopping without waiting for the drain", config.node_id)
        drain.cancel()
    second.cancel()
    log.info("node %s stopping", config.node_id)
    await _shutdown(service, server, aengine, channels, view, drainer, health)
    return 0


async def _shutdown(
    service: NodeService, server: grpc.aio.Server, aengine: AsyncEngine, channels: ChannelManager,
    view: RegistryView, drainer: Drainer, health: health_aio.HealthServicer,
) -> None:
    await health.enter_graceful_shutdown()
    # Leave the registry first so routers stop sending work, then end the work in flight.
    await drainer.deregister()
    await server.stop(grace=1.0)
    await service.close()
    await aengine.close()
    await asyncio.to_thread(channels.close)
    await view.close()
