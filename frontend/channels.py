"""gRPC channels from the frontend to decode nodes, one per node address (`UpstreamPool`)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2_grpc

from pdserve.rpc import RpcSecurity
from pdserve.rpc import pdserve_pb2_grpc as pbg

_CHANNEL_OPTIONS = [
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


class UpstreamPool:
    """gRPC channels to decode nodes by address, opened on first use (changed by `stub` and `drop`)."""

    def __init__(self, security: RpcSecurity) -> None:
        self._security = security  # the cluster token (and CA) every call carries
        self._stubs: dict[str, pbg.DecodeNodeStub] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, address: str) -> pbg.DecodeNodeStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = self._security.aio_channel(address, options=_CHANNEL_OPTIONS)
            self._channels[address] = channel
            stub = self._stubs[address] = pbg.DecodeNodeStub(channel)
        return stub

    def health(self, address: str) -> health_pb2_grpc.HealthStub:
        """A grpc.health.v1 stub on the node's channel (the one its calls use)."""
        self.stub(address)
        return health_pb2_grpc.HealthStub(self._channels[address])

    async def drop(self, address: str) -> None:
        """Closes the channel to a node that left the cluster (calls in flight on it are cancelled)."""
        self._stubs.pop(address, None)
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close(grace=1.0)

    async def close(self) -> None:
        for address in list(self._channels):
            await self.drop(address)
