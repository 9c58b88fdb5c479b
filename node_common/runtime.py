"""The serving lifecycle both node kinds share: engine thread, KV channel manager, gRPC server (the
node's service, NodeControl, grpc.health.v1), registry view and registration, /metrics, signals, drain
and clean shutdown. Each node kind's `main` calls `run_node` with its config, service, metrics and fault
hook (`node_common.faults`).

Health (grpc.health.v1 on the gRPC port): the overall status ``""`` is SERVING while the server runs; the
node's own service (``pdserve.v1.PrefillNode`` / ``pdserve.v1.DecodeNode``) is SERVING only while the
node is registered and takes new work. Start-up and exit codes: `node.ready`; drain: `node_common.drain`;
health from progress (a node whose engine steps fail or hang leaves, hands over and exits): `node.health`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import disable_created_metrics

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.version import chat_template_digest, tokenizer_digest
from pdserve.kv_transfer import ChannelConfig, ChannelManager
from pdserve.node_common.config import NodeConfig
from pdserve.node_common.drain import Drainer, NodeControlServicer
from pdserve.node_common.faults import NodeFaults
from pdserve.node_common.health import HealthCollector, HealthWatch
from pdserve.node_common.metrics import MetricLabels, NodeMetrics, ObservedEngine
from pdserve.node_common.pinning import pin_process
from pdserve.node_common.ready import EXIT_REFUSED, EXIT_UNAVAILABLE, EXIT_UNHEALTHY, ready_line
from pdserve.node_common.service import NodeContext, NodeService
from pdserve.registry import (
    NodeCapacity,
    NodeRecord,
    NodeRegistration,
    RegistrationRefused,
    RegistryUnavailable,
    RegistryView,
    ViewChange,
)
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as pb_grpc
from pdserve.rpc.tracing import start_tracing

log = logging.getLogger(__name__)

GRPC_OPTIONS = (
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),
)
# What a node's server accepts beyond that. Callers ping every 20 s on a call that waits (the frontend's
# keepalive); gRPC's default server counts a ping less than 5 min after the last as a strike while it sends
# nothing, and at the third ends the connection (GOAWAY too_many_pings): every call on it failed once first
# tokens took minutes (an 8B model at 16 streams). Pings every 10 s or slower are fine, and the callers
# are the cluster's own, so strikes never end a connection.
MIN_PING_INTERVAL_MS = 10_000
SERVER_GRPC_OPTIONS = (
    *GRPC_OPTIONS,
    ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", 0),
)
# The gRPC service each role serves, whose health status says whether the node takes new work.
ROLE_SERVICES = {"prefill": "PrefillNode", "decode": "DecodeNode"}


@dataclass(eq=False)
class _Node:
    """The parts of one running node, in start order; `_shutdown` stops them in reverse."""

    ctx: NodeContext
    service: NodeService
    server: grpc.aio.Server
    health: health_aio.HealthServicer
    service_name: str  # the health service name of the node's own service
    drainer: Drainer
    watch: HealthWatch
    weights: str  # how the engine holds its weights, for the ready line (WeightsInfo.describe)


async def run_node(
    config: NodeConfig, role: str, make_service: type[NodeService],
    make_metrics: Callable[[MetricLabels], NodeMetrics], faults: NodeFaults,
) -> int:
    """Runs one node until SIGTERM/SIGINT (drained, then stopped); returns the process exit code."""
    if config.cpus:
        # Before the model loads: torch's thread pool starts with the engine and inherits the mask.
        pin_process(config.cpus)
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
        node = await _build(config, role, make_service, metrics, faults)
        code = await _join(node)
        if code is not None:
            await _shutdown(node)
            return code
        await node.health.set(node.service_name, health_pb2.HealthCheckResponse.SERVING)
        assert node.ctx.record is not None
        print(ready_line({
            "node_id": config.node_id, "role": role, "grpc_address": node.ctx.record.grpc_address,
            "kv_address": node.ctx.record.kv_address, "metrics_address": metrics_server.address,
            "pid": os.getpid(), "fingerprint": node.ctx.fingerprint,
            "weights": node.weights,
        }), flush=True)
        unhealthy = await _serve_until_signalled(node)
        if unhealthy is not None:
            await _leave_unhealthy(node, unhealthy)
            # Not `_shutdown`: a hung engine thread would never stop, and what it holds dies with the process.
            logging.shutdown()
            metrics_server.close()
            os._exit(EXIT_UNHEALTHY)
        await _shutdown(node)
        return 0
    finally:
        metrics_server.close()


async def _build(config: NodeConfig, role: str, make_service: type[NodeService], metrics: NodeMetrics,
                 faults: NodeFaults) -> _Node:
    """Loads the model and starts the engine thread; builds the channel manager, registry view, service
    and gRPC server (not yet listening)."""
    engine = await asyncio.to_thread(ObservedEngine, config.engine, metrics, faults)
    aengine = AsyncEngine(engine, name=config.node_id)
    aengine.start()
    watch = HealthWatch(aengine, config.max_step_failures, config.step_stall_timeout_s)
    metrics.registry.register(HealthCollector(metrics.labels, watch))
    channels = ChannelManager(ChannelConfig(
        node_id=config.node_id, role=role, kv_address=f"{config.kv_host}:{config.kv_port}",  # type: ignore[arg-type]
        device=config.engine.device, interface=config.kv_interface,
        connect_timeout_s=config.transfer_timeout_s, token=config.rpc.token,
        handshake_timeout_s=config.kv_handshake_timeout_s,
    ), on_auth_failure=metrics.kv_auth_failed)
    view = RegistryView(config.etcd_endpoints, config.cluster)
    ctx = NodeContext(config, role, aengine, channels, view, engine.model_config.fingerprint(), metrics, faults)
    # None unless an OTLP endpoint is configured; span times are this process's time.monotonic readings.
    ctx.tracer = start_tracing(config.tracing, f"pdserve-{role}", {"service.instance.id": config.node_id},
                               time.monotonic)
    metrics.set_info(ctx.fingerprint, str(engine.dtype).removeprefix("torch."), config.engine.block_size,
                     engine.weights.format, engine.weights.kernels, config.engine.tensor_parallel_size)
    service = make_service(ctx)
    metrics.bind(service.node_load)
    if engine.kv_tier is not None:
        metrics.bind_tier(engine.kv_tier)
    server = grpc.aio.server(options=SERVER_GRPC_OPTIONS, interceptors=config.rpc.server_interceptors())
    service.add_to_server(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    service_name = pb.DESCRIPTOR.services_by_name[ROLE_SERVICES[role]].full_name
    await health.set(service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
    drainer = Drainer(service, health, service_name, config.drain_timeout_s)
    pb_grpc.add_NodeControlServicer_to_server(NodeControlServicer(drainer, service), server)
    return _Node(ctx, service, server, health, service_name, drainer, watch, engine.weights.describe())


def _record(ctx: NodeContext, port: int) -> NodeRecord:
    """The node's registry record, once its gRPC port is bound."""
    config, engine = ctx.config, ctx.engine.engine
    return NodeRecord(
        role=ctx.role, node_id=config.node_id, cluster=config.cluster,  # type: ignore[arg-type]
        grpc_address=f"{config.grpc_public_host}:{port}", kv_address=ctx.channels.kv_address,
        model=config.model_name, model_fingerprint=ctx.fingerprint,
        dtype=str(engine.dtype).removeprefix("torch."), block_size=config.engine.block_size,
        prefix_hash_seed=config.engine.prefix_hash_seed,
        capacity=NodeCapacity(engine.num_blocks, config.engine.max_num_seqs, config.engine.max_num_batched_tokens),
        colocated=config.prefills_every_prompt,
        tokenizer_digest=tokenizer_digest(engine.tokenizer),
        chat_template_digest=chat_template_digest(engine.tokenizer.chat_template),
    )


