"""Drain (SIGTERM, SIGINT, or the ``pdserve.v1.NodeControl/Drain`` call of ``pdserve drain``): the node turns
NOT_SERVING, stops taking new work (UNAVAILABLE), waits until no request depends on a peer seeing it in
the registry, revokes its lease, and lets the requests it still runs finish, all within
``--drain-timeout``. A decode node lets them run for ``--drain-grace`` only, then hands the rest over
(`NodeService.hand_over`): each stream ends with finish reason HAND_OVER, which the frontend answers by
resuming the request on another decode node. After a signal the node then exits; after a Drain call it
idles until signalled. A second signal skips what is left of the drain.

Also here: the rest of the NodeControl service (CheckIntegrity, what tests call after every cluster test;
WatchKVEvents, the stream of the node's KV blocks per tier that the frontends index: engine.kv_events).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from pdserve.engine.kv_events import EventBatch, Snapshot
from pdserve.node_common.service import NodeService
from pdserve.registry import NodeRegistration
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_POLL_S = 0.05


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
        grace = service.handover_after_s
        handover_at = deadline if grace is None else min(deadline, loop.time() + grace)
        log.info("node %s: draining (timeout %gs, hand-over after %s)", node_id, self._timeout_s,
                 "never" if grace is None else f"{grace:g}s")
        service.draining = True
        await self._health.set(self._service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await service.quiesce(handover_at)
        if grace is not None and loop.time() >= handover_at:
            self._hand_over()  # requests still waiting on a peer end now; their peers let go of them
            await service.quiesce(deadline)
        service.accepting = False
        await asyncio.shield(self.deregister())
        while service.in_flight() and loop.time() < handover_at:
            await asyncio.sleep(_POLL_S)
        if grace is not None and service.in_flight():
            self._hand_over()
        while service.in_flight() and loop.time() < deadline:
            await asyncio.sleep(_POLL_S)
        left = service.in_flight()
        if left:
            log.warning("node %s: drain timed out with %d request(s) in flight", node_id, left)
        else:
            log.info("node %s: drained", node_id)
        return left == 0

    def _hand_over(self) -> None:
        moved = self._service.hand_over()
        if moved:
            log.info("node %s: drain grace over; handed %d request(s) over", self._service.ctx.config.node_id, moved)


KV_EVENTS_POLL_S = 0.05  # how often a WatchKVEvents stream looks for new events
KV_SNAPSHOT_CHUNK = 16384  # block hashes per message of a snapshot (well under gRPC's 4 MiB)


def kv_event_messages(epoch: str, snapshot: Snapshot | None, batches: list[EventBatch]) -> Iterator[pb.KVEventBatch]:
    """The stream messages of what `KVEventLog.since` returned: a snapshot (its hashes in chunks, the first
    message flagged), then each batch, consecutive events of one kind and tier in one KVEvent."""
    if snapshot is not None:
        chunks = [(tier, sorted(hashes)[i:i + KV_SNAPSHOT_CHUNK]) for tier, hashes in sorted(snapshot.held.items())
                  for i in range(0, max(1, len(hashes)), KV_SNAPSHOT_CHUNK)]
        for n, (tier, part) in enumerate(chunks):
            yield pb.KVEventBatch(epoch=epoch, seq=snapshot.seq, snapshot=n == 0, events=[
                pb.KVEvent(stored=True, tier=tier, block_hashes=part)])
    for batch in batches:
        events: list[pb.KVEvent] = []
        for stored, tier, block_hash in batch.events:
            if not events or events[-1].stored != stored or events[-1].tier != tier:
                events.append(pb.KVEvent(stored=stored, tier=tier))
            events[-1].block_hashes.append(block_hash)
        yield pb.KVEventBatch(epoch=epoch, seq=batch.seq, events=events)


class NodeControlServicer(pb_grpc.NodeControlServicer):
    """The NodeControl service of every node: Drain starts the node's one drain (or joins it);
    CheckIntegrity runs the node's `check_integrity`; WatchKVEvents streams its KV blocks' events."""

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

    async def CheckIntegrity(  # noqa: N802
        self, request: pb.IntegrityRequest, context: grpc.aio.ServicerContext
    ) -> pb.IntegrityReport:
        try:
            await self.service.check_integrity()
        except AssertionError as err:
            log.error("node %s: integrity check failed: %s", self.service.ctx.config.node_id, err)
            return pb.IntegrityReport(ok=False, problem=str(err) or "assertion failed")
        return pb.IntegrityReport(ok=True)

    async def WatchKVEvents(  # noqa: N802
        self, request: pb.KVEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVEventBatch]:
        """From the caller's cursor (a snapshot first when it cannot be continued) until it hangs up."""
        log_ = self.service.ctx.engine.engine.kv_events
        epoch, seq = request.epoch, request.after_seq
        while True:
            snapshot, batches = log_.since(epoch, seq)
            for msg in kv_event_messages(log_.epoch, snapshot, batches):
                yield msg
            epoch = log_.epoch
            seq = snapshot.seq if snapshot is not None else (batches[-1].seq if batches else seq)
            await asyncio.sleep(KV_EVENTS_POLL_S)
