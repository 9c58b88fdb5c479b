"""Which KV blocks a node holds, per tier, as numbered batches of stored and removed events: what the
node streams to the frontends (NodeControl/WatchKVEvents) for routing by exact cached prefix.

    BlockManager (engine thread)  registered / uncached      ─┐
    KVTier (engine and writer)    indexed / dropped           ├─> record(stored, tier, hash)
                                                              ┘
    a stream (event loop)  since(epoch, after_seq) ─> a snapshot when it cannot continue, then the batches

`record` keeps the state the events add up to (a set of hashes per tier), so a snapshot is a copy of it.
Batches are sealed by `since` (every stream polls), numbered consecutively within one `epoch` (this
node run); the last `capacity` are kept, and a caller further behind, or of another epoch, resyncs from
a snapshot. Thread-safe: one lock guards everything.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from dataclasses import dataclass

from pdserve.engine.prefix_hash import BlockHash

POOL, DISK = 0, 1  # the proto's KVTierKind


@dataclass(frozen=True)
class EventBatch:
    seq: int
    events: tuple[tuple[bool, int, BlockHash], ...]  # (stored, tier, hash) in order


@dataclass(frozen=True)
class Snapshot:
    seq: int  # the batch the state includes
    held: dict[int, frozenset[BlockHash]]  # tier -> hashes


class KVEventLog:
    """The numbered stored/removed events of one node's KV blocks and the state they add up to."""

    def __init__(self, capacity: int = 1024) -> None:
        self.epoch = uuid.uuid4().hex
        self._capacity = capacity
        self._lock = threading.Lock()
        self._held: dict[int, set[BlockHash]] = {POOL: set(), DISK: set()}
        self._pending: list[tuple[bool, int, BlockHash]] = []
        self._batches: deque[EventBatch] = deque(maxlen=capacity)
        self._seq = 0

    def record(self, stored: bool, tier: int, block_hash: BlockHash) -> None:
        """One block stored in (or removed from) `tier`. A no-op change (already held, not held) is dropped."""
        with self._lock:
            held = self._held[tier]
            if stored == (block_hash in held):
                return
            (held.add if stored else held.discard)(block_hash)
            self._pending.append((stored, tier, block_hash))

    def since(self, epoch: str, after_seq: int) -> tuple[Snapshot | None, list[EventBatch]]:
        """What a caller whose cursor is (epoch, after_seq) needs: the batches after it, or a snapshot
        first when the cursor is of another epoch or older than the oldest kept batch. Seals the
        pending events into a new batch."""
        with self._lock:
            if self._pending:
                self._seq += 1
                self._batches.append(EventBatch(self._seq, tuple(self._pending)))
                self._pending = []
            oldest = self._batches[0].seq if self._batches else self._seq + 1
            if epoch != self.epoch or after_seq > self._seq or after_seq < oldest - 1:
                snap = Snapshot(self._seq, {t: frozenset(h) for t, h in self._held.items()})
                return snap, []
            return None, [b for b in self._batches if b.seq > after_seq]

    def held(self, tier: int) -> frozenset[BlockHash]:
        with self._lock:
            return frozenset(self._held[tier])