def _peer_watch(node: _Node) -> Callable[[ViewChange], None]:
    """The registry-view callback that tells the service (and the KV channels) a peer is gone: it left,
    or it came back as a new process under its id before its old lease lapsed."""
    ctx, own_id = node.ctx, node.ctx.config.node_id
    incarnations: dict[str, tuple[str, int, float]] = {}  # peer -> (hostname, pid, started_at) last seen

    def on_change(change: ViewChange) -> None:
        peer = change.node_id
        if peer == own_id:
            return
        # A disconnected view reports no departures; a resync after an outage reports real ones.
        if change.kind == "left" and ctx.view.connected:
            incarnations.pop(peer, None)
            node.service.on_member_left(peer)
            ctx.channels.close_peer(peer, f"node {peer} left the registry")
        elif change.kind in ("joined", "updated") and change.member is not None:
            rec = change.member.record
            seen, now = incarnations.get(peer), (rec.hostname, rec.pid, rec.started_at)
            incarnations[peer] = now
            if seen is not None and seen != now:
                # Restarted under the same id before its old lease lapsed (so no "left" came): what
                # was shared with the old process is gone, its KV channel included.
                log.warning("node %s restarted (pid %s -> %s): dropping what was shared with it", peer,
                            seen[1], now[1])
                node.service.on_member_left(peer)
                ctx.channels.close_peer(peer, f"node {peer} restarted")

    return on_change


