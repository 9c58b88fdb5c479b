"""The frontend's index of which node holds which KV blocks in which tier, kept from each node's
NodeControl/WatchKVEvents stream, and what routing asks of it: how long a prompt's cached prefix is on
each node (`KVIndex.overlap`).

    registry view: a node joins ──> KVWatcher task: WatchKVEvents(epoch, after_seq) ──> KVIndex.apply
                   a node leaves ──> its task ends, its entry goes

A stream that breaks is opened again from the last batch applied; the node answers with the batches
after it, or (another epoch: a restarted node; a cursor it can no longer continue: a gap) a snapshot
that replaces the node's entry. A batch whose number does not follow the last applied one is a gap
too: the entry is dropped and the stream reopened from nothing. Bounded: at most `max_blocks` hashes
per node and tier; a node whose state does not fit is not trusted (its overlap reads 0) until a snapshot
that fits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.registry.view import Member, RegistryView, ViewChange
from pdserve.rpc import RpcSecurity
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as pbg

log = logging.getLogger(__name__)

POOL, DISK = pb.KV_TIER_POOL, pb.KV_TIER_DISK
MAX_BLOCKS = 1 << 20  # hashes per node and tier
RETRY_S = 0.5


@dataclass(frozen=True)
class Overlap:
    """A prompt's leading blocks a node holds: `pool` in its KV pool, then `disk` more in its tier."""

    pool: int = 0
    disk: int = 0

    @property
    def blocks(self) -> int:
        return self.pool + self.disk


@dataclass(eq=False)
class NodeBlocks:
    """What one node holds, as of batch `seq` of `epoch`."""

    epoch: str = ""
    seq: int = 0
    held: dict[int, set[bytes]] = field(default_factory=lambda: {POOL: set(), DISK: set()})
    overflowed: bool = False  # more than the bound: not trusted until the next snapshot that fits
    synced: bool = False  # a snapshot has been applied (a fresh entry knows nothing yet)


class KVIndex:
    """node id -> the KV blocks it holds per tier (`apply` changes one node's entry; the rest reads)."""

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self.nodes: dict[str, NodeBlocks] = {}
        self.resyncs = 0  # snapshots applied
        self.gaps = 0  # batches refused for a number that did not follow

    def cursor(self, node_id: str) -> tuple[str, int]:
        entry = self.nodes.get(node_id)
        return ("", 0) if entry is None or not entry.synced else (entry.epoch, entry.seq)

    def apply(self, node_id: str, batch: pb.KVEventBatch) -> bool:
        """Applies one stream message; False (the node's entry reset) on a gap: the stream must be opened
        again from nothing."""
        entry = self.nodes.setdefault(node_id, NodeBlocks())
        if batch.snapshot:
            entry.epoch, entry.seq, entry.synced, entry.overflowed = batch.epoch, batch.seq, True, False
            entry.held = {POOL: set(), DISK: set()}
            self.resyncs += 1
        elif not entry.synced or batch.epoch != entry.epoch or batch.seq not in (entry.seq, entry.seq + 1):
            self.gaps += 1
            self.nodes[node_id] = NodeBlocks()
            return False
        entry.seq = batch.seq
        for event in batch.events:
            held = entry.held.setdefault(event.tier, set())
            if event.stored:
                held.update(event.block_hashes)
                if len(held) > self.max_blocks:
                    entry.overflowed = True
                    held.clear()
            else:
                held.difference_update(event.block_hashes)
        return True

    def forget(self, node_id: str) -> None:
        self.nodes.pop(node_id, None)

    def overlap(self, node_id: str, hashes: Sequence[bytes]) -> Overlap:
        """The leading blocks of `hashes` the node holds: a run in its pool, then a run in its tier (the
        order its block manager reads them in). Nothing for a node not synced or over the bound."""
        entry = self.nodes.get(node_id)
        if entry is None or not entry.synced or entry.overflowed:
            return Overlap()
        pool, disk = entry.held.get(POOL, set()), entry.held.get(DISK, set())
        i = 0
        while i < len(hashes) and hashes[i] in pool:
            i += 1
        j = i
        while j < len(hashes) and hashes[j] in disk:
            j += 1
        return Overlap(i, j - i)

    def holds(self, node_id: str) -> int:
        """Hashes indexed for the node (both tiers)."""
        entry = self.nodes.get(node_id)
        return 0 if entry is None else sum(len(h) for h in entry.held.values())


class KVWatcher:
    """One WatchKVEvents stream per registered node, feeding `index` (start/close; the view's changes
    start and end the streams)."""

    def __init__(self, view: RegistryView, index: KVIndex, security: RpcSecurity) -> None:
        self._view, self.index, self._security = view, index, security
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._closed = False

    def on_change(self, change: ViewChange) -> None:
        if self._closed:
            return
        if change.kind == "left":
            task = self._tasks.pop(change.node_id, None)
            if task is not None:
                task.cancel()
            self.index.forget(change.node_id)
        elif change.member is not None and change.node_id not in self._tasks:
            self._tasks[change.node_id] = asyncio.ensure_future(self._watch(change.member))

    def start(self) -> None:
        for member in self._view.members():
            if member.node_id not in self._tasks:
                self._tasks[member.node_id] = asyncio.ensure_future(self._watch(member))

    async def close(self) -> None:
        self._closed = True
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: PERF203 - shutting down
                pass
        self._tasks.clear()

    async def _watch(self, member: Member) -> None:
        node_id, address = member.node_id, member.record.grpc_address
        channel = self._security.aio_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
        stub = pbg.NodeControlStub(channel)
        try:
            while True:
                epoch, seq = self.index.cursor(node_id)
                try:
                    async for batch in stub.WatchKVEvents(pb.KVEventsRequest(epoch=epoch, after_seq=seq)):
                        if not self.index.apply(node_id, batch):
                            log.warning("KV events of %s: batch %d after %d: a gap; resyncing", node_id, batch.seq, seq)
                            break
                        seq = batch.seq
                except grpc.aio.AioRpcError as err:
                    if err.code() != grpc.StatusCode.CANCELLED:
                        log.debug("KV events of %s: %s; reconnecting", node_id, err.code().name)
                await asyncio.sleep(RETRY_S)
        finally:
            await channel.close(grace=None)
