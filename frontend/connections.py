"""The frontend's gRPC connections to decode nodes, one per node address (`DecodeConnections`)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2_grpc

from pdserve.rpc import RpcSecurity
from pdserve.rpc import pdserve_pb2_grpc as pbg

_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # A restarted node should be reachable again within a fraction of a second, not after gRPC's
    # default reconnect backoff (which grows to two minutes).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.enable_retries", 0),
]


class DecodeConnections:
    """gRPC connections to decode nodes by address, opened on first use (changed by `stub` and `drop`)."""

    def __init__(self, security: RpcSecurity) -> None:
        self._security = security  # the cluster token (and CA) every call carries
        self._stubs: dict[str, pbg.DecodeNodeStub] = {}
        self._connections: dict[str, grpc.aio.Channel] = {}

    def stub(self, address: str) -> pbg.DecodeNodeStub:
        stub = self._stubs.get(address)
        if stub is None:
            connection = self._security.aio_channel(address, options=_OPTIONS)
            self._connections[address] = connection
            stub = self._stubs[address] = pbg.DecodeNodeStub(connection)
        return stub

    def health(self, address: str) -> health_pb2_grpc.HealthStub:
        """A grpc.health.v1 stub on the node's connection (the one its calls use)."""
        self.stub(address)
        return health_pb2_grpc.HealthStub(self._connections[address])

    async def drop(self, address: str) -> None:
        """Closes the connection to a node that left the cluster (calls in flight on it are cancelled)."""
        self._stubs.pop(address, None)
        connection = self._connections.pop(address, None)
        if connection is not None:
            await connection.close(grace=1.0)

    async def close(self) -> None:
        for address in list(self._connections):
            await self.drop(address)