async def _join(node: _Node) -> int | None:
    """Starts serving gRPC, then joins the registry (watching it, registering under a lease). Returns
    None once registered, else the exit code of a refused or unreachable registry."""
    ctx, config = node.ctx, node.ctx.config
    port = config.rpc.add_port(node.server, f"{config.grpc_host}:{config.grpc_port}")
    if port == 0:
        raise OSError(f"cannot bind gRPC to {config.grpc_host}:{config.grpc_port}")
    await node.server.start()
    ctx.record = _record(ctx, port)
    try:
        await ctx.view.start(sync_timeout_s=config.join_timeout_s)
        ctx.view.subscribe(_peer_watch(node))
        registration = NodeRegistration(
            config.etcd_endpoints, ctx.record, node.service.node_load, ttl_s=config.lease_ttl_s,
            load_interval_s=config.load_interval_s, join_timeout_s=config.join_timeout_s,
        )
        await registration.start()
    except RegistrationRefused as err:
        log.error("registration refused: %s", err)
        print(f"pdserve {ctx.role} node {config.node_id}: refused by the registry: {err}", file=sys.stderr)
        return EXIT_REFUSED
    except RegistryUnavailable as err:
        log.error("registry unavailable: %s", err)
        return EXIT_UNAVAILABLE
    node.drainer.registration = registration
    return None


async def _serve_until_signalled(node: _Node) -> str | None:
    """Serves until SIGTERM/SIGINT, then drains (a second signal cuts the drain short); or until the
    engine stops making progress, returning why (`node.health`)."""
    node_id = node.ctx.config.node_id
    signals: asyncio.Queue[int] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    signalled = asyncio.ensure_future(signals.get())
    unhealthy = asyncio.ensure_future(node.watch.wait_unhealthy())
    await asyncio.wait({signalled, unhealthy}, return_when=asyncio.FIRST_COMPLETED)
    if unhealthy.done():
        signalled.cancel()
        return unhealthy.result()
    unhealthy.cancel()
    first = signalled.result()
    log.info("node %s: %s received", node_id, signal.Signals(first).name)
    drain = node.drainer.start()
    second = asyncio.ensure_future(signals.get())
    await asyncio.wait({drain, second}, return_when=asyncio.FIRST_COMPLETED)
    if not drain.done():
        log.warning("node %s: second signal, stopping without waiting for the drain", node_id)
        drain.cancel()
    second.cancel()
    log.info("node %s stopping", node_id)
    return None


async def _leave_unhealthy(node: _Node, why: str) -> None:
    """The node can no longer serve: NOT_SERVING, out of the registry, its requests handed over, its
    gRPC calls ended; each step bounded, since the engine thread may be hung."""
    node_id = node.ctx.config.node_id
    log.error("node %s is unhealthy: %s; leaving the registry, handing its requests over and exiting "
              "(code %d) to be restarted", node_id, why, EXIT_UNHEALTHY)
    service = node.service
    service.draining = True
    service.accepting = False
    await node.health.set(node.service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        await asyncio.wait_for(asyncio.shield(node.drainer.deregister()), timeout=5.0)
    except TimeoutError:
        log.warning("node %s: could not revoke its lease in 5s; it lapses after the TTL", node_id)
    moved = service.hand_over()
    log.info("node %s: handed %d request(s) over", node_id, moved)
    await node.server.stop(grace=2.0)  # the streams' last messages go out; every other call ends


async def _shutdown(node: _Node) -> None:
    await node.health.enter_graceful_shutdown()
    # Leave the registry first so routers stop sending work, then end the work in flight.
    await node.drainer.deregister()
    node.service.hand_over()  # what still runs moves elsewhere; the server's grace sends the signal out
    await node.server.stop(grace=1.0)
    await node.service.close()
    await node.ctx.engine.close()
    await asyncio.to_thread(node.ctx.channels.close)
    await node.ctx.view.close()
    if node.ctx.tracer is not None:
        await asyncio.to_thread(node.ctx.tracer.shutdown)  # exports the spans still queued
