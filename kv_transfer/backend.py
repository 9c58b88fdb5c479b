"""Two-rank process groups built directly on c10d, without a global `init_process_group`.

Rendezvous: the prefill node hosts the pair's store. Each side opens its own TCPStore *client*
connection to the prefill node's `kv_address` and wraps it in
``PrefixStore(f"pair/{prefill_id}/{decode_id}/{epoch}")``; rank 0 is the prefill side, rank 1
the decode side. A dedicated client connection per connect keeps one slow rendezvous (a peer
that never shows up) from blocking the store for every other pair.

With a cluster token the decode side first authenticates to the prefill node's KV port
(`kv_transfer.auth.dial`) and its store client rides that connection through a loopback relay; the
prefill side reaches its own store on loopback directly.

Gloo binds its device to this node's own address (or a named interface), never to whatever the
hostname resolves to, so nodes in separate network namespaces advertise a reachable address.
"""

from __future__ import annotations

import datetime
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

from pdserve.kernels.interface import fp8_as_bytes
from pdserve.kv_transfer.auth import LoopbackRelay, dial
from pdserve.kv_transfer.types import ChannelError, ChannelKey, NodeAddress


class TransferTimeout(ChannelError):
    """A message did not complete before the transfer's deadline."""


class PendingOp(ABC):
    """One posted send or receive."""

    @abstractmethod
    def wait(self, deadline: float) -> None:
        """Blocks until the message completed or `deadline` (time.monotonic()) passed. Changes
        nothing but, on success, the posted receive buffer. Raises TransferTimeout or ChannelError."""


class PairGroup(ABC):
    """A connected two-rank process group. Messages between the ranks complete in posting order."""

    backend: str = "abstract"

    @abstractmethod
    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> PendingOp:
        """Posts `tensor` (contiguous) to `peer`. The caller must not write `tensor` until the op completes."""

    @abstractmethod
    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> PendingOp:
        """Posts a receive into `tensor` (contiguous); writes only `tensor`."""

    @abstractmethod
    def abort(self) -> None:
        """Marks the group unusable and interrupts pending ops where the backend can (NCCL; gloo
        ops run on to their own deadline). Callable from any thread."""

    @abstractmethod
    def close(self) -> None:
        """Drops the group. Its connections close once no op holds them, so the peer's pending and
        later ops fail at once instead of at their deadlines. Call after the last op finished."""


def _remaining(deadline: float) -> float:
    # A floor of 1 ms still lets an op that has already completed report success.
    return max(deadline - time.monotonic(), 0.001)


class _GlooOp(PendingOp):
    def __init__(self, work: torch._C._distributed_c10d.Work, what: str) -> None:
        self._work = work
        self._what = what

    def wait(self, deadline: float) -> None:
        try:
            self._work.wait(datetime.timedelta(seconds=_remaining(deadline)))
        except RuntimeError as e:
            msg = str(e)
            if "Timed out" in msg or "timed out" in msg:
                raise TransferTimeout(f"{self._what} timed out") from e
            raise ChannelError(f"{self._what} failed: {msg}") from e


class GlooPair(PairGroup):
    backend = "gloo"

    def __init__(self, pg: ProcessGroupGloo, relay: LoopbackRelay | None = None) -> None:
        self._pg: ProcessGroupGloo | None = pg
        self._relay = relay  # the authenticated store connection, when there is one

    def _live(self) -> ProcessGroupGloo:
        if self._pg is None:
            raise ChannelError("process group is closed")
        return self._pg

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> PendingOp:
        return _GlooOp(self._live().send([fp8_as_bytes(tensor)], peer, tag), "send")

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> PendingOp:
        return _GlooOp(self._live().recv([fp8_as_bytes(tensor)], peer, tag), "recv")

    def abort(self) -> None:
        pg = self._pg
        if pg is not None:
            try:
                pg.abort()
            except RuntimeError:  # already torn down
                pass

    def close(self) -> None:
        # Gloo closes its sockets only when the last reference to the group goes away; neither
        # abort() nor shutdown() does, so the peer would otherwise wait for its own deadline.
        self._pg = None
        if self._relay is not None:
            self._relay.close()


class _NcclOp(PendingOp):
    def __init__(self, work: torch._C._distributed_c10d.Work, what: str) -> None:
        self._work = work
        self._what = what

    def wait(self, deadline: float) -> None:
        # NCCL's Work.wait only orders the current stream; poll so the host sees completion and
        # a stuck peer becomes a timeout instead of a hang.
        delay = 1e-5
        while not self._work.is_completed():
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"{self._what} timed out")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        try:
            self._work.wait()  # surfaces an async NCCL error and orders the current stream after it
        except RuntimeError as e:
            raise ChannelError(f"{self._what} failed: {e}") from e


