"""The prefill node's gRPC service.

A Prefill call queues a prefill-only request in the engine (sampling params of the caller, one token,
blocks held after it finishes); the engine's scheduler batches every queued prefill under its token
budget and uses the prefix cache. The send of the request's blocks (all of its prompt blocks except the
ones the decode node already caches) goes over the pair channel, announced with TransferStart;
TransferDone follows once the send completes.

Layer-wise sends (the default; `--no-layerwise-send` turns them off): in the engine step that computes
the request's last prompt chunk, before its forward runs, the engine thread queues the send layer by
layer and announces it (`_LayerSends`, through the engine's prefill watcher, engine.step_hook); each
layer is released to the channel as the forward finishes it, so the transfer overlaps the prefill's
compute. The first token goes out as FirstToken as soon as it is sampled, after TransferStart. A request
whose first token must end it (max_tokens) ships nothing; one that turns out to end at its first token
(EOS, a stop token) had its send announced already and completes it (the decode node discards it).
Without layer-wise sends the send is queued after FirstToken went out.

Tests inject faults through the node's fault hook (`prefill_node.faults`), which in production does nothing.

Tracing on (`ctx.tracer`): the decode node's `traceparent` (gRPC metadata) is the parent of the
request's span; its queue, compute and KV send spans are cut, when the call ends, from the times
FirstToken and TransferDone reported (`_trace`).

Blocks are released when the send resolves, when the request is aborted before any send was queued,
or when the decode node's registry lease disappears (which closes the pair channel, so a send blocked on
a dead peer resolves at once instead of at the transfer timeout).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import threading
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.engine.async_engine import RequestStream
from pdserve.engine.llm_engine import EngineRequests, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.schedule import stop_decision
from pdserve.engine.sequence import Resume, Sequence
from pdserve.engine.step_hook import LayerHook
from pdserve.kernels import get_kernel_ops
from pdserve.kernels.interface import KV_LAYOUT_VERSION
from pdserve.kv_transfer import Channel, ChannelError, SendHandle, TransferResult
from pdserve.kv_transfer.checksum import CHECKSUM_ALGO
from pdserve.node_common.config import setup_logging
from pdserve.node_common.convert import logprob_to_proto, params_from_proto, transfer_start_to_proto
from pdserve.node_common.faults import load_faults
from pdserve.node_common.runtime import run_node
from pdserve.node_common.service import NodeContext, NodeService
from pdserve.prefill_node.config import PrefillNodeConfig
from pdserve.prefill_node.faults import PrefillFaults
from pdserve.prefill_node.metrics import PrefillMetrics, PrefillTiming
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as pb_grpc
from pdserve.rpc.tracing import TTFT_STAGE

log = logging.getLogger(__name__)


class Stage(enum.Enum):
    """Where a Prefill call is (`request_stages` reports the values)."""

    IN_ENGINE = "in_engine"  # the engine's scheduler owns it, until its first token (then its blocks are held)
    SENDING = "sending"  # the send of its blocks is queued; they are held until it resolves
    ENDING = "ending"  # the call is over: blocks are given back once no send reads them


_NEXT = {Stage.IN_ENGINE: {Stage.SENDING, Stage.ENDING}, Stage.SENDING: {Stage.ENDING}, Stage.ENDING: set()}


@dataclass(frozen=True)
class EarlySend:
    """What the engine thread needs to queue a request's layer-wise send: the source blocks are
    block_table[skip : skip + count] of the request's sequence."""

    skip: int
    count: int
    num_tokens: int


