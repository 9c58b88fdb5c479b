"""Messages, results, configuration and errors of the KV data plane.

Nothing here talks to the network: these are the values that cross the API (and, for
`TransferMeta`, the gRPC control plane, which carries it as a plain dict).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pdserve.registry.records import Role

BackendName = Literal["auto", "gloo", "nccl"]

# Rank of each side inside a pair's two-rank process group.
PREFILL_RANK = 0
DECODE_RANK = 1


class ChannelError(RuntimeError):
    """A channel cannot be opened or used (broken, closed, superseded or over capacity)."""


class StaleEpochError(ChannelError):
    """The metadata names a channel epoch this node has already closed or superseded."""


class ChannelCapacityError(ChannelError):
    """Every one of the `max_channels` open channels has work in flight, so none can be evicted."""


class ChannelState(enum.Enum):
    CONNECTING = "connecting"  # worker is inside the rendezvous
    READY = "ready"  # process group is up
    BROKEN = "broken"  # a transfer failed or timed out; never reused
    CLOSED = "closed"  # closed on purpose (idle, evicted, superseded, shutdown)


@dataclass(frozen=True)
class ChannelKey:
    """Identity of one pair channel. A new epoch means a new process group and a fresh sequence space."""

    prefill_id: str
    decode_id: str
    epoch: int

    @property
    def store_prefix(self) -> str:
        return f"pair/{self.prefill_id}/{self.decode_id}/{self.epoch}"


@dataclass(frozen=True)
class NodeAddress:
    """A node's `kv_address` (host:port). The host is also the address its gloo device binds to."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> NodeAddress:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"kv address must look like host:port, got {text!r}")
        if host.startswith("[") and host.endswith("]"):  # bracketed IPv6 literal
            host = host[1:-1]
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class ChannelConfig:
    """How one node opens and keeps its pair channels."""

    node_id: str
    role: Role
    kv_address: str  # host:port of this node's TCPStore server; port 0 picks a free port
    max_channels: int = 8
    # The decode side should keep channels longer than the prefill side: only the sender knows
    # when it will use a channel again, so the sender is the one that normally closes idle ones.
    idle_timeout_s: float = 60.0
    connect_timeout_s: float = 30.0
    backend: BackendName = "auto"  # auto: nccl for CUDA pools, gloo for CPU pools
    device: str = "cpu"  # the KV cache's device
    interface: str | None = None  # bind the gloo device to this NIC instead of kv_address's host
    reap_interval_s: float = 0.1  # how often idle channels and overdue queued transfers are checked
    # The cluster token (`kv_transfer.auth`): with one, the KV port admits only peers that prove they hold
    # it; "" = KV channels are not authenticated (the store listens on kv_address itself).
    token: str = field(default="", repr=False)
    handshake_timeout_s: float = 5.0  # a peer must finish the handshake within this, or it is refused

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        if self.max_channels < 1:
            raise ValueError("max_channels must be >= 1")
        if self.handshake_timeout_s <= 0:
            raise ValueError("handshake_timeout_s must be > 0")
        if NodeAddress.parse(self.kv_address).host in ("0.0.0.0", "::", "*"):
            # Gloo advertises the address it binds; a wildcard is not something a peer can dial.
            raise ValueError(f"kv_address must be this node's reachable address, got {self.kv_address!r}")

    @property
    def resolved_backend(self) -> Literal["gloo", "nccl"]:
        if self.backend == "auto":
            return "nccl" if self.device.startswith("cuda") else "gloo"
        return self.backend


@dataclass(frozen=True)
class TransferMeta:
    """What the decode node must know to receive one transfer; it travels over the control plane.

    The i-th block sent lands in the i-th destination block id the decode node passes to
    `KVReceiver.recv`; blocks the decode node already holds in its prefix cache are simply not
    part of the transfer. `seq_no` orders transfers within the channel epoch: the receiver executes
    them strictly in that order, which is what keeps concurrent transfers from mixing.
    """

    request_id: str
    prefill_id: str
    decode_id: str
    epoch: int
    seq_no: int
    num_blocks: int
    num_tokens: int  # prompt tokens whose KV the decode node will hold after this transfer
    layout_version: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    geometry: tuple[int, int, int, int]  # (L, BS, Hkv, D) of the sender's KV cache
    layers_per_message: int  # wire chunking: each message holds this many layers (the last may hold fewer)

    @property
    def channel_key(self) -> ChannelKey:
        return ChannelKey(self.prefill_id, self.decode_id, self.epoch)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["geometry"] = list(self.geometry)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransferMeta:
        fields = dict(d)
        fields["geometry"] = tuple(int(x) for x in fields["geometry"])
        return cls(**fields)


@dataclass
class PhaseSeconds:
    """Where one side spent a transfer's execution time, summed over its messages, in seconds. The
    rest of `TransferResult.seconds` is bookkeeping (posting ops, slot lookup, `on_layer` callbacks).
    A message a previous transfer packed or posted ahead (see `kv_transfer.transfer`) counts here,
    though its time fell inside the previous transfer's `seconds`."""

    layers: float = 0.0  # a layer-wise send waiting for the compute to mark layers ready
    copy: float = 0.0  # the sender's gather into staging, the receiver's scatter into the KV cache
    digest: float = 0.0  # the checksum pass over the staged bytes
    wire: float = 0.0  # in the transport: posting a send or receive, waiting for one to complete

    @property
    def total(self) -> float:
        return self.layers + self.copy + self.digest + self.wire


@dataclass(frozen=True)
class TransferResult:
    """Outcome of one transfer on one side. `seconds` covers execution on the channel worker;
    `queued_seconds` the wait before it (connect, earlier transfers, missing sequence numbers)."""

    ok: bool
    bytes: int
    seconds: float
    error: str | None = None
    request_id: str = ""
    seq_no: int = -1
    queued_seconds: float = 0.0
    # Digest of the transfer's bytes as staged on this side (`kv_transfer.checksum`): after packing on
    # the sender, on arrival on the receiver. None when nothing was digested (a failure, a discard).
    checksum: int | None = None
    # Per-phase split of `seconds` (None for a transfer that never ran).
    phases: PhaseSeconds | None = None

    @property
    def gib_per_s(self) -> float:
        return self.bytes / self.seconds / (1 << 30) if self.seconds > 0 else 0.0
