"""The prefill node's gRPC service.

A Prefill call (`prefill_node.call.PrefillCall`) queues a prefill-only request in the engine (sampling
params of the caller, one token, blocks held after it finishes); the engine's scheduler batches every
queued prefill under its token budget and uses the prefix cache. The send of the call's blocks (all of its
prompt blocks except the ones the decode node already caches) goes over the pair channel, announced with
TransferStart; TransferDone follows once the send completes.

Layer-wise sends (the default; `--no-layerwise-send` turns them off): in the engine step that computes
the call's last prompt chunk, before its forward runs, the engine thread queues the send layer by layer
and has it announced (`prefill_node.sends`, through the engine's prefill watcher, engine.step_hook); each
layer is released to the channel as the forward finishes it, so the transfer overlaps the prefill's
compute. The first token goes out as FirstToken as soon as it is sampled, after TransferStart. A call
whose first token must end it (max_tokens) ships nothing; one that turns out to end at its first token
(EOS, a stop token) had its send announced already and completes it (the decode node discards it).
Without layer-wise sends the send is queued after FirstToken went out.

Tests inject faults through the node's fault hook (`prefill_node.faults`), which in production does nothing.
Tracing on (`ctx.tracer`): the call's spans, `prefill_node.spans`.

Blocks are released when the send resolves, when the call is aborted before any send was queued, or when
the decode node's registry lease disappears (which closes the pair channel, so a send blocked on a dead
peer resolves at once instead of at the transfer timeout).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Mapping

import grpc

from pdserve.engine.async_engine import RequestStream
from pdserve.engine.llm_engine import EngineRequests, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Resume
from pdserve.engine.stopping import stop_decision
from pdserve.kernels import get_kernel_ops
from pdserve.kernels.interface import KV_LAYOUT_VERSION
from pdserve.kv_transfer import SendHandle
from pdserve.kv_transfer.checksum import CHECKSUM_ALGO
from pdserve.node_common.config import setup_logging
from pdserve.node_common.convert import call_key, logprob_to_proto, params_from_proto, transfer_start_to_proto
from pdserve.node_common.embed import EmbedServer
from pdserve.node_common.faults import load_faults
from pdserve.node_common.kv_pool import transfer_pool
from pdserve.node_common.runtime import run_node
from pdserve.node_common.service import NodeContext, NodeService
from pdserve.prefill_node.call import LayerwiseSend, PrefillCall, Stage
from pdserve.prefill_node.config import PrefillNodeConfig
from pdserve.prefill_node.faults import PrefillFaults
from pdserve.prefill_node.metrics import PrefillMetrics
from pdserve.prefill_node.sends import Sends
from pdserve.prefill_node.spans import finish_call_spans, start_call_span
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class PrefillService(NodeService, pb_grpc.PrefillNodeServicer):
    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        assert isinstance(ctx.config, PrefillNodeConfig)
        self.config: PrefillNodeConfig = ctx.config
        assert isinstance(ctx.metrics, PrefillMetrics)
        self.metrics: PrefillMetrics = ctx.metrics
        self.calls: dict[str, PrefillCall] = {}
        assert isinstance(ctx.faults, PrefillFaults)
        self.faults: PrefillFaults = ctx.faults
        engine = ctx.engine.engine
        ops = get_kernel_ops(self.config.engine.kernel_backend, self.config.engine.device)
        self.sends = Sends(self.faults.new_sender(ops), transfer_pool(engine), ctx.channels, self.calls, self.metrics,
                           self.config.transfer_timeout_s)
        self._eos = engine.tokenizer.eos_token_ids
        self._kv_dtype = str(engine.kv_cache.dtype).removeprefix("torch.")
        self.embeds = EmbedServer(self, self.metrics)  # the Embed RPC (node_common.embed)
        if self.config.layerwise_send:
            ctx.engine.post(lambda e: setattr(e, "prefill_watcher", self.sends.prefills_completing))

    def request_stages(self) -> Mapping[str, str]:
        return {rid: call.stage.value for rid, call in list(self.calls.items())}

    def in_flight(self) -> int:
        calls = sum(1 for call in list(self.calls.values()) if not call.released_under_send)
        return calls + self.embeds.in_flight

    def check_requests(self, before: Mapping[str, str], engine: EngineRequests) -> None:
        assert not engine.reserved, f"a prefill node reserves nothing: {sorted(engine.reserved)}"
        for rid, call in dict(self.calls).items():
            assert call.key == rid
            if call.stage == Stage.SENDING:
                assert call.handle is not None and call.channel is not None
        # A prefill still in the engine belongs to a call in the engine, or ending and about to abort it.
        # A layer-wise send is queued in the step that completes its prefill, so between steps (when this
        # runs) no call whose send is queued is still scheduled either.
        sent = engine.scheduled - {rid for rid, stage in before.items() if stage != Stage.SENDING.value}
        assert not sent, f"engine computes prefills whose send is already queued: {sorted(sent)}"

    def add_to_server(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_PrefillNodeServicer_to_server(self, server)

    # -- RPCs -----------------------------------------------------------------------------------------

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        return self.load_response()

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        call = self.calls.get(call_key(request.request_id, request.attempt))
        if call is None:
            return pb.AbortResponse(found=False)
        self._abort(call, "aborted by the decode node")
        return pb.AbortResponse(found=True)

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        return await self.embeds.embed(request, context)

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PrefillResponse]:
        params = await self._accept(request, context)
        prompt, resume = self._split_resumed(request)
        key = call_key(request.request_id, request.attempt)
        call = PrefillCall(key, request.request_id, request.attempt, request.decode_node_id, time.monotonic())
        tracer = self.ctx.tracer
        if tracer is not None:
            start_call_span(tracer, call, context.invocation_metadata() or (), self.config.node_id,
                            len(request.prompt_token_ids))
        # The decode node applies stop strings and max_tokens; here only the first token is sampled
        # (the one after a resumed request's resumed tokens, which the engine counts as completion).
        num_resumed = len(resume.token_ids) if resume is not None else 0
        first_params = dataclasses.replace(params, max_tokens=num_resumed + 1, stop=[])
        call.layerwise = self._layerwise_send(request, params, num_resumed)
        self.calls[call.key] = call
        try:
            try:
                if num_resumed >= params.max_tokens:
                    raise ValueError(f"{num_resumed} resumed tokens leave nothing of max_tokens ({params.max_tokens})")
                stream = await self.ctx.engine.add_request(
                    call.key, prompt, first_params, hold_blocks=True, resume=resume)
            except ValueError as err:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            async for msg in self._serve(call, request, params, stream):
                yield msg
        finally:
            # Also reached when the caller's stream is cancelled (its process died or it gave up):
            # blocks are handed back once no send can still be reading them.
            self.sends.end(call)
            call.close_channel_under_send(f"Prefill call for {call.key} ended while its send was in flight")
            self.ctx.spawn(self._finish(call), f"prefill-finish-{call.key}")
            if tracer is not None:
                finish_call_spans(tracer, call)

    async def _accept(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> SamplingParams:
        """The call's sampling parameters; aborts the call when it cannot be taken."""
        await self.refuse_if_draining(context)
        problem = self._check(request, list(request.prompt_token_ids))
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            params = params_from_proto(request.params)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        key = call_key(request.request_id, request.attempt)
        if key in self.calls:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {key!r} is already being prefilled")
        if len(self.calls) >= self.config.max_pending:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "prefill queue is full")
        return params

    def _layerwise_send(
        self, request: pb.PrefillRequest, params: SamplingParams, num_resumed: int,
    ) -> LayerwiseSend | None:
        """Whether the call's send is queued layer-wise in the step of its last prompt chunk (see the
        module docstring), and what it ships; None: after the first token, if at all."""
        cfg = self.config
        if not cfg.layerwise_send or not request.dst_block_ids:
            return None
        if num_resumed + 1 >= params.max_tokens:
            return None  # the first token is the last one: nothing will be shipped
        return LayerwiseSend(request.num_skip_blocks, len(request.dst_block_ids), len(request.prompt_token_ids))

    async def _first_output(self, call: PrefillCall, stream: RequestStream) -> AsyncIterator[
            pb.PrefillResponse | list[RequestOutput]]:
        """Yields TransferStart as soon as the engine thread queued a layer-wise send (before or while
        the step runs), then the call's first batch of outputs. The engine thread hands the loop the news
        of a queued send before the step's outputs, so it is always announced before the first token."""
        outputs = asyncio.ensure_future(stream.next_batch())
        try:
            if call.layerwise is not None:
                queued = asyncio.ensure_future(call.layerwise_queued.wait())
                try:
                    await asyncio.wait({outputs, queued}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    queued.cancel()
            if call.handle is not None:
                yield pb.PrefillResponse(transfer_start=self._transfer_start(call.handle))
            yield await outputs
        finally:
            outputs.cancel()

    async def _serve(
        self, call: PrefillCall, request: pb.PrefillRequest, params: SamplingParams, stream: RequestStream,
    ) -> AsyncIterator[pb.PrefillResponse]:
        """The call's messages once the engine took it: a layer-wise send's TransferStart, FirstToken, the
        TransferStart of a send queued after it, then the TransferDone that ends the call."""
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
        yield pb.PrefillResponse(first_token=self._first_token(call, out))
        if call.handle is None:
            yield await self._send_after_first_token(call, request, params, stream, out)
            if call.handle is None:
                return  # that message said why nothing is sent
        yield await self._transfer_done(call)

    async def _send_after_first_token(
        self, call: PrefillCall, request: pb.PrefillRequest, params: SamplingParams, stream: RequestStream,
        out: RequestOutput,
    ) -> pb.PrefillResponse:
        """Queues the call's send now that its first token went out (SENDING from then on) and returns its
        TransferStart, or the TransferDone saying why nothing is sent."""
        seq = stream.seq
        grammar_finish = seq.grammar_finish if seq is not None else None
        if (stop_decision(params, self._eos, out.new_token_ids[0], out.num_completion_tokens, grammar_finish)
                is not None or not request.dst_block_ids):
            # The decode node is done with this request (or already holds every block): nothing to ship.
            return pb.PrefillResponse(transfer_done=pb.TransferDone(ok=True, skipped=True))
        await self.faults.after_first_token(call)
        assert seq is not None and seq.is_finished, "a prefill-only request finishes with its first token"
        # No await from here to the queued send: an Abort cannot slip in between.
        start = request.num_skip_blocks
        error = self.sends.queue(call, seq.block_table[start : start + len(request.dst_block_ids)],
                                 len(request.prompt_token_ids), layerwise=False)
        if error is not None:
            if error.startswith("send not queued"):
                self.metrics.transfer_done(None, error)
            return pb.PrefillResponse(transfer_done=pb.TransferDone(ok=False, error=error))
        assert call.handle is not None
        return pb.PrefillResponse(transfer_start=self._transfer_start(call.handle))

    async def _transfer_done(self, call: PrefillCall) -> pb.PrefillResponse:
        """The TransferDone of the call's queued send, once it resolved."""
        assert call.handle is not None
        result = await call.handle.wait()
        call.send_result = result
        self.metrics.transfer_done(result, (call.aborted or "released") if call.released_under_send else None)
        if call.released_under_send:
            return pb.PrefillResponse(transfer_done=pb.TransferDone(ok=False, error=call.aborted or "released"))
        return pb.PrefillResponse(transfer_done=pb.TransferDone(
            ok=result.ok, error=result.error or "", transfer_s=result.seconds,
            kv_checksum=result.checksum or 0, kv_checksum_algo=CHECKSUM_ALGO if result.checksum is not None else "",
        ))

    def _first_token(self, call: PrefillCall, out: RequestOutput) -> pb.FirstToken:
        first = pb.FirstToken(token_id=out.new_token_ids[0], num_cached_tokens=out.num_cached_tokens)
        timing = self.metrics.first_token(call.key, call.arrived)
        call.timing = timing
        if timing is not None:
            first.queue_s, first.prefill_s = timing.queue_s, timing.prefill_s
        else:  # the engine thread's record is missing (it cannot be, short of a bug): all of it is prefill
            first.prefill_s = time.monotonic() - call.arrived
        if out.new_logprobs:
            first.logprob.CopyFrom(logprob_to_proto(out.new_logprobs[0]))
        return first

    def _transfer_start(self, handle: SendHandle) -> pb.TransferStart:
        return transfer_start_to_proto(handle.meta, self.ctx.channels.kv_address)

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
        """Marks the call aborted. Before its send is queued the engine drops it (freeing its blocks); a
        queued send is left to finish or fail, since the decode node drains or discards it."""
        if not self.sends.abort(call, reason):
            self.ctx.spawn(self.ctx.engine.abort(call.key), f"prefill-abort-{call.key}")

    async def _finish(self, call: PrefillCall) -> None:
        if call.handle is not None:
            await call.handle.wait()  # the send may still be reading the blocks
        await self.ctx.engine.abort(call.key)  # frees held blocks, or drops a still-queued prefill
        self.metrics.forget(call.key)
        if self.calls.get(call.key) is call:
            del self.calls[call.key]

    def on_member_left(self, node_id: str) -> None:
        for call in list(self.calls.values()):
            if call.decode_id != node_id:
                continue
            log.warning("decode node %s left the registry: dropping %s", node_id, call.key)
            self._abort(call, f"decode node {node_id} left the registry")
            if call.close_channel_under_send(f"decode node {node_id} left the registry"):
                # A send blocked on a hung peer resolves only at its deadline (gloo cannot interrupt it),
                # so the blocks are given back now; the send's outcome is reported as failed.
                call.released_under_send = True
                self.ctx.spawn(self.ctx.engine.abort(call.key), f"prefill-release-{call.key}")

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
        while (self.calls or self.embeds.in_flight) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if had_work:
            # The last TransferDone messages are on the wire; let the decode nodes read them before
            # the lease revocation reaches their registry views.
            await asyncio.sleep(min(0.25, max(0.0, deadline - loop.time())))

    async def close(self) -> None:
        for call in list(self.calls.values()):
            self._abort(call, "prefill node shutting down")
            call.close_channel_under_send("prefill node shutting down")
        deadline = time.monotonic() + 5.0
        while self.calls and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m prefill_node` (and `pdserve prefill`)."""
    config, log_level = PrefillNodeConfig.from_argv(argv)
    setup_logging(log_level)
    return asyncio.run(run_node(config, "prefill", PrefillService, PrefillMetrics, load_faults(PrefillFaults)))
