"""A live, read-only view of one cluster's membership, fed by an etcd prefix watch.

The view loads `/pdserve/v1/<cluster>/` with a range get, then watches from that get's revision + 1,
so no event between the two is lost. When etcd goes away it keeps serving the last view (marked
`connected=False`) and reconnects with backoff; every reconnect starts again from a fresh get rather
than from an old revision, so compaction of etcd's history never leaves it stuck, and the difference
between the old and the new snapshot is reported as ordinary changes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Literal

import aetcd

from pdserve.registry.connect import (
    TRANSIENT_ERRORS,
    BackoffPolicy,
    EtcdConnector,
    RegistryUnavailable,
    cancel_and_wait,
    close_quietly,
)
from pdserve.registry.records import NodeLoad, NodeRecord, RecordError, cluster_prefix, parse_key

log = logging.getLogger(__name__)

ChangeKind = Literal["joined", "updated", "load", "left"]


@dataclass(frozen=True)
class Member:
    record: NodeRecord
    load: NodeLoad | None  # None until the node's first load report arrives
    last_seen: float  # unix seconds when this view last received the record or a load for it

    @property
    def node_id(self) -> str:
        return self.record.node_id

    @property
    def role(self) -> str:
        return self.record.role

    @property
    def draining(self) -> bool:
        """The node finishes what it has and takes no new work, so nobody routes new work to it."""
        return self.load is not None and self.load.draining


@dataclass(frozen=True)
class ViewChange:
    kind: ChangeKind
    node_id: str
    member: Member | None  # the member after the change; None for "left"


MembersPredicate = Callable[[Mapping[str, Member]], bool]
ChangeCallback = Callable[[ViewChange], None]


class RegistryView:
    """Membership of one cluster, node_id -> Member, kept current by a background watch task."""

    def __init__(
        self,
        endpoints: Sequence[str],
        cluster: str,
        *,
        rpc_timeout_s: float = 2.0,
        backoff: BackoffPolicy | None = None,
    ) -> None:
        self.cluster = cluster
        self.backoff = backoff or BackoffPolicy()
        self._prefix = cluster_prefix(cluster).encode()
        self._connector = EtcdConnector(endpoints, rpc_timeout_s)
        self._records: dict[str, NodeRecord] = {}
        self._loads: dict[str, NodeLoad] = {}  # may hold loads of nodes whose record is not seen yet
        self._seen: dict[str, float] = {}
        self._members: dict[str, Member] = {}
        self._callbacks: list[ChangeCallback] = []
        self._changed = asyncio.Condition()
        self._generation = 0
        self._connected = False
        self._revision = 0
        self._last_sync: float | None = None
        self._synced_once = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # --- reading ---------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """False while etcd is unreachable; the members shown are then the last ones seen."""
        return self._connected

    @property
    def revision(self) -> int:
        """etcd revision of the latest snapshot or event applied."""
        return self._revision

    @property
    def last_sync(self) -> float | None:
        """Unix seconds of the latest full resync (None before the first)."""
        return self._last_sync

    @property
    def generation(self) -> int:
        """Incremented on every change; lets pollers notice changes cheaply."""
        return self._generation

    def snapshot(self) -> dict[str, Member]:
        """A copy of the current membership, node_id -> Member."""
        return dict(self._members)

    def get(self, node_id: str) -> Member | None:
        return self._members.get(node_id)

    def members(self, role: str | None = None, model: str | None = None) -> list[Member]:
        """Members filtered by role and/or model name, sorted by node_id."""
        return [
            m
            for _, m in sorted(self._members.items())
            if (role is None or m.record.role == role) and (model is None or m.record.model == model)
        ]

    async def wait_for(self, predicate: MembersPredicate, timeout: float | None) -> dict[str, Member]:
        """Waits until predicate(membership) holds; returns that membership. Raises TimeoutError.

        The predicate is re-evaluated on every change and on every connect/disconnect.
        """
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: predicate(self._members)), timeout)
            return dict(self._members)

    def subscribe(self, callback: ChangeCallback) -> Callable[[], None]:
        """Calls `callback` (on the event loop) for every change; returns the unsubscribe function."""
        self._callbacks.append(callback)

        def unsubscribe() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

        return unsubscribe

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self, sync_timeout_s: float | None = 10.0) -> None:
        """Starts the watch task; waits up to sync_timeout_s for the first snapshot (None: no wait).

        Raises RegistryUnavailable (and stops) if the first snapshot does not arrive in time.
        """
        if self._task is not None:
            raise RuntimeError("RegistryView already started")
        self._task = asyncio.create_task(self._run(), name=f"registry-view-{self.cluster}")
        if sync_timeout_s is None:
            return
        try:
            await asyncio.wait_for(self._synced_once.wait(), sync_timeout_s)
        except TimeoutError as err:
            await self.close()
            raise RegistryUnavailable(
                f"no snapshot of cluster {self.cluster!r} from etcd at {self._connector.describe()} "
                f"within {sync_timeout_s:g}s"
            ) from err

    async def close(self) -> None:
        """Stops watching; the last membership stays readable."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task, f"registry view {self.cluster}")
        self._connected = False

    async def __aenter__(self) -> RegistryView:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # --- watch loop ------------------------------------------------------------------------------

    async def _run(self) -> None:
        delays = self.backoff.delays()
        in_outage = False  # an outage was logged; log the recovery once too
        while True:
            client = self._connector.client()
            try:
                snapshot = await client.get_prefix(self._prefix)
                await self._resync(snapshot)
                if in_outage:
                    log.info("registry view %s: etcd back, resynced %d members", self.cluster, len(self._members))
                    in_outage = False
                delays = self.backoff.delays()
                watch = await client.watch_prefix(self._prefix, start_revision=snapshot.header.revision + 1)
                async for event in watch:
                    await self._apply(event)
                log.warning("registry view %s: watch stream ended; resyncing", self.cluster)
            except TRANSIENT_ERRORS as err:
                if not in_outage:
                    log.warning("registry view %s: etcd unreachable (%r); keeping the last %d members",
                                self.cluster, err, len(self._members))
                    in_outage = True
                self._connector.failed()
            finally:
                await self._set_connected(False)
                await close_quietly(client)
            await asyncio.sleep(next(delays))

    async def _set_connected(self, connected: bool) -> None:
        if connected == self._connected:
            return
        self._connected = connected
        async with self._changed:
            self._changed.notify_all()

    async def _resync(self, snapshot: aetcd.GetRange) -> None:
        """Replaces the whole state with `snapshot`, emitting the differences as changes."""
        now = time.time()
        records: dict[str, NodeRecord] = {}
        loads: dict[str, NodeLoad] = {}
        for kv in snapshot:
            decoded = self._decode(kv.key, kv.value)
            if isinstance(decoded, NodeRecord):
                records[decoded.node_id] = decoded
            elif decoded is not None:
                loads[parse_key(kv.key).node_id] = decoded
        old = self._members
        self._records, self._loads = records, loads
        self._seen = dict.fromkeys(records, now)
        self._rebuild()
        self._revision = snapshot.header.revision
        self._last_sync = now
        self._synced_once.set()
        await self._set_connected(True)
        changes: list[ViewChange] = [ViewChange("left", nid, None) for nid in old if nid not in self._members]
        for nid, member in self._members.items():
            before = old.get(nid)
            if before is None:
                changes.append(ViewChange("joined", nid, member))
            elif before.record != member.record:
                changes.append(ViewChange("updated", nid, member))
            elif before.load != member.load:
                changes.append(ViewChange("load", nid, member))
        await self._notify(changes)

    async def _apply(self, event: aetcd.Event) -> None:
        """Applies one watch event to the state and notifies about the resulting change, if any."""
        kv = event.kv
        self._revision = max(self._revision, kv.mod_revision)
        try:
            parsed = parse_key(kv.key)
        except RecordError:
            return
        nid = parsed.node_id
        is_put = event.kind == aetcd.EventKind.PUT
        change: ViewChange | None = None
        if parsed.kind == "nodes":
            if not is_put:
                self._records.pop(nid, None)
                self._loads.pop(nid, None)
                self._seen.pop(nid, None)
                change = ViewChange("left", nid, None) if nid in self._members else None
            else:
                decoded = self._decode(kv.key, kv.value)
                if isinstance(decoded, NodeRecord):
                    kind: ChangeKind = "updated" if nid in self._members else "joined"
                    self._records[nid] = decoded
                    self._seen[nid] = time.time()
                    change = ViewChange(kind, nid, None)
        else:
            if is_put:
                decoded = self._decode(kv.key, kv.value)
                if isinstance(decoded, NodeLoad):
                    self._loads[nid] = decoded
            else:
                self._loads.pop(nid, None)
            if nid in self._records:
                self._seen[nid] = time.time()
                change = ViewChange("load", nid, None)
        if change is None:
            return
        self._rebuild()
        await self._notify([replace(change, member=self._members.get(nid))])

    def _decode(self, key: bytes, value: bytes) -> NodeRecord | NodeLoad | None:
        try:
            parsed = parse_key(key)
            return NodeRecord.from_json(value) if parsed.kind == "nodes" else NodeLoad.from_json(value)
        except RecordError as err:
            log.warning("registry view %s: ignoring %s: %s", self.cluster, key.decode(errors="replace"), err)
            return None

    def _rebuild(self) -> None:
        self._members = {
            nid: Member(rec, self._loads.get(nid), self._seen.get(nid, 0.0)) for nid, rec in self._records.items()
        }

    async def _notify(self, changes: list[ViewChange]) -> None:
        if not changes:
            return
        self._generation += 1
        for change in changes:
            for callback in list(self._callbacks):
                try:
                    callback(change)
                except Exception:
                    log.exception("registry view %s: change callback failed", self.cluster)
        async with self._changed:
            self._changed.notify_all()
