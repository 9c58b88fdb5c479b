"""The cluster registry: nodes register in etcd under a lease, everyone else watches.

Key layout and record formats: `registry.records`. Registration and its failure model:
`registry.client`. Live membership: `registry.view`. A loopback etcd for tests and local clusters:
`registry.etcd_server`.
"""

from __future__ import annotations

from pdserve.registry.client import (
    POOL_INVARIANTS,
    NodeRegistration,
    RegistrationRefused,
    RegistrationState,
    RegistrationStatus,
)
from pdserve.registry.connect import BackoffPolicy, RegistryUnavailable, parse_endpoint
from pdserve.registry.etcd_server import EtcdNotFoundError, EtcdServer, EtcdStartError, find_etcd_binary
from pdserve.registry.records import (
    KEY_ROOT,
    SCHEMA_VERSION,
    NodeCapacity,
    NodeLoad,
    NodeRecord,
    RecordError,
    cluster_prefix,
    load_key,
    node_key,
    parse_key,
)
from pdserve.registry.view import Member, RegistryView, ViewChange

__all__ = [
    "KEY_ROOT",
    "POOL_INVARIANTS",
    "SCHEMA_VERSION",
    "BackoffPolicy",
    "EtcdNotFoundError",
    "EtcdServer",
    "EtcdStartError",
    "Member",
    "NodeCapacity",
    "NodeLoad",
    "NodeRecord",
    "NodeRegistration",
    "RecordError",
    "RegistrationRefused",
    "RegistrationState",
    "RegistrationStatus",
    "RegistryUnavailable",
    "RegistryView",
    "ViewChange",
    "cluster_prefix",
    "find_etcd_binary",
    "load_key",
    "node_key",
    "parse_endpoint",
    "parse_key",
]