@dataclass(eq=False)
class PrefillCall:
    """One Prefill call on this node, from arrival until the engine let go of its blocks."""

    request_id: str
    decode_id: str
    arrived: float
    stage: Stage = Stage.IN_ENGINE
    aborted: str | None = None  # why, once aborted (caller's Abort, decode node gone, shutdown)
    handle: SendHandle | None = None  # set once the send is queued; blocks are held until it resolves
    channel: Channel | None = None
    # The blocks were given back although the send had not resolved (the decode node's lease lapsed):
    # whatever the send still ships is reported as failed, so the decode node never uses it.
    released: bool = False
    # Set when the send is to be queued by the engine thread in the step of the last prompt chunk.
    early: EarlySend | None = None
    # Set (on the event loop) once the engine thread queued the early send.
    announced: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    # What its spans are made of (tracing on): the request's span, the times FirstToken reported, when
    # the send was queued (time.monotonic) and how it went.
    span: Any = None
    timing: PrefillTiming | None = None
    send_queued_at: float | None = None
    send_result: TransferResult | None = None

    def advance(self, stage: Stage) -> None:
        """Moves to `stage`; asserts the move is allowed."""
        assert stage in _NEXT[self.stage], f"request {self.request_id}: {self.stage.name} -> {stage.name}"
        self.stage = stage


