"""gRPC client side of the control plane: one channel per decode node, the Generate request message, and
the upstream calls of a job (`UpstreamCalls`): one Generate call per choice, retried on another decode
node while nothing was sent to the client, and the merged stream of their messages.

Cancelling a Generate call (what the frontend does when the client goes away) resets the HTTP/2
stream at once; the decode node aborts the request, cancels its Prefill call on the prefill node, and
both free the request's KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from frontend.config import FrontendConfig
from frontend.errors import OVERLOADED, SERVER, APIError
from frontend.job import Choice, Job, UpstreamError
from frontend.protocol import SamplingOptions
from frontend.routing import NoRoute, Router
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pbg
from rpc import RpcSecurity

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

    def __init__(self, security: RpcSecurity) -> None:
        self._security = security
        self._stubs: dict[str, pbg.DecodeNodeStub] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, address: str) -> pbg.DecodeNodeStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = self._security.aio_channel(address, options=_CHANNEL_OPTIONS)
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


def _finish_error(c: Choice, msg: pb.GenerateResponse) -> APIError:
    if msg.finish_reason == "abort":
        return APIError(502, f"decode node {c.decode_node or c.decision.decode_id} aborted the request",
                        type=SERVER, code="upstream_aborted")
    return APIError(502, f"generation failed on decode node {c.decode_node or c.decision.decode_id}: "
                    f"{msg.error or msg.finish_reason}", type=SERVER, code="upstream_error")


def _rpc_error(err: grpc.aio.AioRpcError, node: str, started: bool) -> APIError:
    code = err.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, "The request timed out on the serving node.", type=SERVER, code="timeout")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, f"The serving node rejected the request: {err.details()}", code="invalid_request")
    if not started and code in RETRYABLE:
        return APIError(503, f"No serving node could take the request (last: {node}: {err.details()}).",
                        type=OVERLOADED, code="upstream_unavailable", headers={"retry-after": "1"})
    return APIError(502, f"The serving node {node} failed: {code.name}: {err.details()}", type=SERVER,
                    code="upstream_error")


class UpstreamCalls:
    """Starts and reads the Generate calls of jobs (changes each choice's call, decision, lease and
    progress fields; marks refusing nodes in the router)."""

    def __init__(self, config: FrontendConfig, router: Router, pool: UpstreamPool) -> None:
        self._config, self._router, self._pool = config, router, pool

    async def open(self, job: Job) -> list[pb.GenerateResponse]:
        """Starts every choice's Generate call and returns each one's first message. Raises APIError."""
        if len(job.choices) == 1:
            return [await self._start(job, job.choices[0])]
        tasks = [asyncio.ensure_future(self._start(job, c)) for c in job.choices]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            raise

    async def _start(self, job: Job, c: Choice) -> pb.GenerateResponse:
        while True:
            d = c.decision
            c.tried.append(d.decode_id)
            request = pb.GenerateRequest(request_id=c.request_id, prompt_token_ids=c.prompt_ids,
                                         params=c.params, prefill_node_id=d.prefill_id, return_text=True)
            c.dispatched_at = time.perf_counter()
            c.call = self._pool.stub(d.decode_address).Generate(request, timeout=self._config.request_timeout_s)
            try:
                msg = await c.call.read()
            except grpc.aio.AioRpcError as err:
                if err.code() in RETRYABLE:
                    self._router.mark_unavailable(d.decode_id)
                if err.code() in RETRYABLE and len(c.tried) < self._config.upstream_attempts:
                    try:
                        fresh = self._router.route(job.model.pool, c.prompt_ids, c.max_tokens, job.session_key,
                                                  exclude=frozenset(c.tried))
                    except NoRoute:
                        raise _rpc_error(err, d.decode_id, started=False) from None
                    log.warning("request %s: decode node %s unavailable (%s); retrying on %s", c.request_id,
                                d.decode_id, err.details(), fresh.decode_id)
                    c.lease.release()
                    c.decision, c.lease = fresh, self._router.lease(fresh)
                    continue
                raise _rpc_error(err, d.decode_id, started=False) from None
            if msg is grpc.aio.EOF:
                raise APIError(502, f"decode node {d.decode_id} ended the stream without a response", type=SERVER,
                               code="upstream_error")
            if msg.finished and msg.finish_reason not in ("stop", "length"):
                raise _finish_error(c, msg)
            return msg

    @staticmethod
    async def _next(c: Choice) -> pb.GenerateResponse:
        """The choice's next upstream message; UpstreamError when the node fails or ends the stream early."""
        try:
            msg = await c.call.read()
        except grpc.aio.AioRpcError as err:
            raise UpstreamError(_rpc_error(err, c.decision.decode_id, started=True)) from None
        if msg is grpc.aio.EOF:
            raise UpstreamError(APIError(502, f"decode node {c.decision.decode_id} ended the stream early",
                                         type=SERVER, code="upstream_error"))
        return msg

    async def messages(self, job: Job, firsts: list[pb.GenerateResponse]
                        ) -> AsyncIterator[tuple[Choice, pb.GenerateResponse]]:
        """Every upstream message of the job as it arrives, tagged with its choice."""
        if len(job.choices) == 1:  # the common case, without the queue
            c, msg = job.choices[0], firsts[0]
            while True:
                yield c, msg
                if msg.finished:
                    return
                msg = await self._next(c)
        queue: asyncio.Queue[tuple[Choice, pb.GenerateResponse | UpstreamError]] = asyncio.Queue()

        async def pump(c: Choice, msg: pb.GenerateResponse) -> None:
            while True:
                queue.put_nowait((c, msg))
                if msg.finished:
                    return
                try:
                    msg = await self._next(c)
                except UpstreamError as err:
                    queue.put_nowait((c, err))
                    return

        tasks = [asyncio.ensure_future(pump(c, f)) for c, f in zip(job.choices, firsts, strict=True)]
        remaining = len(tasks)
        try:
            while remaining:
                c, item = await queue.get()
                if isinstance(item, UpstreamError):
                    raise item
                if item.finished:
                    remaining -= 1
                yield c, item
        finally:
            for t in tasks:
                t.cancel()

    @staticmethod
    def progress(c: Choice, msg: pb.GenerateResponse, now: float) -> None:
        n = len(msg.token_ids)
        if n:
            if c.first_at is None:
                c.first_at = now
                c.lease.prefill_done()
            elif c.last_at is not None:
                c.itls.append(now - c.last_at)
            c.last_at = now
            c.tokens += n
        if c.timing is None and msg.HasField("timing"):
            c.timing = msg.timing
            c.prefill_node, c.decode_node = msg.prefill_node_id, msg.decode_node_id
        if msg.finished:
            if msg.finish_reason not in ("stop", "length"):
                raise UpstreamError(_finish_error(c, msg))
            c.finish_reason = msg.finish_reason
            c.stop_reason = msg.stop_reason
            c.cached_tokens = msg.num_cached_tokens
            c.cached_prefill = msg.num_cached_tokens_prefill
            c.cached_decode = msg.num_cached_tokens_decode
            if msg.num_completion_tokens:
                c.tokens = msg.num_completion_tokens
            if msg.prefill_node_id:
                c.prefill_node = msg.prefill_node_id
            if msg.decode_node_id:
                c.decode_node = msg.decode_node_id
