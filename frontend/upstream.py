"""gRPC client side of the control plane (connections: `frontend.connections`): the Generate request message, and
the upstream calls of a job (`UpstreamCalls`): one Generate call per choice, retried on another decode
node while nothing was sent to the client, moved to another decode node when its stream breaks later,
and the merged stream of their messages.

Migration: a choice whose stream breaks mid-way for a reason of the node (the node died or became
unreachable, ended the stream without finishing, failed the request, or handed it over while draining)
is re-issued on another decode node of the pool with `resume_token_ids` / `resume_text_chars` = the
completion tokens and characters the client already has; that node continues after them, so the client
sees one uninterrupted stream (greedy and seeded output equal to a run without the failure). At most
`max_migrations` moves per choice; then the client gets the error. Client errors (INVALID_ARGUMENT) and
the deadline are not migrated.

A traced job's Generate calls carry the `traceparent` of their `frontend.upstream` span in the gRPC
metadata (`frontend.tracing`); untraced calls carry none.

Cancelling a Generate call (what the frontend does when the client goes away) resets the HTTP/2
stream at once; the decode node aborts the request, cancels its Prefill call on the prefill node, and
both free the request's KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator
from typing import Literal

import grpc
from grpc_health.v1 import health_pb2

from pdserve.frontend.config import FrontendConfig
from pdserve.frontend.connections import DecodeConnections
from pdserve.frontend.errors import OVERLOADED, SERVER, APIError
from pdserve.frontend.job import Choice, Job, UpstreamError
from pdserve.frontend.metrics import FrontendMetrics
from pdserve.frontend.protocol import SamplingOptions
from pdserve.frontend.routing import NoRoute, Router
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc.enums import finish_reason_name

log = logging.getLogger(__name__)

# Errors before the first token that mean "this node cannot take the request now": try another node.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
# Errors that break a running stream for a reason of the node, not of the request: the choice moves to
# another decode node. CANCELLED reaches the frontend only from the peer's side (the frontend's own
# cancel raises asyncio.CancelledError instead).
MIGRATABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
                        grpc.StatusCode.UNKNOWN})
# How long a decode node that left the registry has to answer a health check before the calls streaming
# from it count as broken (a draining node answers; a hung one does not).
PROBE_TIMEOUT_S = 2.0
# Finish reasons that complete a choice.
_DONE_FINISH = frozenset({pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH})
# Finish reasons that end a stream without ending the choice -> the migration metric's reason label
# (the others: a status code's name, "eof", and "node_left" for a call cancelled here because its node
# left the registry and stopped answering, or its connection was closed). Any other finish reason (ABORT)
# ends the choice with an error. HAND_OVER is a draining decode node's: the request is not done.
_BROKEN_FINISH = {pb.FINISH_REASON_HAND_OVER: "hand_over", pb.FINISH_REASON_ERROR: "node_error"}
Ending = Literal["", "done", "broken", "failed"]


def _ending(msg: pb.GenerateResponse) -> Ending:
    """What a message does to its choice, judged here only: "" (more follows), "done" (the choice is
    complete), "broken" (its node stopped without finishing it: another node continues it) or "failed"
    (the choice ends with an error)."""
    if not msg.finished:
        return ""
    if msg.finish_reason in _DONE_FINISH:
        return "done"
    return "broken" if msg.finish_reason in _BROKEN_FINISH else "failed"


def sampling_message(opts: SamplingOptions, max_tokens: int, seed: int | None, speculative: str = "") -> pb.SamplingParams:
    """The proto SamplingParams for one choice (its own max_tokens and seed; ``speculative``: its model's
    setting from the models file)."""
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
        priority=opts.priority or 0,
        speculative=speculative,
    )
    if seed is not None:
        params.seed = seed
    if opts.logprobs is not None:
        params.logprobs = opts.logprobs
    if opts.logit_bias:
        params.logit_bias.update(opts.logit_bias)
    if opts.structured is not None:
        params.structured.kind = opts.structured.kind
        params.structured.schema_json = opts.structured.schema_json
    return params


def _finish_error(c: Choice, msg: pb.GenerateResponse) -> APIError:
    node = msg.decode_node_id or c.decision.decode_id  # the node serving the choice now
    if msg.finish_reason == pb.FINISH_REASON_ABORT:
        return APIError(502, f"decode node {node} aborted the request", type=SERVER, code="upstream_aborted")
    why = msg.error or finish_reason_name(msg.finish_reason)
    return APIError(502, f"generation failed on decode node {node}: {why}", type=SERVER,
                    code="upstream_error")


def _gave_up(c: Choice, broken: Broken, why: str) -> APIError:
    """The error of a choice that broke and could not be moved (again)."""
    return APIError(502, f"The request failed and could not be moved to another decode node ({why}): "
                    f"{broken.error.message}", type=SERVER, code=broken.error.code or "upstream_error")


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


class PoolFailed(Exception):
    """No decode node of the pool could start a choice (each one tried refused, was unreachable or
    failed before a first message); nothing was sent to the client. Carries the APIError to report."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