class PrefillService(NodeService, pb_grpc.PrefillNodeServicer):
    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        assert isinstance(ctx.config, PrefillNodeConfig)
        self.config: PrefillNodeConfig = ctx.config
        assert isinstance(ctx.metrics, PrefillMetrics)
        self.metrics: PrefillMetrics = ctx.metrics
        self.calls: dict[str, PrefillCall] = {}
        self.faults = load_faults(PrefillFaults)
        engine_config = ctx.config.engine
        self._sender = self.faults.new_sender(get_kernel_ops(engine_config.kernel_backend, engine_config.device))
        engine = ctx.engine.engine
        self._eos = engine.tokenizer.eos_token_ids
        self._kv_dtype = str(engine.kv_cache.dtype).removeprefix("torch.")
        # Serialises the moves of a request's send state (handle, channel, stage, aborted) between the
        # event loop and the engine thread, which queues layer-wise sends.
        self._send_lock = threading.Lock()
        self._loop = asyncio.get_running_loop()
        if self.config.layerwise_send:
            ctx.engine.post(lambda e: setattr(e, "prefill_watcher", self._prefills_completing))

    def request_stages(self) -> Mapping[str, str]:
        return {rid: call.stage.value for rid, call in list(self.calls.items())}

    def in_flight(self) -> int:
        return sum(1 for call in list(self.calls.values()) if not call.released)

    def check_requests(self, before: Mapping[str, str], engine: EngineRequests) -> None:
        assert not engine.reserved, f"a prefill node reserves nothing: {sorted(engine.reserved)}"
        for rid, call in dict(self.calls).items():
            assert call.request_id == rid
            if call.stage == Stage.SENDING:
                assert call.handle is not None and call.channel is not None
        # A prefill still in the engine belongs to a call in the engine, or ending and about to abort it.
        # A layer-wise send is queued in the step that completes its prefill, so between steps (when this
        # runs) no request whose send is queued is still scheduled either.
        early = engine.scheduled - {rid for rid, stage in before.items() if stage != Stage.SENDING.value}
        assert not early, f"engine computes prefills whose send is already queued: {sorted(early)}"

    def add_to_server(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_PrefillNodeServicer_to_server(self, server)

    # -- RPCs -----------------------------------------------------------------------------------------

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        return self.load_response()

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        call = self.calls.get(request.request_id)
        if call is None:
            return pb.AbortResponse(found=False)
        self._abort(call, "aborted by the decode node")
        return pb.AbortResponse(found=True)

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PrefillResponse]:
        params = await self._accept(request, context)
        prompt, resume = self._split_resumed(request)
        call = PrefillCall(request.request_id, request.decode_node_id, time.monotonic())
        tracer = self.ctx.tracer
        if tracer is not None:  # child of the decode node's KV wait span (its traceparent in the metadata)
            call.span = tracer.span(
                "prefill.request", parent=tracer.extract(context.invocation_metadata() or ()), start=call.arrived,
                kind="server", attributes={"rpc.system": "grpc", "rpc.method": "PrefillNode/Prefill",
                                           "pdserve.request_id": call.request_id, "pdserve.node": self.config.node_id,
                                           "pdserve.decode_node": call.decode_id,
                                           "pdserve.prompt_tokens": len(request.prompt_token_ids)})
        # The decode node applies stop strings and max_tokens; here only the first token is sampled
        # (the one after a resumed request's resumed tokens, which the engine counts as completion).
        num_resumed = len(resume.token_ids) if resume is not None else 0
        first_params = dataclasses.replace(params, max_tokens=num_resumed + 1, stop=[])
        call.early = self._early_send(request, params, num_resumed)
        self.calls[call.request_id] = call
        try:
            try:
                if num_resumed >= params.max_tokens:
                    raise ValueError(f"{num_resumed} resumed tokens leave nothing of max_tokens ({params.max_tokens})")
                stream = await self.ctx.engine.add_request(
                    call.request_id, prompt, first_params, hold_blocks=True, resume=resume)
            except ValueError as err:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            async for msg in self._serve(call, request, params, stream):
                yield msg
        finally:
            # Also reached when the caller's stream is cancelled (its process died or it gave up):
            # blocks are handed back once no send can still be reading them.
            with self._send_lock:  # from here on the engine thread queues no send for it
                call.advance(Stage.ENDING)
            if call.handle is not None and not call.handle.done() and call.channel is not None:
                call.channel.close(f"Prefill call for {call.request_id} ended while its send was in flight")
            self.ctx.spawn(self._finish(call), f"prefill-finish-{call.request_id}")
            if call.span is not None:
                self._trace(call)

    async def _accept(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> SamplingParams:
        """The request's sampling parameters; aborts the call when it cannot be taken."""
        await self.refuse_if_draining(context)
        problem = self._check(request, list(request.prompt_token_ids))
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            params = params_from_proto(request.params)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if request.request_id in self.calls:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request {request.request_id!r} is already being prefilled")
        if len(self.calls) >= self.config.max_pending:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "prefill queue is full")
        return params

    def _early_send(self, request: pb.PrefillRequest, params: SamplingParams, num_resumed: int) -> EarlySend | None:
        """Whether the request's send is queued layer by layer in the step of its last prompt chunk
        (see the module docstring), and what it ships; None: after the first token, if at all."""
        cfg = self.config
        if not cfg.layerwise_send or not request.dst_block_ids:
            return None
        if num_resumed + 1 >= params.max_tokens:
            return None  # the first token is the last one: nothing will be shipped
        return EarlySend(request.num_skip_blocks, len(request.dst_block_ids), len(request.prompt_token_ids))

    async def _first_output(self, call: PrefillCall, stream: RequestStream) -> AsyncIterator[
            pb.PrefillResponse | list[RequestOutput]]:
        """Yields TransferStart as soon as the engine thread queued an early send (before or while the
        step runs), then the request's first batch of outputs. The announcement is handed to the loop
        before the step's outputs, so a queued send is always announced before the first token."""
        outputs = asyncio.ensure_future(stream.next_batch())
        try:
            if call.early is not None:
                announced = asyncio.ensure_future(call.announced.wait())
                try:
                    await asyncio.wait({outputs, announced}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    announced.cancel()
            if call.handle is not None:
                yield pb.PrefillResponse(transfer_start=self._transfer_start(call.handle))
            yield await outputs
        finally:
            outputs.cancel()

    async def _serve(
        self, call: PrefillCall, request: pb.PrefillRequest, params: SamplingParams, stream: RequestStream,
    ) -> AsyncIterator[pb.PrefillResponse]:
        batch: list[RequestOutput] = []
        async for item in self._first_output(call, stream):
            if isinstance(item, list):
                batch = item
            else:
                yield item
        out = batch[-1]
        if not out.new_token_ids or (call.aborted and call.handle is None):
            if call.handle is not None:
                # An announced send whose step failed (or the node is closing): its bytes are drained by
                # the decode node, which keeps the pair channel in step, and reported failed.
                await call.handle.wait()
            yield pb.PrefillResponse(transfer_done=pb.TransferDone(ok=False, error=call.aborted or "aborted"))
            return
        token = out.new_token_ids[0]
        yield pb.PrefillResponse(first_token=self._first_token(call, out))
        if call.handle is None:
            grammar_finish = stream.seq.grammar_finish if stream.seq is not None else None
            if (stop_decision(params, self._eos, token, out.num_completion_tokens, grammar_finish) is not None
                    or not request.dst_block_ids):
                # The decode node is done with this request (or already holds every block): nothing to ship.
                yield pb.PrefillResponse(transfer_done=pb.TransferDone(ok=True, skipped=True))
                return
            await self.faults.after_first_token(call)
            seq = stream.seq
            assert seq is not None and seq.is_finished, "a prefill-only request finishes with its first token"
            start = request.num_skip_blocks
            started = self._start_send(call, seq.block_table[start : start + len(request.dst_block_ids)],
                                       len(request.prompt_token_ids))
            yield started
            if call.handle is None:
                return  # `started` said why nothing is sent
        result = await call.handle.wait()
        call.send_result = result
        self.metrics.transfer_done(result, (call.aborted or "released") if call.released else None)
        if call.released:
            yield pb.PrefillResponse(transfer_done=pb.TransferDone(ok=False, error=call.aborted or "released"))
            return
        yield pb.PrefillResponse(transfer_done=pb.TransferDone(
            ok=result.ok, error=result.error or "", transfer_s=result.seconds,
            kv_checksum=result.checksum or 0, kv_checksum_algo=CHECKSUM_ALGO if result.checksum is not None else "",
        ))

    def _first_token(self, call: PrefillCall, out: RequestOutput) -> pb.FirstToken:
        first = pb.FirstToken(token_id=out.new_token_ids[0], num_cached_tokens=out.num_cached_tokens)
        timing = self.metrics.first_token(call.request_id, call.arrived)
        call.timing = timing
        if timing is not None:
            first.queue_s, first.prefill_s = timing.queue_s, timing.prefill_s
        else:  # the engine thread's record is missing (it cannot be, short of a bug): all of it is prefill
            first.prefill_s = time.monotonic() - call.arrived
        if out.new_logprobs:
            first.logprob.CopyFrom(logprob_to_proto(out.new_logprobs[0]))
        return first

    def _trace(self, call: PrefillCall) -> None:
        """The Prefill call is over: its stage spans, from the times FirstToken and TransferDone reported
        (so each lasts what the TTFT breakdown says), then the request's span."""
        tracer = self.ctx.tracer
        assert tracer is not None
        if call.timing is not None:
            started = call.arrived + call.timing.queue_s
            tracer.span("prefill.queue", parent=call.span, start=call.arrived, end=started,
                        attributes={TTFT_STAGE: "prefill_queue"})
            tracer.span("prefill.compute", parent=call.span, start=started, end=started + call.timing.prefill_s,
                        attributes={TTFT_STAGE: "prefill"})
        result = call.send_result
        if result is not None and call.send_queued_at is not None:
            # The channel worker's own clock: it started `queued_seconds` after the send was queued.
            start = call.send_queued_at + result.queued_seconds
            send = tracer.span("prefill.kv_send", parent=call.span, start=start,
                               attributes={TTFT_STAGE: "transfer", "pdserve.bytes": result.bytes})
            tracer.finish(send, start + result.seconds, error=None if result.ok else result.error or "failed")
        tracer.finish(call.span, time.monotonic(), error=call.aborted)

    def _transfer_start(self, handle: SendHandle) -> pb.TransferStart:
        return transfer_start_to_proto(handle.meta, self.ctx.channels.kv_address)

    def _queue_send(self, call: PrefillCall, src_blocks: list[int], num_tokens: int, layerwise: bool) -> str | None:
        """The one place a send is queued: under the send lock, unless the request was aborted or its
        call ended, queues the send of `src_blocks` and moves the request to SENDING (its blocks are held
        until the send resolves). Any thread. Returns why nothing was queued, or None."""
        with self._send_lock:
            if call.aborted or call.stage != Stage.IN_ENGINE:
                return call.aborted or "the Prefill call ended"
            try:
                channel = self.ctx.channels.channel_to(call.decode_id)
                handle = self._sender.send(
                    channel, self.ctx.engine.engine.kv_cache, src_blocks, request_id=call.request_id,
                    num_tokens=num_tokens, timeout_s=self.config.transfer_timeout_s, layerwise=layerwise,
                )
            except (ChannelError, ValueError) as err:
                return f"send not queued: {err}"
            call.channel, call.handle = channel, handle
            call.send_queued_at = time.monotonic()
            call.advance(Stage.SENDING)
        return None

    def _start_send(self, call: PrefillCall, src_blocks: list[int], num_tokens: int) -> pb.PrefillResponse:
        """Queues the send of `src_blocks` after the first token went out (SENDING from then on) and
        returns its TransferStart, or the TransferDone saying why nothing is sent. No await: an Abort
        cannot slip in before the send."""
        error = self._queue_send(call, src_blocks, num_tokens, layerwise=False)
        if error is not None:
            if error.startswith("send not queued"):
                self.metrics.transfer_done(None, error)
            return pb.PrefillResponse(transfer_done=pb.TransferDone(ok=False, error=error))
        assert call.handle is not None
        return pb.PrefillResponse(transfer_start=self._transfer_start(call.handle))

    # -- the engine thread ----------------------------------------------------------------------------

    def _prefills_completing(self, seqs: list[Sequence]) -> LayerHook | None:
        """The engine's prefill watcher (engine thread, before the forward of the step that computes the
        last prompt chunk of `seqs`): queues the layer-wise send of every such request that wants one
        and tells the loop to announce it. A send that cannot be queued is left to the path after the
        first token, which tries again and reports why."""
        handles: list[SendHandle] = []
        for seq in seqs:
            call = self.calls.get(seq.seq_id)
            early = call.early if call is not None else None
            if call is None or early is None:
                continue
            src = seq.block_table[early.skip : early.skip + early.count]
            if self._queue_send(call, src, early.num_tokens, layerwise=True) is None:
                assert call.handle is not None
                handles.append(call.handle)
                self._loop.call_soon_threadsafe(call.announced.set)
        if not handles:
            return None
        self.metrics.layerwise_queued(len(handles))
        return _LayerSends(handles)

    # -- helpers --------------------------------------------------------------------------------------

    @staticmethod
    def _split_resumed(request: pb.PrefillRequest) -> tuple[list[int], Resume | None]:
        """The prompt and, for a resumed request (num_prompt_tokens set and short of the whole), the
        completion tokens after it. `_check` has validated num_prompt_tokens."""
        ids = list(request.prompt_token_ids)
        n = request.num_prompt_tokens or len(ids)
        return ids[:n], Resume(tuple(ids[n:])) if n < len(ids) else None

    def _check(self, request: pb.PrefillRequest, prompt: list[int]) -> str | None:
        cfg = self.config.engine
        if not request.request_id:
            return "request_id is required"
        if not prompt:
            return "the prompt is empty"
        if not 0 <= request.num_prompt_tokens <= len(prompt):
            return f"num_prompt_tokens {request.num_prompt_tokens} is outside [0, {len(prompt)}]"
        if request.block_size != cfg.block_size:
            return f"block size {request.block_size} differs from this node's {cfg.block_size}"
        if request.model_fingerprint and request.model_fingerprint != self.ctx.fingerprint:
            return "model fingerprint differs from this node's"
        if request.kv_dtype and request.kv_dtype != self._kv_dtype:
            return f"kv dtype {request.kv_dtype} differs from this node's {self._kv_dtype}"
        if request.layout_version and request.layout_version != KV_LAYOUT_VERSION:
            return f"KV layout version {request.layout_version} is not {KV_LAYOUT_VERSION}"
        num_blocks = -(-len(prompt) // cfg.block_size)
        if request.num_skip_blocks < 0 or request.num_skip_blocks + len(request.dst_block_ids) != num_blocks:
            return (
                f"{request.num_skip_blocks} skipped + {len(request.dst_block_ids)} destination blocks do not "
                f"cover the prompt's {num_blocks} blocks"
            )
        if not request.decode_node_id:
            return "decode_node_id is required"
        return None

    def _abort(self, call: PrefillCall, reason: str) -> None:
        """Marks the request aborted. Before its send is queued the engine drops it (freeing its blocks);
        a queued send is left to finish or fail, since the decode node drains or discards it."""
        with self._send_lock:  # no send is queued after this unless it already was
            if call.aborted is None:
                call.aborted = reason
            queued = call.handle is not None
        if not queued:
            self.ctx.spawn(self.ctx.engine.abort(call.request_id), f"prefill-abort-{call.request_id}")

    async def _finish(self, call: PrefillCall) -> None:
        if call.handle is not None:
            await call.handle.wait()  # the send may still be reading the blocks
        await self.ctx.engine.abort(call.request_id)  # frees held blocks, or drops a still-queued prefill
        self.metrics.forget(call.request_id)
        if self.calls.get(call.request_id) is call:
            del self.calls[call.request_id]

    def on_member_left(self, node_id: str) -> None:
        for call in list(self.calls.values()):
            if call.decode_id != node_id:
                continue
            log.warning("decode node %s left the registry: dropping %s", node_id, call.request_id)
            self._abort(call, f"decode node {node_id} left the registry")
            if call.handle is not None and not call.handle.done():
                if call.channel is not None:
                    call.channel.close(f"decode node {node_id} left the registry")
                # A send blocked on a hung peer resolves only at its deadline (gloo cannot interrupt it),
                # so the blocks are given back now; the send's outcome is reported as failed.
                call.released = True
                self.ctx.spawn(self.ctx.engine.abort(call.request_id), f"prefill-release-{call.request_id}")

    async def quiesce(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        if self.ctx.view.members(role="decode"):
            # Decode nodes stop choosing a prefill node whose load record says it drains; until that
            # record went out (one load interval) new Prefill calls are still taken, not failed.
            grace = self.config.load_interval_s + 0.5
            await asyncio.sleep(max(0.0, min(grace, deadline - loop.time())))
        self.accepting = False
        had_work = bool(self.calls)
        # Every send must resolve before the lease goes: decode nodes fail a prefill whose node left.
        while self.calls and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if had_work:
            # The last TransferDone messages are on the wire; let the decode nodes read them before
            # the lease revocation reaches their registry views.
            await asyncio.sleep(min(0.25, max(0.0, deadline - loop.time())))

    async def close(self) -> None:
        for call in list(self.calls.values()):
            self._abort(call, "prefill node shutting down")
            if call.handle is not None and not call.handle.done() and call.channel is not None:
                call.channel.close("prefill node shutting down")
        deadline = time.monotonic() + 5.0
        while self.calls and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


class _LayerSends:
    """One engine step's layer-wise sends (`LayerHook`, engine thread): each layer goes to the channel
    as the forward finishes it; on CUDA `layer_ready` records an event on the engine thread's stream,
    which the channel's stream waits for. At the end every layer is marked, also when the forward
    failed: the send then ships whatever the blocks hold and the Prefill call reports it failed
    (TransferDone ok false), so the decode node drains the bytes and never uses them."""

    def __init__(self, handles: list[SendHandle]) -> None:
        self._handles = handles

    def layer_done(self, layer: int) -> None:
        for handle in self._handles:
            handle.layer_ready(layer)

    def step_done(self, ok: bool) -> None:
        for handle in self._handles:
            handle.all_layers_ready()


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m prefill_node` (and `pdserve prefill`)."""
    config, log_level = PrefillNodeConfig.from_argv(argv)
    setup_logging(log_level)
    return asyncio.run(run_node(config, "prefill", PrefillService, PrefillMetrics))
