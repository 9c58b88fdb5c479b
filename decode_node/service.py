"""The decode node's gRPC service (RPCs only): it takes requests, prefills short ones itself, has the
rest prefilled on a prefill node whose KV it receives, and streams the generated tokens.

Generate, per request:
  1. Route: the prefill node is the caller's hint while that node is usable, else what the cluster's one
     prefill rule (`registry.placement`) picks; none (or force_local_prefill, or an uncached prompt part
     below the threshold, or with --max-prefill-queue-tokens a full queue at that node while this node's
     own prefill backlog is shorter) means local prefill, an ordinary engine request the engine queues
     until it fits.
  2. Reservation (remote path): the prompt's blocks are reserved before any prefill work is spent
     (`decode_node.reservations`).
  3. The prefill and the KV transfer (`decode_node.remote`), after which the request lands in the engine.
  4. Tokens are streamed, batched per message when several are waiting (`decode_node.responses`).

A resumed request (resume_token_ids: completion tokens another decode node already delivered) follows
the same steps with prompt + those tokens as its context; responses carry only the tokens after them,
num_completion_tokens counts them too (`engine.sequence.Resume`).

Drain: once the drain's grace (`--drain-grace`) is over, `hand_over` ends every request still here with
FinishReason.HAND_OVER (after the tokens it produced) and frees its blocks; the frontend resumes it on
another decode node.

Every request is one `DecodeRequest` (`decode_node.request`) in `requests`, from arrival until the
engine let go of it.

Tracing on (`ctx.tracer`): the caller's `traceparent` (gRPC metadata) is the parent of the request's
spans (`decode_node.trace`); the Prefill call carries the KV wait span's.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc

from pdserve.decode_node import trace
from pdserve.decode_node.config import DecodeNodeConfig
from pdserve.decode_node.metrics import DecodeMetrics
from pdserve.decode_node.remote import PrefillLink
from pdserve.decode_node.request import REMOTE_WAITS, DecodeRequest, RemotePrefill, Stage, context_ids
from pdserve.decode_node.reservations import ReservationQueue, ReservationRefused
from pdserve.decode_node.responses import response
from pdserve.engine.async_engine import RequestStream, abort_output
from pdserve.engine.llm_engine import EngineRequests
from pdserve.engine.sequence import Resume
from pdserve.engine.stopping import FinishReason
from pdserve.node_common.config import setup_logging
from pdserve.node_common.convert import call_key, params_from_proto
from pdserve.node_common.embed import EmbedServer
from pdserve.node_common.faults import NodeFaults, load_faults
from pdserve.node_common.runtime import run_node
from pdserve.node_common.service import NodeContext, NodeService
from pdserve.registry import Member
from pdserve.registry.placement import choose_prefill, usable_prefill
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class DecodeService(NodeService, pb_grpc.DecodeNodeServicer):
    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        assert isinstance(ctx.config, DecodeNodeConfig)
        self.config: DecodeNodeConfig = ctx.config
        assert isinstance(ctx.metrics, DecodeMetrics)
        self.metrics: DecodeMetrics = ctx.metrics
        self.requests: dict[str, DecodeRequest] = {}
        self.reservations = ReservationQueue(ctx, self.config.reservation_queue_limit,
                                             self.config.reservation_timeout_s)
        self.link = PrefillLink(ctx, self.config, self.metrics, self._end)
        self._vocab = ctx.engine.engine.model_config.vocab_size
        self.handover_after_s = self.config.drain_grace_s
        ctx.engine.on_blocks_freed(self.reservations.kick)
        self.embeds = EmbedServer(self, self.metrics)  # the Embed RPC, when colocated (node_common.embed)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_DecodeNodeServicer_to_server(self, server)

    def request_stages(self) -> Mapping[str, str]:
        return {rid: req.stage.value for rid, req in list(self.requests.items())}

    def reservation_queue(self) -> int:
        return len(self.reservations)

    # -- RPCs -----------------------------------------------------------------------------------------

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        return self.load_response()

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        req = self.requests.get(call_key(request.request_id, request.attempt))
        if req is None or req.stage == Stage.ENDING:
            return pb.AbortResponse(found=False)
        self._cancel(req)
        req.stream.push(abort_output(req.key))
        return pb.AbortResponse(found=True)

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        if not self.config.colocated:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "embeddings are served by the prefill pool (this decode node is not colocated)")
        return await self.embeds.embed(request, context)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        arrived = time.monotonic()
        tracer = self.ctx.tracer
        span = trace.start_request(tracer, context, request, self.config.node_id, arrived) if tracer else None
        try:
            req = await self._accept(request, context, arrived, span)
        except BaseException as err:
            if tracer is not None:
                trace.refused(tracer, span, context, err)
            raise
        completion = len(req.resume.token_ids) if req.resume is not None else 0  # resumed ones count
        first = True
        last: pb.GenerateResponse | None = None
        timing: pb.Timing | None = None  # the latest reported (the last message's is complete)
        try:
            while True:
                batch = await req.stream.next_batch()
                completion += sum(len(o.new_token_ids) for o in batch)
                last = response(request, req, batch, completion, first, self.config.node_id, self.metrics)
                if last.HasField("timing"):
                    timing = last.timing
                yield last
                first = False
                if batch[-1].finished:
                    break
        finally:
            if not req.stream.finished:  # the caller went away: stop the work and free its blocks
                self._cancel(req)
            elif req.stage == Stage.IN_ENGINE and self.requests.get(req.key) is req:
                self._forget(req)  # finished in the engine, which already freed its blocks
            if tracer is not None:
                trace.end_request(tracer, req, timing, last)

    # -- accepting a request --------------------------------------------------------------------------

    async def _accept(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, arrived: float, span: Any
    ) -> DecodeRequest:
        """Validates and registers the request, starting it locally or reserving its blocks and starting
        its remote prefill. Aborts the call (INVALID_ARGUMENT, ALREADY_EXISTS, RESOURCE_EXHAUSTED,
        UNAVAILABLE) when it cannot be taken."""
        await self.refuse_if_draining(context)
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        rid = call_key(request_id, request.attempt)
        prompt = list(request.prompt_token_ids)
        try:
            params = params_from_proto(request.params)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if not prompt or any(not 0 <= t < self._vocab for t in prompt):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt must be non-empty ids in [0, {self._vocab})")
        resume = self._resume(request)
        if isinstance(resume, str):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, resume)
        if rid in self.requests:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already running")
        # A resumed request is prefilled (here or remotely, by the usual rules) from prompt + resumed tokens.
        ids = context_ids(prompt, resume)
        local = request.force_local_prefill or self.config.colocated
        prefill = None if local else self._prefill_node(request.prefill_node_id, ids)
        if prefill is not None:
            hit, backlog = await self.ctx.engine.call(lambda e: (e.prefix_hit_tokens(ids), e.prefill_backlog_tokens()))
            if len(ids) - hit < self.config.local_prefill_threshold:
                prefill = None
            elif self._prefill_queue_full(prefill.node_id, backlog):
                self.metrics.queue_local_prefill()
                prefill = None
        if prefill is None:
            req = DecodeRequest(rid, request_id, request.attempt, prompt, params, arrived, RequestStream(rid),
                                Stage.IN_ENGINE, resume=resume, span=span)
            return await self._start_local(req, context)
        req = DecodeRequest(rid, request_id, request.attempt, prompt, params, arrived, RequestStream(rid),
                            Stage.WAITING_FOR_BLOCKS, RemotePrefill(prefill), resume=resume, span=span)
        return await self._start_remote(req, context)

    @staticmethod
    def _resume(request: pb.GenerateRequest) -> Resume | None | str:
        """The request's resume point (None: a new request), or why it is malformed. The engine checks
        the rest when it takes the request, as INVALID_ARGUMENT too (ids in the vocabulary, fewer than
        max_tokens, the context length, a resumed token that would have ended it, text beyond what the
        resumed tokens release)."""
        if not request.resume_token_ids:
            return "resume_text_chars without resume_token_ids" if request.resume_text_chars else None
        try:
            return Resume(tuple(request.resume_token_ids), request.resume_text_chars)
        except ValueError as err:
            return str(err)

    def _prefill_queue_full(self, node_id: str, local_backlog: int) -> bool:
        """Whether a new request should be prefilled here rather than on `node_id` (with
        --max-prefill-queue-tokens set): this node's requests waiting there (for blocks or for the remote
        K/V) hold at least that many context tokens, and this node's own prefill backlog is smaller."""
        bound = self.config.max_prefill_queue_tokens
        if bound <= 0:
            return False
        queued = sum(len(r.context_ids) for r in self.requests.values()
                     if r.stage in REMOTE_WAITS and r.prefill_id == node_id)
        return queued >= bound and local_backlog < queued

    def _prefill_node(self, hint: str, ids: list[int]) -> Member | None:
        """The hinted prefill node while it is usable (in this node's pool, not draining), else the one the
        cluster's prefill rule picks (None: none is usable)."""
        members = self.ctx.view.members(role="prefill", model=self.config.model_name)
        pool = usable_prefill(members, self.ctx.fingerprint, self.config.engine.block_size)
        by_id = {m.node_id: m for m in pool}
        if hint in by_id:
            return by_id[hint]
        outstanding: dict[str, int] = {}
        for req in self.requests.values():
            if req.remote is not None and req.stage in REMOTE_WAITS:
                outstanding[req.prefill_id] = outstanding.get(req.prefill_id, 0) + 1
        choice = choose_prefill(pool, ids, outstanding)
        return by_id.get(choice.node_id)

    async def _start_local(self, req: DecodeRequest, context: grpc.aio.ServicerContext) -> DecodeRequest:
        if self.ctx.engine.load().waiting >= self.config.max_local_waiting:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode node queue is full")
        self._register(req)
        rid = req.key
        try:
            req.stream = await self.ctx.engine.add_request(rid, req.prompt, req.params, resume=req.resume)
        except ValueError as err:
            self._forget(req)  # the engine refused it: nothing to free
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except BaseException:
            self._end_later(req)  # the add may still run: the abort follows it
            raise
        return req

    async def _start_remote(self, req: DecodeRequest, context: grpc.aio.ServicerContext) -> DecodeRequest:
        rid, arrived = req.key, req.arrived
        self._register(req)
        req.stream = self.ctx.engine.open_stream(rid)
        try:
            req.reservation = await self.reservations.reserve(req)
        except (ReservationRefused, ValueError) as err:
            await self._end(req)  # a reservation granted just as the wait ran out is given back here
            code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(err, ValueError) else grpc.StatusCode.RESOURCE_EXHAUSTED
            await context.abort(code, str(err))
        except BaseException:
            # Cancelled while a reservation may have been made: the abort queued now runs after it.
            self._end_later(req)
            raise
        req.timing.reservation_wait_s = time.monotonic() - arrived
        req.advance(Stage.WAITING_FOR_REMOTE_KV)
        self.ctx.spawn(self.link.drive(req), f"drive-{rid}")
        return req

    # -- the request table ----------------------------------------------------------------------------

    def _register(self, req: DecodeRequest) -> DecodeRequest:
        """Adds a request to the table before the engine hears of it."""
        assert req.key not in self.requests
        self.requests[req.key] = req
        return req

    def _forget(self, req: DecodeRequest) -> None:
        """Drops a request the engine no longer holds."""
        if self.requests.get(req.key) is req:
            del self.requests[req.key]
        self.ctx.engine.close_stream(req.key)
        self.metrics.forget(req.key)

    async def _end(self, req: DecodeRequest) -> None:
        """Ends a request wherever it is: tells the caller why (if still listening), has the engine drop
        it (freeing its blocks), then forgets it. Only called once no receive can still write its blocks."""
        if req.stage != Stage.ENDING:
            req.advance(Stage.ENDING)
        if not req.stream.finished:
            req.stream.push(abort_output(req.key, FinishReason.ABORT if req.cancelled else FinishReason.ERROR))
        try:
            await self.ctx.engine.abort(req.key)
        except RuntimeError:
            pass  # the engine is stopped: it holds nothing any more
        self._forget(req)

    def _end_later(self, req: DecodeRequest) -> None:
        """`_end` in a task of its own; the request is ENDING from now on."""
        if req.stage != Stage.ENDING:
            req.advance(Stage.ENDING)
        self.ctx.spawn(self._end(req), f"end-{req.key}")

    def _cancel(self, req: DecodeRequest) -> None:
        """The caller is gone: stop the request wherever it is."""
        if req.stage == Stage.IN_ENGINE:
            req.cancelled = True
            self._end_later(req)
        elif req.stage == Stage.WAITING_FOR_REMOTE_KV:
            self.link.cancel(req)  # its driver frees what it holds
        else:
            req.cancelled = True  # WAITING_FOR_BLOCKS: its Generate call ends it; ENDING: on its way out

    def on_member_left(self, node_id: str) -> None:
        self.link.prefill_left(node_id, list(self.requests.values()))

    # -- integrity, drain and shutdown ----------------------------------------------------------------

    def check_requests(self, before: Mapping[str, str], engine: EngineRequests) -> None:
        requests = dict(self.requests)
        for rid, req in requests.items():
            assert req.key == rid
            req.check()
        self.reservations.check_integrity(requests)
        # Reserved blocks belong to requests that were waiting for blocks or the remote K/V, or ending (a
        # request whose stage said IN_ENGINE had its `land` queued before the engine's ids were read).
        holding = {rid for rid, stage in before.items() if stage != Stage.IN_ENGINE.value}
        assert engine.reserved <= holding, (
            f"reservations of requests not waiting for remote K/V: {sorted(engine.reserved - holding)}")
        # Held (finished at the first token) blocks wait for the driver, which frees them.
        assert engine.held <= holding, (
            f"held blocks of requests not waiting for remote K/V: {sorted(engine.held - holding)}")
        untracked = self.metrics.tracked() - before.keys() - requests.keys()
        assert not untracked, f"metric records of unknown requests: {sorted(untracked)}"

    async def quiesce(self, deadline: float) -> None:
        # Frontends route by registry membership and retry UNAVAILABLE elsewhere, so new work stops now;
        # the lease stays until no request waits on a prefill node, which drops its sends to a node
        # that leaves the registry.
        self.accepting = False
        loop = asyncio.get_running_loop()
        while loop.time() < deadline and (self.embeds.in_flight
                                          or any(r.stage in REMOTE_WAITS for r in self.requests.values())):
            await asyncio.sleep(0.02)

    def hand_over(self) -> int:
        """Ends every request still here so that its caller continues it on another node, and frees its
        blocks: the stream of a request in the engine or waiting for its remote K/V ends with finish_reason
        FinishReason.HAND_OVER after the tokens already produced (the engine aborts one in the engine; the driver of one
        waiting for its K/V cancels its prefill and frees its reservation); a request still waiting for
        blocks is refused (it has streamed nothing; its caller tries another node). Returns how many
        requests were handed over."""
        moved = self.reservations.refuse_all("the decode node is draining")
        for req in list(self.requests.values()):
            if req.stage not in (Stage.IN_ENGINE, Stage.WAITING_FOR_REMOTE_KV) or req.stream.finished:
                continue
            req.stream.push(abort_output(req.key, FinishReason.HAND_OVER))
            if req.stage == Stage.IN_ENGINE:
                self._end_later(req)
            else:
                self.link.cancel(req)
            moved += 1
        return moved

    async def close(self) -> None:
        for req in list(self.requests.values()):
            self._cancel(req)
            rem = req.remote
            if rem is not None and rem.channel is not None and req.stage == Stage.WAITING_FOR_REMOTE_KV:
                rem.channel.close("decode node shutting down")
        deadline = time.monotonic() + 5.0
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await self.link.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m decode_node` (and `pdserve decode`)."""
    config, log_level = DecodeNodeConfig.from_argv(argv)
    setup_logging(log_level)
    return asyncio.run(run_node(config, "decode", DecodeService, DecodeMetrics, load_faults(NodeFaults)))
