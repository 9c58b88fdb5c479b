"""gRPC client side of the control plane: one channel per decode node, and the Generate request message.

Cancelling a Generate call (what the frontend does when the client goes away) resets the HTTP/2
stream at once; the decode node aborts the request, cancels its Prefill call on the prefill node, and
both free the request's KV blocks.
"""

from __future__ import annotations

import logging

import grpc

from frontend.protocol import SamplingOptions
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pbg

log = logging.getLogger(__name__)

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

# Errors before the first token that mean "this node cannot take the request now": try another node.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


def sampling_message(opts: SamplingOptions, max_tokens: int, seed: int | None) -> pb.SamplingParams:
    """The proto SamplingParams for one choice (its own max_tokens and seed)."""
    params = pb.SamplingParams(
        temperature=opts.temperature,
        top_p=opts.top_p,
        top_k=opts.top_k,
        presence_penalty=opts.presence_penalty,
        frequency_penalty=opts.frequency_penalty,
        repetition_penalty=opts.repetition_penalty,
        max_tokens=max_tokens,
        stop=list(opts.stop),
        ignore_eos=opts.ignore_eos,
    )
    if seed is not None:
        params.seed = seed
    if opts.logprobs is not None:
        params.logprobs = opts.logprobs
    return params


class UpstreamPool:
    """gRPC channels to decode nodes by address, opened on first use (changed by `stub` and `drop`)."""

    def __init__(self) -> None:
        self._stubs: dict[str, pbg.DecodeNodeStub] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, address: str) -> pbg.DecodeNodeStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            self._channels[address] = channel
            stub = self._stubs[address] = pbg.DecodeNodeStub(channel)
        return stub

    async def drop(self, address: str) -> None:
        """Closes the channel to a node that left the cluster (calls in flight on it are cancelled)."""
        self._stubs.pop(address, None)
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close(grace=1.0)

    async def close(self) -> None:
        for address in list(self._channels):
            await self.drop(address)
