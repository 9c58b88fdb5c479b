"""Per-node channel bookkeeping: lazy opening, LRU bound, idle closing, epochs after failures.

Each node runs one TCPStore server at its `kv_address` (the same endpoint on every node). A pair's
rendezvous uses the *prefill* node's store: the sender is the side that opens channels and numbers
epochs, so the store that names them lives and dies with it. A decode node's own server is not
used by its pairs. Rank 0 is the prefill side, rank 1 the decode side. The gloo device binds the
host of this node's `kv_address` (or `interface`), so the address must be one peers can reach,
not a wildcard.

Epochs: the prefill node numbers each new channel to a peer with an epoch strictly greater than
every earlier one, seeded from the wall clock in microseconds, so epochs also keep increasing
across prefill restarts (whose fresh store would otherwise reuse old names). The decode side
opens whatever epoch the metadata names, closes an older channel to that peer when a newer epoch
appears, and refuses epochs it has already closed (StaleEpochError).

Who may connect (`kv_transfer.auth`): with `ChannelConfig.token` the store listens on loopback only and
`kv_address` is a `KVGate` that relays a connection to it only once the peer proved it holds the token;
the decode side dials through `auth.dial`. Without a token the store itself listens on `kv_address`
(its host only, never every interface) and anyone who reaches it can join a pair's rendezvous.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch._C._distributed_c10d import ProcessGroupGloo, TCPStore

from pdserve.kv_transfer.auth import FailureReason, KVGate
from pdserve.kv_transfer.backend import ConnectSpec, DialAuth, PairGroup, connect_pair, create_gloo_device
from pdserve.kv_transfer.channel import Channel
from pdserve.kv_transfer.types import (
    DECODE_RANK,
    PREFILL_RANK,
    ChannelCapacityError,
    ChannelConfig,
    ChannelKey,
    NodeAddress,
    StaleEpochError,
)

log = logging.getLogger(__name__)


def _listen(address: NodeAddress) -> socket.socket:
    """A listening socket on exactly `address` (port 0: a free one). TCPStore, left to bind by itself,
    would listen on every interface whatever host it is given."""
    family = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((address.host, address.port), family=family, backlog=128)


def _is_loopback(host: str) -> bool:
    try:
        return any(info[4][0] in ("127.0.0.1", "::1") or info[4][0].startswith("127.")
                   for info in socket.getaddrinfo(host, None))
    except OSError:
        return False


class ChannelManager:
    """Owns one node's channels (keyed by peer id). Thread-safe; no call but `close` blocks on the
    network or on another thread, so it may be used from an asyncio event loop."""

    def __init__(self, config: ChannelConfig,
                 on_auth_failure: Callable[[FailureReason, str], None] | None = None) -> None:
        """``on_auth_failure(reason, peer address)``: called for every peer the KV port refused (with a token)."""
        self.config = config
        self._device = torch.device(config.device)
        self._backend = config.resolved_backend
        address = NodeAddress.parse(config.kv_address)
        self._gate: KVGate | None = None
        public = _listen(address)
        store_listener = _listen(NodeAddress("127.0.0.1", 0)) if config.token else public
        self._store_address = NodeAddress(*store_listener.getsockname()[:2])
        self.address = NodeAddress(address.host, public.getsockname()[1])  # port 0 resolved
        # A wait-free server: its own clients only connect per rendezvous, each with its own timeout. It
        # owns (and closes) the listening socket handed to it.
        self._server = TCPStore(
            self._store_address.host, self._store_address.port, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=config.connect_timeout_s), master_listen_fd=store_listener.detach(),
        )
        if config.token:
            self._gate = KVGate(public, self._store_address, config.token, config.node_id,
                                config.handshake_timeout_s, on_auth_failure)
        elif not _is_loopback(address.host):
            log.warning("KV channels of %s are not authenticated (no cluster token): anything that reaches %s "
                        "can join a rendezvous", config.node_id, self.address)
        self._gloo_device: ProcessGroupGloo.Device | None = None
        if self._backend == "gloo":
            self._gloo_device = create_gloo_device(self.address, config.interface)
        self._lock = threading.RLock()
        self._channels: OrderedDict[str, Channel] = OrderedDict()  # peer id -> channel, LRU first
        self._last_epoch: dict[str, int] = {}  # peer id -> highest epoch opened or closed
        self._retired: list[Channel] = []  # down, but their workers may still be releasing groups
        self._closed = False
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name=f"kv-reaper-{config.node_id}", daemon=True)
        self._reaper.start()

    @property
    def auth_failures(self) -> dict[FailureReason, int]:
        """Peers the KV port refused, by reason (all zero without a token)."""
        return dict(self._gate.failures) if self._gate is not None else dict.fromkeys(FailureReason, 0)

    @property
    def kv_address(self) -> str:
        """The address to publish in the registry (the actual port when 0 was asked for)."""
        return str(self.address)

    # ----------------------------------------------------------------- opening
    def channel_to(self, decode_id: str) -> Channel:
        """Prefill side: the open channel to `decode_id`, or a new one with a fresh epoch (whose
        connect completes in the background once the decode node joins)."""
        self._require_role("prefill")
        with self._lock:
            ch = self._lookup(decode_id)
            if ch is not None:
                return ch
            epoch = max(self._last_epoch.get(decode_id, -1) + 1, time.time_ns() // 1000)
            key = ChannelKey(self.config.node_id, decode_id, epoch)
            return self._open(decode_id, key, PREFILL_RANK, self._store_address)

    def channel_from(self, prefill_id: str, prefill_kv_address: str, epoch: int) -> Channel:
        """Decode side: the channel of `epoch` from `prefill_id`, opened (and any older one to that
        peer closed) if needed. Raises StaleEpochError for an epoch this node already left."""
        self._require_role("decode")
        with self._lock:
            current = self._channels.get(prefill_id)
            if current is not None and current.key.epoch == epoch and current.usable:
                self._channels.move_to_end(prefill_id)
                return current
            if epoch <= self._last_epoch.get(prefill_id, -1):
                raise StaleEpochError(f"epoch {epoch} from {prefill_id} is closed or superseded")
            if current is not None:
                current.close(f"superseded by epoch {epoch}")
            key = ChannelKey(prefill_id, self.config.node_id, epoch)
            return self._open(prefill_id, key, DECODE_RANK, NodeAddress.parse(prefill_kv_address))

    def close_peer(self, peer: str, why: str) -> bool:
        """Closes the channel with `peer` (its process was replaced: the pair group on the other end is
        gone), failing what is queued on it; the next transfer opens a fresh epoch. False if none."""
        with self._lock:
            ch = self._channels.pop(peer, None)
        if ch is None:
            return False
        ch.close(why)
        return True

    def _lookup(self, peer: str) -> Channel | None:
        ch = self._channels.get(peer)
        if ch is None:
            return None
        if not ch.usable:  # normally removed already by its down callback
            self._channels.pop(peer)
            return None
        self._channels.move_to_end(peer)
        return ch

    def _open(self, peer: str, key: ChannelKey, rank: int, store_address: NodeAddress) -> Channel:
        if self._closed:
            raise ChannelCapacityError("channel manager is closed")
        self._make_room()
        auth = None
        if rank == DECODE_RANK and self.config.token:
            auth = DialAuth(self.config.token, self.config.node_id, self.config.role, peer,
                            self.config.handshake_timeout_s)
        spec = ConnectSpec(
            key=key, rank=rank, store_address=store_address, backend=self._backend, device=self.config.device,
            timeout_s=self.config.connect_timeout_s, auth=auth,
        )
        gloo_device = self._gloo_device

        def connect() -> PairGroup:
            return connect_pair(spec, gloo_device)

        ch = Channel(
            key, rank, connect, self._device, host_mirror=self._backend == "gloo", on_down=self._on_down
        )
        self._channels[peer] = ch
        self._last_epoch[peer] = max(self._last_epoch.get(peer, -1), key.epoch)
        return ch

    def _make_room(self) -> None:
        while len(self._channels) >= self.config.max_channels:
            victim = next((p for p, ch in self._channels.items() if not ch.busy), None)
            if victim is None:
                raise ChannelCapacityError(f"all {self.config.max_channels} channels have transfers in flight")
            self._channels.pop(victim).close("evicted (least recently used)")

    def _on_down(self, ch: Channel) -> None:
        peer = ch.key.decode_id if ch.rank == PREFILL_RANK else ch.key.prefill_id
        with self._lock:
            if self._channels.get(peer) is ch:
                del self._channels[peer]
            self._retired.append(ch)

    def _require_role(self, role: str) -> None:
        if self.config.role != role:
            raise ValueError(f"this is a {self.config.role} node; only a {role} node may do that")

    # ----------------------------------------------------------------- upkeep
    def open_channels(self) -> list[ChannelKey]:
        """Keys of the channels currently open (connecting or ready), least recently used first."""
        with self._lock:
            return [ch.key for ch in self._channels.values() if ch.usable]

    def close_idle(self, now: float | None = None) -> list[ChannelKey]:
        """Closes channels idle for longer than `idle_timeout_s`; returns their keys."""
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [ch for ch in self._channels.values() if ch.idle_seconds(now) > self.config.idle_timeout_s]
        for ch in idle:
            ch.close("idle")
        return [ch.key for ch in idle]

    def _reap(self) -> None:
        while not self._stop.wait(self.config.reap_interval_s):
            now = time.monotonic()
            with self._lock:
                channels = list(self._channels.values())
            for ch in channels:
                ch.expire_overdue(now)
            self.close_idle(now)
            with self._lock:
                self._retired = [ch for ch in self._retired if not ch.join(0)]

    def close(self, join_timeout_s: float = 5.0) -> None:
        """Closes every channel, waits (up to `join_timeout_s` in all) for their workers to release
        their groups, then stops the store server. Idempotent. Call it before the interpreter exits:
        a group still being torn down by a worker thread during finalization aborts the process."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            channels = list(self._channels.values())
            self._channels.clear()
        self._stop.set()
        for ch in channels:
            ch.close("manager closed")
        deadline = time.monotonic() + join_timeout_s
        self._reaper.join(timeout=join_timeout_s)
        with self._lock:
            closed_earlier = list(self._retired)
            self._retired.clear()
        for ch in set(channels + closed_earlier):
            ch.join(max(0.0, deadline - time.monotonic()))
        if self._gate is not None:
            self._gate.close()
        self._server = None  # type: ignore[assignment]

    def __enter__(self) -> ChannelManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