class NcclPair(PairGroup):
    backend = "nccl"

    def __init__(self, pg: Any, relay: LoopbackRelay | None = None) -> None:  # ProcessGroupNCCL, absent from CPU builds
        self._pg: Any = pg
        self._relay = relay

    def _live(self) -> Any:
        if self._pg is None:
            raise ChannelError("process group is closed")
        return self._pg

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> PendingOp:
        return _NcclOp(self._live().send([tensor], peer, tag), "send")

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> PendingOp:
        return _NcclOp(self._live().recv([tensor], peer, tag), "recv")

    def abort(self) -> None:
        pg = self._pg
        if pg is not None:
            try:
                pg.abort()  # ncclCommAbort: pending kernels on this side return
            except RuntimeError:
                pass

    def close(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except RuntimeError:
                pass
        if self._relay is not None:
            self._relay.close()


@dataclass(frozen=True)
class ConnectSpec:
    """Everything one side needs to join a pair's process group."""

    key: ChannelKey
    rank: int
    store_address: NodeAddress  # the prefill node's kv_address
    backend: str  # "gloo" or "nccl"
    device: str  # the KV cache's device
    timeout_s: float
    auth: DialAuth | None = None  # authenticate to store_address first (the decode side, with a token)


@dataclass(frozen=True)
class DialAuth:
    """What the decode side presents to the prefill node's KV port (`kv_transfer.auth`)."""

    token: str = field(repr=False)
    node_id: str  # this node
    role: str  # this node's role
    peer_id: str  # the node whose KV port it dials
    handshake_timeout_s: float


def create_gloo_device(address: NodeAddress, interface: str | None) -> ProcessGroupGloo.Device:
    """A gloo TCP device bound to this node's own address (or NIC). One per node, shared by its channels."""
    if interface:
        return ProcessGroupGloo.create_device(interface=interface, lazy_init=False)
    return ProcessGroupGloo.create_device(hostname=address.host, lazy_init=False)


def connect_pair(spec: ConnectSpec, gloo_device: ProcessGroupGloo.Device | None) -> PairGroup:
    """Joins the pair's rendezvous and returns the connected group. Blocks until the peer joins or
    `spec.timeout_s` passes (then raises ChannelError). Changes only the prefill node's store."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    relay: LoopbackRelay | None = None
    store_address = spec.store_address
    try:
        if spec.auth is not None:
            a = spec.auth
            sock = dial(spec.store_address, a.token, a.node_id, a.role, a.peer_id,
                        min(a.handshake_timeout_s, spec.timeout_s))
            relay = LoopbackRelay(sock, f"kv-relay-{spec.key.store_prefix}", accept_timeout_s=spec.timeout_s)
            store_address = relay.address
        client = TCPStore(store_address.host, store_address.port, is_master=False, timeout=timeout)
        store = PrefixStore(spec.key.store_prefix, client)
        if spec.backend == "gloo":
            if gloo_device is None:
                raise ChannelError("gloo channel needs a gloo device")
            opts = ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [gloo_device]
            opts._threads = 1  # send/recv never use gloo's collective worker threads
            return GlooPair(ProcessGroupGloo(store, spec.rank, 2, opts), relay)
        if spec.backend == "nccl":
            return NcclPair(_nccl_group(store, spec, timeout), relay)
        raise ChannelError(f"unknown channel backend {spec.backend!r}")
    except ChannelError:
        if relay is not None:
            relay.close()
        raise
    except (RuntimeError, ValueError) as e:
        if relay is not None:
            relay.close()
        raise ChannelError(f"connect {spec.key.store_prefix} as rank {spec.rank} failed: {e}") from e


def _nccl_group(store: PrefixStore, spec: ConnectSpec, timeout: datetime.timedelta) -> Any:
    try:
        from torch._C._distributed_c10d import ProcessGroupNCCL
    except ImportError as e:
        raise ChannelError("this torch build has no NCCL; use backend='gloo' for CUDA pools") from e
    device = torch.device(spec.device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    opts = ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timeout
    pg = ProcessGroupNCCL(store, spec.rank, 2, opts)
    # Build the communicator now, inside the connect timeout, rather than on the first send.
    pg.eager_connect_single_device(device)
    return pg
