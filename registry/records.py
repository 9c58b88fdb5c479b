"""What nodes publish in etcd, and where.

Key layout (one versioned prefix per cluster; `v1` changes only with an incompatible layout):

    /pdserve/v1/<cluster>/nodes/<role>/<node_id>   NodeRecord JSON  (static while the node lives)
    /pdserve/v1/<cluster>/load/<role>/<node_id>    NodeLoad JSON    (rewritten about once a second)

`<role>` is "prefill" or "decode". Both keys of a node hang off the node's lease, so they vanish
together when the node revokes its lease (clean shutdown) or stops refreshing it (crash, partition).
node_id is unique across roles within a cluster.

Values are JSON objects carrying `"schema": SCHEMA_VERSION`. Readers ignore fields they don't know
(newer writers may add some) and reject a record whose schema is newer than theirs. A field added within a
schema has a default that means "not published", so records of older writers still read (e.g. a
NodeRecord without `tokenizer_digest`: its tokenizer is unknown).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, NamedTuple

SCHEMA_VERSION = 1
KEY_ROOT = "/pdserve/v1"
ROLES: tuple[str, ...] = ("prefill", "decode")

Role = Literal["prefill", "decode"]
KeyKind = Literal["nodes", "load"]


class RecordError(ValueError):
    """A registry value or key that cannot be decoded."""


def _pdserve_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "0+unknown"


def _check_name(kind: str, value: str) -> None:
    # Names become key path segments; a "/" would shift the layout and break parse_key.
    if not value or "/" in value:
        raise RecordError(f"{kind} must be non-empty and contain no '/', got {value!r}")


@dataclass(frozen=True)
class NodeCapacity:
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class NodeRecord:
    """A node's identity and the invariants its pool must share; written once per registration."""

    role: Role
    node_id: str
    cluster: str
    grpc_address: str  # "host:port" of the node's control-plane gRPC server
    kv_address: str  # "host:port" of the TCPStore rendezvous for KV channels
    model: str  # model name; the pool is (cluster, model)
    model_fingerprint: str
    dtype: str
    block_size: int
    prefix_hash_seed: int
    capacity: NodeCapacity
    pid: int = field(default_factory=os.getpid)
    hostname: str = field(default_factory=socket.gethostname)
    started_at: float = field(default_factory=time.time)  # unix seconds
    version: str = field(default_factory=_pdserve_version)  # pdserve version of the node
    colocated: bool = False  # a decode node that prefills every prompt itself (no prefill pool needed)
    # `engine.version.tokenizer_digest` / `chat_template_digest` of what the node loaded; "" unknown (an
    # older node). The frontend routes only to nodes whose digests are its own.
    tokenizer_digest: str = ""
    chat_template_digest: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise RecordError(f"role must be one of {ROLES}, got {self.role!r}")
        _check_name("node_id", self.node_id)
        _check_name("cluster", self.cluster)
        if self.block_size <= 0:
            raise RecordError(f"block_size must be > 0, got {self.block_size}")

    @property
    def key(self) -> str:
        return node_key(self.cluster, self.role, self.node_id)

    @property
    def load_key(self) -> str:
        return load_key(self.cluster, self.role, self.node_id)

    def to_json(self) -> bytes:
        return json.dumps({"schema": SCHEMA_VERSION, **asdict(self)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> NodeRecord:
        obj = _load_object(data, cls.__name__)
        try:
            obj["capacity"] = NodeCapacity(**_known(NodeCapacity, obj["capacity"]))
            return cls(**_known(cls, obj))
        except (KeyError, TypeError) as err:
            raise RecordError(f"{cls.__name__}: malformed record: {err}") from err


@dataclass(frozen=True)
class NodeLoad:
    """A node's load snapshot, republished about once a second; also what GetLoad answers and what
    /metrics reads. Every field is typed; a role leaves the fields of the other role at 0."""

    queue_len: int = 0  # requests waiting to be scheduled: `waiting` + `reservation_queue`
    running: int = 0  # sequences in the running batch
    kv_blocks_used: int = 0  # referenced by some sequence (held and reserved blocks included)
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0  # free blocks that still hold reusable prefix KV
    tokens_per_s: float = 0.0
    updated_at: float = field(default_factory=time.time)  # unix seconds, stamped by the publisher
    waiting: int = 0  # queued in the engine (new, preempted, or landed awaiting a slot)
    kv_blocks_total: int = 0
    kv_blocks_held: int = 0  # finished requests' blocks kept for a transfer (prefill: sends in flight)
    kv_blocks_reserved: int = 0  # decode: blocks reserved for transfers not yet landed
    reservation_queue: int = 0  # decode: requests waiting for blocks to be reserved
    in_flight: int = 0  # requests the node is serving, at any stage
    draining: bool = False  # the node finishes what it has and takes no new work

    def to_json(self) -> bytes:
        return json.dumps({"schema": SCHEMA_VERSION, **asdict(self)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> NodeLoad:
        obj = _load_object(data, cls.__name__)
        try:
            load = cls(**_known(cls, obj))
        except TypeError as err:
            raise RecordError(f"{cls.__name__}: malformed record: {err}") from err
        for f in fields(cls):
            value = getattr(load, f.name)
            kind = {"int": int, "float": (int, float), "bool": bool}[str(f.type)]
            if not isinstance(value, kind) or (f.type == "int" and isinstance(value, bool)):
                raise RecordError(f"{cls.__name__}: {f.name} must be {f.type}, got {value!r}")
        return load


def _load_object(data: bytes | str, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except ValueError as err:
        raise RecordError(f"{what}: not JSON: {err}") from err
    if not isinstance(obj, dict):
        raise RecordError(f"{what}: expected a JSON object, got {type(obj).__name__}")
    schema = obj.pop("schema", None)
    if not isinstance(schema, int) or schema > SCHEMA_VERSION:
        raise RecordError(f"{what}: unsupported schema {schema!r} (this reader knows <= {SCHEMA_VERSION})")
    return obj


def _known(cls: type, obj: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in obj.items() if k in names}


def cluster_prefix(cluster: str) -> str:
    """Prefix of every key of `cluster`, with the trailing slash (safe for prefix ranges)."""
    _check_name("cluster", cluster)
    return f"{KEY_ROOT}/{cluster}/"


def nodes_prefix(cluster: str) -> str:
    return f"{cluster_prefix(cluster)}nodes/"


def node_key(cluster: str, role: str, node_id: str) -> str:
    return f"{nodes_prefix(cluster)}{role}/{node_id}"


def load_key(cluster: str, role: str, node_id: str) -> str:
    return f"{cluster_prefix(cluster)}load/{role}/{node_id}"


class ParsedKey(NamedTuple):
    cluster: str
    kind: KeyKind
    role: str
    node_id: str


def parse_key(key: bytes | str) -> ParsedKey:
    """Splits a registry key into its parts; raises RecordError for keys outside the layout."""
    text = key.decode() if isinstance(key, bytes) else key
    root = KEY_ROOT + "/"
    parts = text[len(root) :].split("/") if text.startswith(root) else []
    if len(parts) != 4 or parts[1] not in ("nodes", "load") or parts[2] not in ROLES or not all(parts):
        raise RecordError(f"not a registry key: {text!r}")
    cluster, kind, role, node_id = parts
    return ParsedKey(cluster, "nodes" if kind == "nodes" else "load", role, node_id)
