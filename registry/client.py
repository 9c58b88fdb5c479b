"""Node registration in etcd: join a pool (with refusal on conflicts), keep the lease, publish load.

Client library: `aetcd`. The older `etcd3` (0.12) client ships protobuf modules generated for an old
protoc; with current protobuf it fails to import unless protobuf runs in pure-Python mode
(PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python), a process-wide switch that would also slow every
message of our gRPC control plane. aetcd carries modules that load with current protobuf and is
asyncio-native, so registration and watches run as tasks on the node's own event loop instead of
in helper threads.

Failure model: once `start()` has joined, nothing here raises into the node's serving path. If etcd
becomes unreachable the background task logs, retries with backoff and, when etcd answers again,
re-registers: it keeps its lease if etcd still has it, otherwise grants a new one, and re-puts
record and load either way. Each attempt uses a fresh gRPC channel so that gRPC's own reconnect
backoff (which grows to minutes) never delays recovery.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

import aetcd
from aetcd.utils import prefix_range_end

from pdserve.registry.connect import (
    TRANSIENT_ERRORS,
    BackoffPolicy,
    EtcdConnector,
    RegistryUnavailable,
    cancel_and_wait,
    close_quietly,
)
from pdserve.registry.records import NodeLoad, NodeRecord, RecordError, nodes_prefix

log = logging.getLogger(__name__)

# Fields every node of a pool (same cluster, same model name) must agree on: KV blocks move between
# prefill and decode nodes and prefix-cache hashes are compared across them.
POOL_INVARIANTS: tuple[str, ...] = ("model_fingerprint", "block_size", "prefix_hash_seed")


class RegistrationRefused(Exception):
    """The pool refused this node (conflicting invariant or a live node with the same node_id)."""


class RegistrationState(enum.Enum):
    NEW = "new"
    JOINING = "joining"
    REGISTERED = "registered"
    RECONNECTING = "reconnecting"  # etcd unreachable or lease lost; keys may be missing meanwhile
    REFUSED = "refused"  # a re-join was refused (e.g. a node took our node_id during an outage)
    CLOSED = "closed"


@dataclass(frozen=True)
class RegistrationStatus:
    state: RegistrationState
    lease_id: int | None
    joins: int  # successful joins so far, the first one included
    last_error: str | None
    last_load_at: float | None  # unix seconds of the last load put etcd acknowledged


class _LeaseLost(Exception):
    """etcd answered, but our lease no longer exists (expired or revoked)."""


class NodeRegistration:
    """Registers one node under a lease and keeps it registered until `close()`.

    `start()` joins (raising RegistrationRefused or RegistryUnavailable); after that a background task
    refreshes the lease every ttl/3, publishes `load_fn()` every `load_interval_s` under the same
    lease, and re-joins after etcd outages. `close()` revokes the lease, deleting both keys at once.

    Join takeover: a record with our node_id whose pid is dead on this same host (a crashed previous
    incarnation whose lease has not expired yet) is not a conflict; its lease is revoked instead.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        record: NodeRecord,
        load_fn: Callable[[], NodeLoad] | None = None,
        *,
        ttl_s: int = 5,
        load_interval_s: float = 1.0,
        rpc_timeout_s: float = 2.0,
        join_timeout_s: float | None = 30.0,
        backoff: BackoffPolicy | None = None,
    ) -> None:
        if ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1, got {ttl_s}")
        self.record = record
        self.ttl_s = ttl_s
        self.load_interval_s = load_interval_s
        self.join_timeout_s = join_timeout_s
        self.backoff = backoff or BackoffPolicy()
        self._load_fn = load_fn
        self._connector = EtcdConnector(endpoints, rpc_timeout_s)
        self._client: aetcd.Client | None = None
        self._lease_id: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._state = RegistrationState.NEW
        self._joins = 0
        self._last_error: str | None = None
        self._last_load_at: float | None = None

    @property
    def state(self) -> RegistrationState:
        return self._state

    @property
    def lease_id(self) -> int | None:
        return self._lease_id

    def status(self) -> RegistrationStatus:
        return RegistrationStatus(self._state, self._lease_id, self._joins, self._last_error, self._last_load_at)

    async def start(self) -> None:
        """Joins the pool, then keeps the registration alive in a background task.

        Retries an unreachable etcd with backoff for up to join_timeout_s (None: forever), then raises
        RegistryUnavailable. Raises RegistrationRefused at once on a conflict; nothing is left in etcd.
        """
        if self._state is not RegistrationState.NEW:
            raise RuntimeError(f"start() on a registration in state {self._state.value}")
        self._state = RegistrationState.JOINING
        loop = asyncio.get_running_loop()
        deadline = None if self.join_timeout_s is None else loop.time() + self.join_timeout_s
        delays = self.backoff.delays()
        while True:
            try:
                await self._join()
                break
            except RegistrationRefused:
                self._state = RegistrationState.REFUSED
                await self._abandon()
                raise
            except TRANSIENT_ERRORS as err:
                await self._drop_client(err)
                delay = next(delays)
                if deadline is not None and loop.time() + delay > deadline:
                    self._state = RegistrationState.CLOSED
                    await self._abandon()
                    raise RegistryUnavailable(
                        f"etcd at {self._connector.describe()} unreachable for {self.join_timeout_s:g}s "
                        f"while registering node {self.record.node_id!r}: {err}"
                    ) from err
                await asyncio.sleep(delay)
        self._task = asyncio.create_task(self._run(), name=f"registration-{self.record.node_id}")

    async def close(self) -> None:
        """Stops the background task and revokes the lease, which deletes the node's keys immediately."""
        if self._state is RegistrationState.CLOSED:
            return
        self._state = RegistrationState.CLOSED
        if self._task is not None:
            await cancel_and_wait(self._task, f"node {self.record.node_id}")
            self._task = None
        await self._abandon()

    async def __aenter__(self) -> NodeRegistration:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _abandon(self) -> None:
        # Best effort: if etcd is down the lease simply expires after its TTL.
        lease_id, self._lease_id = self._lease_id, None
        if lease_id is not None:
            try:
                await self._ensure_client().revoke_lease(lease_id)
            except TRANSIENT_ERRORS as err:
                log.warning("node %s: could not revoke lease %x (%r); keys expire in <= %ss",
                            self.record.node_id, lease_id, err, self.ttl_s)
        client, self._client = self._client, None
        await close_quietly(client)

    def _ensure_client(self) -> aetcd.Client:
        if self._client is None:
            self._client = self._connector.client()
        return self._client

    async def _drop_client(self, err: BaseException) -> None:
        self._last_error = repr(err)
        self._connector.failed()
        client, self._client = self._client, None
        await close_quietly(client)

    def _sample_load(self) -> NodeLoad | None:
        if self._load_fn is None:
            return None
        try:
            load = self._load_fn()
        except Exception:
            # A broken load callback must not take the registration down with it.
            log.exception("node %s: load_fn failed; load not published this round", self.record.node_id)
            return None
        return dataclasses.replace(load, updated_at=time.time())

    async def _lease_alive(self, client: aetcd.Client, lease_id: int) -> bool:
        reply = await client.refresh_lease(lease_id)
        return reply is not None and reply.TTL > 0

    async def _join(self) -> None:
        """One join: conflict check, lease, then record+load put guarded against concurrent joiners.

        Changes etcd (lease, both keys) and self._lease_id; raises RegistrationRefused or a
        transient error.
        """
        client = self._ensure_client()
        rec = self.record
        if self._lease_id is not None and not await self._lease_alive(client, self._lease_id):
            log.info("node %s: lease %x is gone; granting a new one", rec.node_id, self._lease_id)
            self._lease_id = None
        prefix = nodes_prefix(rec.cluster).encode()
        while True:
            pool = await client.get_prefix(prefix)
            stale = self._check_pool(pool)
            if stale:
                for lease_id in stale:
                    await client.revoke_lease(lease_id)
                continue
            if self._lease_id is None:
                self._lease_id = (await client.lease(self.ttl_s)).id
            ops = [client.transactions.put(rec.key.encode(), rec.to_json(), lease=self._lease_id)]
            load = self._sample_load()
            if load is not None:
                ops.append(client.transactions.put(rec.load_key.encode(), load.to_json(), lease=self._lease_id))
            # Commit only if no node record was created since the pool was read, so two conflicting
            # nodes joining at the same moment cannot both get in.
            unchanged = client.transactions.create(prefix, prefix_range_end(prefix)) < pool.header.revision + 1
            committed, _ = await client.transaction(compare=[unchanged], success=ops, failure=[])
            if committed:
                break
        self._joins += 1
        if load is not None:
            self._last_load_at = load.updated_at
        self._state = RegistrationState.REGISTERED
        log.info("node %s (%s) registered in cluster %s, lease %x, join #%d",
                 rec.node_id, rec.role, rec.cluster, self._lease_id, self._joins)

    def _check_pool(self, pool: aetcd.GetRange) -> list[int]:
        """Raises RegistrationRefused on a conflict; returns leases of stale same-host duplicates."""
        me = self.record
        stale: list[int] = []
        for kv in pool:
            try:
                other = NodeRecord.from_json(kv.value)
            except RecordError as err:
                log.warning("ignoring undecodable node record %s: %s", kv.key.decode(errors="replace"), err)
                continue
            if other.node_id == me.node_id:
                if kv.lease == self._lease_id:
                    continue  # our own record from before an outage
                if _dead_local_process(other):
                    log.warning("node %s: taking over from dead pid %d (lease %x)", me.node_id, other.pid, kv.lease)
                    stale.append(kv.lease)
                    continue
                raise RegistrationRefused(
                    f"node_id {me.node_id!r} is already registered in cluster {me.cluster!r} by a live "
                    f"{other.role} node (pid {other.pid} on {other.hostname}, grpc {other.grpc_address})"
                )
            if other.model != me.model:
                continue
            for name in POOL_INVARIANTS:
                mine, theirs = getattr(me, name), getattr(other, name)
                if mine != theirs:
                    raise RegistrationRefused(
                        f"{me.role} node {me.node_id!r} refused from pool cluster={me.cluster!r} "
                        f"model={me.model!r}: {name} {mine!r} disagrees with {theirs!r} of "
                        f"{other.role} node {other.node_id!r}"
                    )
        return stale

    async def _run(self) -> None:
        """Background loop: maintain the registration; on any failure re-join with backoff, forever."""
        while True:
            try:
                await self._maintain()
            except asyncio.CancelledError:
                raise
            except _LeaseLost as err:
                self._last_error = str(err)
                log.warning("node %s: %s; re-registering", self.record.node_id, err)
                self._lease_id = None
            except TRANSIENT_ERRORS as err:
                log.warning("node %s: etcd unreachable (%r); node keeps serving, re-registering when it returns",
                            self.record.node_id, err)
                await self._drop_client(err)
            self._state = RegistrationState.RECONNECTING
            delays = self.backoff.delays()
            while True:
                await asyncio.sleep(next(delays))
                try:
                    await self._join()
                    break
                except RegistrationRefused as err:
                    if self._state is not RegistrationState.REFUSED or self._last_error != str(err):
                        log.error("node %s: re-join refused (retrying): %s", self.record.node_id, err)
                    self._state = RegistrationState.REFUSED
                    self._last_error = str(err)
                except TRANSIENT_ERRORS as err:
                    log.debug("node %s: re-join failed: %r", self.record.node_id, err)
                    await self._drop_client(err)

    async def _maintain(self) -> None:
        """Refreshes the lease every ttl/3 and puts load every load_interval_s until something fails."""
        client = self._ensure_client()
        loop = asyncio.get_running_loop()
        keepalive_every = max(self.ttl_s / 3.0, 0.1)
        next_keepalive = loop.time() + keepalive_every
        next_load = loop.time() + self.load_interval_s
        while True:
            due = min(next_keepalive, next_load) if self._load_fn is not None else next_keepalive
            await asyncio.sleep(max(0.0, due - loop.time()))
            now = loop.time()
            lease_id = self._lease_id
            if lease_id is None:
                raise _LeaseLost("no lease")
            if now >= next_keepalive:
                if not await self._lease_alive(client, lease_id):
                    raise _LeaseLost(f"lease {lease_id:x} expired or was revoked")
                next_keepalive = now + keepalive_every
            if now >= next_load:
                load = self._sample_load()
                if load is not None:
                    await client.put(self.record.load_key.encode(), load.to_json(), lease=lease_id)
                    self._last_load_at = load.updated_at
                next_load = now + self.load_interval_s


def _dead_local_process(rec: NodeRecord) -> bool:
    """True if `rec` was written by a process on this host that no longer exists."""
    if rec.hostname != socket.gethostname() or rec.pid == os.getpid() or rec.pid <= 0:
        return False
    try:
        os.kill(rec.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # exists, owned by someone else
    return False
