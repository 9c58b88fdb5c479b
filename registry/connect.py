"""Reaching etcd: endpoints, retry backoff, client construction with endpoint failover, and which errors
count as transient (retried, never raised into serving code)."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import aetcd
import grpc

log = logging.getLogger(__name__)

# Errors that mean "etcd is unreachable or answered with a transient failure": retried, never raised
# into serving code. RevisionCompactedError is a ClientError too, so watchers resync on it.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (aetcd.ClientError, grpc.RpcError, TimeoutError, OSError)

class RegistryUnavailable(ConnectionError):
    """etcd could not be reached within the allotted time."""


class Endpoint(NamedTuple):
    host: str
    port: int


def parse_endpoint(endpoint: str) -> Endpoint:
    """Parses "host:port" (an optional http:// prefix is accepted, as etcd prints its URLs that way)."""
    text = endpoint.removeprefix("http://")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"etcd endpoint must be host:port, got {endpoint!r}")
    return Endpoint(host.strip("[]"), int(port))


@dataclass(frozen=True)
class BackoffPolicy:
    """Retry delays: initial_s, growing by factor up to max_s, each with +-jitter (a fraction)."""

    initial_s: float = 0.1
    max_s: float = 2.0
    factor: float = 2.0
    jitter: float = 0.2

    def delays(self) -> Iterator[float]:
        """Yields an endless sequence of delays; start a new iterator to reset."""
        delay = self.initial_s
        while True:
            yield delay * random.uniform(1.0 - self.jitter, 1.0 + self.jitter)
            delay = min(delay * self.factor, self.max_s)


class EtcdConnector:
    """Makes aetcd clients over a list of endpoints, moving to the next endpoint after a failure."""

    def __init__(self, endpoints: Sequence[str], rpc_timeout_s: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is required")
        self.endpoints = [parse_endpoint(e) for e in endpoints]
        self.rpc_timeout_s = rpc_timeout_s
        self._index = 0

    def client(self) -> aetcd.Client:
        """A new client (and gRPC channel) for the current endpoint; connects lazily."""
        host, port = self.endpoints[self._index]
        options = {
            # Detect a silently dead connection under a long-lived watch stream. 10 s stays above
            # etcd's default --grpc-keepalive-min-time (5 s), below which etcd drops the connection.
            "grpc.keepalive_time_ms": 10_000,
            "grpc.keepalive_timeout_ms": 5_000,
            "grpc.keepalive_permit_without_calls": 0,
        }
        return aetcd.Client(host=host, port=port, timeout=self.rpc_timeout_s, options=options)

    def failed(self) -> None:
        """Marks the current endpoint as failing, so the next client uses the next one."""
        self._index = (self._index + 1) % len(self.endpoints)

    def describe(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)


async def close_quietly(client: aetcd.Client | None) -> None:
    """Closes a client, ignoring errors (it is usually being dropped because etcd went away)."""
    if client is None:
        return
    try:
        await asyncio.wait_for(client.close(), timeout=2.0)
    except (*TRANSIENT_ERRORS, RuntimeError) as err:
        log.debug("closing etcd client: %r", err)


async def cancel_and_wait(task: asyncio.Task[None], what: str, timeout_s: float = 5.0) -> None:
    """Cancels a background task and waits for it to end, at most `timeout_s`: a task stuck in an etcd call
    that ignores cancellation (seen once after etcd restarted without its data) must not hang close().
    Left running past the timeout, it is logged and abandoned. Raises nothing."""
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        log.warning("%s: background task did not stop within %.0fs of its cancellation; abandoned", what, timeout_s)
    elif not task.cancelled() and task.exception() is not None:
        log.warning("%s: background task ended with %r", what, task.exception())