class Broken(Exception):
    """A choice's stream broke (or its call could not start) for a reason of the decode node, which
    another node of the pool can work around."""

    def __init__(self, reason: str, error: APIError) -> None:
        super().__init__(error.message)
        self.reason = reason  # a bounded metric label: a status code name, "eof", "hand_over", "node_error"
        self.error = error  # what the client gets when no other node can take over


def _has_output(msg: pb.GenerateResponse) -> bool:
    return bool(msg.token_ids or msg.text or msg.logprobs)


class UpstreamCalls:
    """Starts and reads the Generate calls of jobs (changes each choice's call, decision, lease, delivery
    and progress fields; marks failing nodes in the router; counts migrations)."""

    def __init__(self, config: FrontendConfig, router: Router, connections: DecodeConnections,
                 metrics: FrontendMetrics) -> None:
        self._config, self._router, self._connections, self._metrics = config, router, connections, metrics
        self._live: weakref.WeakSet[Choice] = weakref.WeakSet()  # choices whose call was started

    async def open(self, job: Job) -> list[pb.GenerateResponse]:
        """Starts every choice's Generate call and returns each one's first message. Raises PoolFailed
        (every call it started is cancelled then) or APIError."""
        if len(job.choices) == 1:
            return [await self._start(job, job.choices[0])]
        tasks = [asyncio.ensure_future(self._start(job, c)) for c in job.choices]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            for c in job.choices:
                if c.call is not None:
                    c.call.cancel()
            raise

    async def _start(self, job: Job, c: Choice) -> pb.GenerateResponse:
        """The choice's first message, trying other decode nodes (up to `upstream_attempts` in all) while
        nodes refuse, cannot be reached or fail before a first message. Raises PoolFailed, or APIError
        for the request's own errors."""
        while True:
            try:
                return await self._open(job, c)
            except Broken as broken:
                failed = c.decision.decode_id
                if len(c.tried) >= self._config.upstream_attempts or not self._reroute(job, c):
                    raise PoolFailed(broken.error) from None
                self._metrics.retries.labels(*self._metrics.labels(job.model), broken.reason).inc()
                log.warning("request %s: decode node %s failed before the first token (%s); retrying on %s",
                            c.request_id, failed, broken.error.message, c.decision.decode_id)

    async def _open(self, job: Job, c: Choice) -> pb.GenerateResponse:
        """Sends the choice's Generate request to its current decode node (resuming after what was
        delivered) and returns the first message. Raises Broken when the node cannot serve it (refused,
        unreachable, or failed it before any output), APIError for the request's own errors."""
        d = c.decision
        c.tried.append(d.decode_id)
        request = pb.GenerateRequest(
            request_id=c.request_id, attempt=len(c.tried) - 1,
            prompt_token_ids=c.prompt_ids, params=c.params, prefill_node_id=d.prefill_hint, return_text=True,
            resume_token_ids=c.delivered_ids, resume_text_chars=c.delivered_chars,
        )
        now = time.monotonic()
        if c.progress.first_at is None:  # the TTFT breakdown's frontend part ends at the last dispatch before it
            c.progress.dispatched_at = now
        left = self._config.request_timeout_s - (now - job.arrived)
        # A traced job's call carries its span's traceparent: the decode node's spans become its children.
        metadata = job.trace.call_started(job, c, now) if job.trace is not None else None
        c.call = self._connections.stub(d.decode_address).Generate(request, timeout=max(1.0, left), metadata=metadata)
        self._live.add(c)
        try:
            msg = await self._read(c, opening=True)
        except UpstreamError as err:
            raise err.error from None
        if _ending(msg) == "broken" and not _has_output(msg):
            raise Broken(_BROKEN_FINISH[msg.finish_reason], _finish_error(c, msg))
        return msg

    async def _read(self, c: Choice, opening: bool) -> pb.GenerateResponse:
        """The next message of the choice's call. Raises Broken for failures another node can work
        around (the node is avoided for a while), UpstreamError for the others."""
        node = c.decision.decode_id
        try:
            msg = await c.call.read()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the job itself is cancelled (the client went away): no failure
            # Only the call was cancelled, here: its node stopped answering (`node_left`) or its connection closed.
            self._router.mark_unavailable(node)
            raise Broken("node_left", APIError(502, f"decode node {node} left the cluster and stopped answering",
                                               type=SERVER, code="upstream_error")) from None
        except grpc.aio.AioRpcError as err:
            code = err.code()
            if code in MIGRATABLE or (opening and code in RETRYABLE):
                self._router.mark_unavailable(node)
                raise Broken(code.name.lower(), _rpc_error(err, node, started=not opening)) from None
            raise UpstreamError(_rpc_error(err, node, started=True)) from None
        if msg is grpc.aio.EOF:
            self._router.mark_unavailable(node)
            raise Broken("eof", APIError(502, f"decode node {node} ended the stream "
                                         f"{'without a response' if opening else 'early'}", type=SERVER,
                                         code="upstream_error"))
        return msg

    async def node_left(self, node_id: str) -> int:
        """A decode node left the registry. When it does not answer a health check within
        PROBE_TIMEOUT_S (hung, or gone without a connection reset), the calls streaming from it are
        cancelled, so their choices migrate; a node that answers (a draining one) ends its requests itself.
        Returns how many calls were cancelled."""
        calls = [c for c in self._live
                 if c.decision.decode_id == node_id and c.progress.finish_reason is None and c.call is not None
                 and not c.call.done()]
        if not calls:
            return 0
        try:
            await self._connections.health(calls[0].decision.decode_address).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=PROBE_TIMEOUT_S)
            return 0
        except grpc.aio.AioRpcError as err:
            log.warning("decode node %s left the registry and does not answer (%s): moving %d stream(s) off it",
                        node_id, err.code().name, len(calls))
        cancelled = 0
        for c in calls:
            if c.decision.decode_id == node_id and c.call is not None and not c.call.done():
                c.call.cancel()
                cancelled += 1
        return cancelled

    def _reroute(self, job: Job, c: Choice, retry_tried: bool = False) -> bool:
        """Moves the choice's route (and lease) to a decode node it has not tried, or, with `retry_tried`
        and none left, to any node but the one that just failed (a node that failed an earlier attempt may
        serve again; the router avoids it while it cools down). False when there is none."""
        pool, current = job.model.pool, c.decision.decode_id
        excludes = [frozenset(c.tried)] + ([frozenset({current})] if retry_tried else [])
        for exclude in excludes:
            try:
                fresh = self._router.route(pool, c.prompt_ids, c.max_tokens, job.session_key, exclude=exclude)
            except NoRoute:
                continue
            break
        else:
            return False
        c.lease.release()
        c.decision, c.lease = fresh, self._router.lease(fresh)
        return True

    async def _migrate(self, job: Job, c: Choice, broken: Broken) -> pb.GenerateResponse:
        """Re-issues a broken choice on another decode node, resuming after what was delivered, and
        returns the new call's first message. Raises UpstreamError (with the last failure) once
        `max_migrations` moves are spent or no untried node is left."""
        while True:
            failed = c.decision.decode_id
            if c.migrations >= self._config.max_migrations:
                raise UpstreamError(_gave_up(c, broken, f"{c.migrations} migration(s) already"))
            if not self._reroute(job, c, retry_tried=True):
                raise UpstreamError(_gave_up(c, broken, "no other decode node can take it"))
            c.migrations += 1
            self._metrics.migrations.labels(*self._metrics.labels(job.model), broken.reason).inc()
            log.warning("request %s: stream from decode node %s broke (%s: %s) after %d token(s); moving it to %s",
                        c.request_id, failed, broken.reason, broken.error.message, len(c.delivered_ids),
                        c.decision.decode_id)
            try:
                return await self._open(job, c)
            except Broken as again:
                broken = again
            except APIError as err:  # the new node rejected the request itself: the response has started
                raise UpstreamError(err) from None

    async def _follow(self, job: Job, c: Choice, msg: pb.GenerateResponse) -> AsyncIterator[pb.GenerateResponse]:
        """The choice's messages from `msg` (its first) to the one that completes it, each recorded
        (`_arrived`) before it is given, across migrations: a stream that breaks continues on another
        node, and a hand-over or node-failure message gives its output (if any) as an unfinished message.
        Raises UpstreamError, also for a message that ends the choice with an error (once recorded)."""
        while True:
            ending = _ending(msg)
            if ending == "broken":
                broken = Broken(_BROKEN_FINISH[msg.finish_reason], _finish_error(c, msg))
                if _has_output(msg):
                    part = pb.GenerateResponse(request_id=msg.request_id, token_ids=msg.token_ids, text=msg.text,
                                               logprobs=msg.logprobs)
                    self._arrived(c, part)
                    yield part
                msg = await self._migrate(job, c, broken)
                continue
            self._arrived(c, msg)
            if ending == "failed":
                raise UpstreamError(_finish_error(c, msg))
            if ending == "done":
                c.progress.finish(msg)
                yield msg
                return
            yield msg
            try:
                msg = await self._read(c, opening=False)
            except Broken as broken:
                msg = await self._migrate(job, c, broken)

    @staticmethod
    def _arrived(c: Choice, msg: pb.GenerateResponse) -> None:
        """Records a message the client is given: what a resume continues after, and the choice's progress."""
        c.delivered_ids.extend(msg.token_ids)
        c.delivered_chars += len(msg.text)
        if msg.token_ids:
            c.lease.prefill_done()  # the current node's prefill (a migrated choice's too) is done
        c.progress.record(msg, time.monotonic(), migrated=c.migrations > 0)

    async def messages(self, job: Job, firsts: list[pb.GenerateResponse]
                       ) -> AsyncIterator[tuple[Choice, pb.GenerateResponse]]:
        """Every upstream message of the job as it arrives, tagged with its choice and recorded in its
        progress (migrations hidden). Raises UpstreamError when a choice fails."""
        if len(job.choices) == 1:  # the common case, without the queue
            c = job.choices[0]
            async for msg in self._follow(job, c, firsts[0]):
                yield c, msg
            return
        queue: asyncio.Queue[tuple[Choice, pb.GenerateResponse | UpstreamError]] = asyncio.Queue()

        async def pump(c: Choice, first: pb.GenerateResponse) -> None:
            try:
                async for msg in self._follow(job, c, first):
                    queue.put_nowait((c, msg))
            except UpstreamError as err:
                queue.put_nowait((c, err))

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
