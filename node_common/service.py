"""What a node kind's servicer gets from the runtime (`NodeContext`) and what it must provide
(`NodeService`): its gRPC services, its requests in flight, drain and shutdown, and its part of the
node's `check_integrity`."""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.llm_engine import EngineRequests
from pdserve.kv_transfer import ChannelManager
from pdserve.node_common.config import NodeConfig
from pdserve.node_common.convert import load_to_proto
from pdserve.node_common.faults import NodeFaults
from pdserve.node_common.metrics import NodeMetrics
from pdserve.registry import NodeLoad, NodeRecord, RegistryView
from pdserve.rpc import pdserve_pb2 as pb

if TYPE_CHECKING:
    from pdserve.rpc.tracing.tracer import Tracer

log = logging.getLogger(__name__)


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
    faults: NodeFaults  # the node's fault hook (`node_common.faults`): its kind's no-op hook in production
    record: NodeRecord | None = None  # set once the gRPC port is bound
    tracer: Tracer | None = None  # set when tracing is on (an OTLP endpoint is configured)
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
    """One node kind's servicer logic on top of the shared runtime.

    Request ownership: a servicer keeps one object per request (a decode node's `requests`, a prefill
    node's `calls`), registered before the request enters the engine and dropped only once the engine is
    done with it (its finished output was read, or an abort was awaited). `check_integrity` relies on
    that order."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.accepting = True  # False once a drain stops new work: new calls get UNAVAILABLE
        self.draining = False  # published in the load record, so peers stop choosing this node
        # Seconds a drain lets requests run before `hand_over`; None: this kind never hands over.
        self.handover_after_s: float | None = None

    @abstractmethod
    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Registers the gRPC service(s) on `server`."""

    @abstractmethod
    def request_stages(self) -> Mapping[str, str]:
        """Request id -> stage name of every request this node serves (any stage); a copy."""

    @abstractmethod
    def check_requests(self, before: Mapping[str, str], engine: EngineRequests) -> None:
        """Asserts that the engine's requests agree with this node's request objects: `before` are the
        stages as they were just before the engine's ids were read (see `check_integrity`)."""

    @abstractmethod
    def on_member_left(self, node_id: str) -> None:
        """A peer's registry lease disappeared (while etcd is reachable): drop what is held for it."""

    @abstractmethod
    async def quiesce(self, deadline: float) -> None:
        """First part of a drain: stops taking new work (sets `accepting` False) and returns once no
        request of this node needs a peer to still see it registered, or at `deadline` (loop time).
        Peers drop the work they share with a node whose lease goes, so the lease waits for this."""

    def hand_over(self) -> int:
        """Ends the requests still running here so that their callers continue them elsewhere (a drain's
        grace is over, or the node stops), freeing what they hold. Returns how many. Kinds whose requests
        cannot move do nothing."""
        return 0

    @abstractmethod
    async def close(self) -> None:
        """Ends every request (freeing its blocks) before the engine stops."""

    def in_flight(self) -> int:
        """Requests this node is serving, at any stage (the drain waits for 0); safe from any thread."""
        return len(self.request_stages())

    def reservation_queue(self) -> int:
        """Requests waiting for KV blocks outside the engine; safe from any thread."""
        return 0

    async def refuse_if_draining(self, context: grpc.aio.ServicerContext) -> None:
        """Aborts the call with UNAVAILABLE (callers try another node) once new work is refused."""
        if not self.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"node {self.ctx.config.node_id} is draining")

    def node_load(self) -> NodeLoad:
        """The node's load record (registry, GetLoad, /metrics); safe from any thread."""
        load = self.ctx.engine.load()
        queue = self.reservation_queue()
        return NodeLoad(
            queue_len=load.waiting + queue, running=load.running, kv_blocks_used=load.kv_blocks_used,
            kv_blocks_free=load.kv_blocks_free, kv_blocks_cached=load.kv_blocks_cached,
            tokens_per_s=self.ctx.engine.tokens_per_s(), waiting=load.waiting, kv_blocks_total=load.kv_blocks_total,
            kv_blocks_held=load.held_blocks, kv_blocks_reserved=load.reserved_blocks, reservation_queue=queue,
            in_flight=self.in_flight(), draining=self.draining,
        )

    def load_response(self) -> pb.LoadResponse:
        response = load_to_proto(self.ctx.config.node_id, self.ctx.role, self.node_load())
        response.members.extend(sorted(self.ctx.view.snapshot()))
        return response

    async def check_integrity(self) -> None:
        """Asserts that blocks, engine requests, output streams and request objects agree: the engine's
        own invariants (every KV block held by a sequence its scheduler knows), every engine request and
        open stream owned by a request object of this node, and the role's own rules. Changes nothing;
        raises AssertionError naming the first disagreement."""
        before = dict(self.request_stages())
        engine = await self.ctx.engine.call(lambda e: e.check_integrity())
        # Engine requests were all registered here before `before` was taken (see the class docstring).
        orphans = engine.all - before.keys()
        assert not orphans, f"engine requests no request object owns: {sorted(orphans)}"
        streams = self.ctx.engine.open_streams - before.keys() - self.request_stages().keys()
        assert not streams, f"output streams no request object owns: {sorted(streams)}"
        self.check_requests(before, engine)
