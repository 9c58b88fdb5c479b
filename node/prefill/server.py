"""The prefill node's gRPC service.

A Prefill call queues a prefill-only request in the engine (sampling params of the caller, one token,
blocks held after it finishes); the engine's scheduler batches every queued prefill under its token
budget and uses the prefix cache. As soon as the first token is sampled it goes out as FirstToken; the
send of the request's blocks (all of its prompt blocks except the ones the decode node already caches)
is queued on the pair channel and announced with TransferStart; TransferDone follows once the send
completes. Blocks are released when the send resolves, when the request is aborted before any send
was queued, or when the decode node's registry lease disappears (which closes the pair channel, so a
send blocked on a dead peer resolves at once instead of at the transfer timeout).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import grpc

from engine.async_engine import RequestStream
from engine.llm_engine import EngineRequests, RequestOutput
from engine.sampling_params import SamplingParams
from engine.schedule import stop_decision
from engine.sequence import Resume
from kernels import get_kernel_ops
from kernels.interface import KV_LAYOUT_VERSION
from kv_transfer import Channel, ChannelError, KVSender, SendHandle
from kv_transfer.checksum import CHECKSUM_ALGO
from node.config import setup_logging
from node.convert import logprob_to_proto, params_from_proto, transfer_start_to_proto
from node.prefill.config import PrefillNodeConfig
from node.prefill.metrics import PrefillMetrics
from node.runtime import run_node
from node.service import NodeContext, NodeService
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class Stage(enum.Enum):
    PREFILLING = "prefilling"  # in the engine, until its first token (then its blocks are held)
    SENDING = "sending"  # the send of its blocks is queued; they are held until it resolves
    ENDING = "ending"  # the call is over: blocks are given back once no send reads them


_NEXT = {Stage.PREFILLING: {Stage.SENDING, Stage.ENDING}, Stage.SENDING: {Stage.ENDING}, Stage.ENDING: set()}


@dataclass(eq=False)
class PrefillRequest:
    """One Prefill call on this node, from arrival until the engine let go of its blocks."""

    request_id: str
    decode_id: str
    arrived: float
    stage: Stage = Stage.PREFILLING
    aborted: str | None = None  # why, once aborted (caller's Abort, decode node gone, shutdown)
    handle: SendHandle | None = None  # set once the send is queued; blocks are held until it resolves
    channel: Channel | None = None
    # The blocks were given back although the send had not resolved (the decode node's lease lapsed):
    # whatever the send still ships is reported as failed, so the decode node never uses it.
    released: bool = False

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
        self.requests: dict[str, PrefillRequest] = {}
        self._sender = KVSender(get_kernel_ops(ctx.config.engine.kernel_backend, ctx.config.engine.device),
                                fault_corrupt=self.config.fault_corrupt_kv)
        engine = ctx.engine.engine
        self._eos = engine.tokenizer.eos_token_ids
        self._kv_dtype = str(engine.kv_cache.dtype).removeprefix("torch.")

    def request_stages(self) -> Mapping[str, str]:
        return {rid: req.stage.value for rid, req in list(self.requests.items())}

    def in_flight(self) -> int:
        return sum(1 for req in list(self.requests.values()) if not req.released)

    def check_requests(self, before: Mapping[str, str], engine: EngineRequests) -> None:
        assert not engine.reserved, f"a prefill node reserves nothing: {sorted(engine.reserved)}"
        for rid, req in dict(self.requests).items():
            assert req.request_id == rid
            if req.stage == Stage.SENDING:
                assert req.handle is not None and req.channel is not None
        # A prefill still in the engine belongs to a call that is prefilling, or ending and about to abort it.
        early = engine.scheduled - {rid for rid, stage in before.items() if stage != Stage.SENDING.value}
        assert not early, f"engine computes prefills whose send is already queued: {sorted(early)}"

    def add_to_server(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_PrefillNodeServicer_to_server(self, server)

    # -- RPCs -----------------------------------------------------------------------------------------

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        return self.load_response()

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        st = self.requests.get(request.request_id)
        if st is None:
            return pb.AbortResponse(found=False)
        self._abort(st, "aborted by the decode node")
        return pb.AbortResponse(found=True)

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PrefillResponse]:
        params = await self._accept(request, context)
        prompt, resume = self._split_resumed(request)
        req = PrefillRequest(request.request_id, request.decode_node_id, time.monotonic())
        self.requests[req.request_id] = req
        try:
            # The decode node applies stop strings and max_tokens; here only the first token is sampled
            # (the one after a resumed request's resumed tokens, which the engine counts as completion).
            num_resumed = len(resume.token_ids) if resume is not None else 0
            first_params = dataclasses.replace(params, max_tokens=num_resumed + 1, stop=[])
            try:
                if num_resumed >= params.max_tokens:
                    raise ValueError(f"{num_resumed} resumed tokens leave nothing of max_tokens ({params.max_tokens})")
                stream = await self.ctx.engine.add_request(
                    req.request_id, prompt, first_params, hold_blocks=True, resume=resume)
            except ValueError as err:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            async for msg in self._serve(req, request, params, stream):
                yield msg
        finally:
            # Also reached when the caller's stream is cancelled (its process died or it gave up):
            # blocks are handed back once no send can still be reading them.
            if req.handle is not None and not req.handle.done() and req.channel is not None:
                req.channel.close(f"Prefill call for {req.request_id} ended while its send was in flight")
            req.advance(Stage.ENDING)
            self.ctx.spawn(self._finish(req), f"prefill-finish-{req.request_id}")

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
        if request.request_id in self.requests:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request {request.request_id!r} is already being prefilled")
        if len(self.requests) >= self.config.max_pending:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "prefill queue is full")
        return params

    async def _serve(
        self, req: PrefillRequest, request: pb.PrefillRequest, params: SamplingParams, stream: RequestStream,
    ) -> AsyncIterator[pb.PrefillResponse]:
        batch = await stream.next_batch()
        out = batch[-1]
        if not out.new_token_ids or req.aborted:
            yield pb.PrefillResponse(transfer_done=pb.TransferDone(ok=False, error=req.aborted or "aborted"))
            return
        token = out.new_token_ids[0]
        yield pb.PrefillResponse(first_token=self._first_token(req, out))
        if stop_decision(params, self._eos, token, out.num_completion_tokens) is not None or not request.dst_block_ids:
            # The decode node is done with this request (or already holds every block): nothing to ship.
            yield pb.PrefillResponse(transfer_done=pb.TransferDone(ok=True, skipped=True))
            return
        if self.config.fault_send_delay_s:  # test fault injection: a window after the first token
            await asyncio.sleep(self.config.fault_send_delay_s)
        seq = stream.seq
        assert seq is not None and seq.is_finished, "a prefill-only request finishes with its first token"
        start = request.num_skip_blocks
        started = self._start_send(req, seq.block_table[start : start + len(request.dst_block_ids)],
                                   len(request.prompt_token_ids))
        yield started
        if req.handle is None:
            return  # `started` said why nothing is sent
        result = await req.handle.wait()
        self.metrics.transfer_done(result, (req.aborted or "released") if req.released else None)
        if req.released:
            yield pb.PrefillResponse(transfer_done=pb.TransferDone(ok=False, error=req.aborted or "released"))
            return
        if self.config.fault_send_failed:  # test fault injection; a failed send breaks its channel, so this one's goes
            if req.channel is not None:
                req.channel.close("fault injection: send reported as failed")
            yield pb.PrefillResponse(transfer_done=pb.TransferDone(ok=False, error="fault injection: send failed"))
            return
        yield pb.PrefillResponse(transfer_done=pb.TransferDone(
            ok=result.ok, error=result.error or "", transfer_s=result.seconds,
            kv_checksum=result.checksum or 0, kv_checksum_algo=CHECKSUM_ALGO if result.checksum is not None else "",
        ))

    def _first_token(self, req: PrefillRequest, out: RequestOutput) -> pb.FirstToken:
        first = pb.FirstToken(token_id=out.new_token_ids[0], num_cached_tokens=out.num_cached_tokens)
        timing = self.metrics.first_token(req.request_id, req.arrived)
        if timing is not None:
            first.queue_s, first.prefill_s = timing.queue_s, timing.prefill_s
        else:  # the engine thread's record is missing (it cannot be, short of a bug): all of it is prefill
            first.prefill_s = time.monotonic() - req.arrived
        if out.new_logprobs:
            first.logprob.CopyFrom(logprob_to_proto(out.new_logprobs[0]))
        return first

    def _start_send(self, req: PrefillRequest, src_blocks: list[int], num_tokens: int) -> pb.PrefillResponse:
        """Queues the send of `src_blocks` (SENDING from then on) and returns its TransferStart, or the
        TransferDone saying why nothing is sent. No await: an Abort cannot slip in before the send."""
        if req.aborted:
            return pb.PrefillResponse(transfer_done=pb.TransferDone(ok=False, error=req.aborted))
        stall = self.config.fault_send_stall_s
        try:
            channel = self.ctx.channels.channel_to(req.decode_id)
            handle = self._sender.send(
                channel, self.ctx.engine.engine.kv_cache, src_blocks, request_id=req.request_id,
                num_tokens=num_tokens, timeout_s=self.config.transfer_timeout_s, layerwise=stall > 0,
            )
        except (ChannelError, ValueError) as err:
            self.metrics.transfer_done(None, f"send not queued: {err}")
            return pb.PrefillResponse(transfer_done=pb.TransferDone(ok=False, error=f"send not queued: {err}"))
        req.channel, req.handle = channel, handle
        req.advance(Stage.SENDING)
        if stall:  # test fault injection: half the layers go now, the rest after the stall
            num_layers = handle.meta.geometry[0]
            for layer in range(num_layers // 2):
                handle.layer_ready(layer)
            self.ctx.spawn(self._release_stalled(handle, stall), f"fault-stall-{req.request_id}")
        return pb.PrefillResponse(transfer_start=transfer_start_to_proto(handle.meta, self.ctx.channels.kv_address))

    # -- helpers --------------------------------------------------------------------------------------

    @staticmethod
    async def _release_stalled(handle: SendHandle, stall_s: float) -> None:
        """Test fault injection (`fault_send_stall_s`): the rest of a stalled send's layers, later."""
        await asyncio.sleep(stall_s)
        handle.all_layers_ready()

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

    def _abort(self, st: PrefillRequest, reason: str) -> None:
        """Marks the request aborted. Before its send is queued the engine drops it (freeing its blocks);
        a queued send is left to finish or fail, since the decode node drains or discards it."""
        if st.aborted is None:
            st.aborted = reason
        if st.handle is None:
            self.ctx.spawn(self.ctx.engine.abort(st.request_id), f"prefill-abort-{st.request_id}")

    async def _finish(self, st: PrefillRequest) -> None:
        if st.handle is not None:
            await st.handle.wait()  # the send may still be reading the blocks
        await self.ctx.engine.abort(st.request_id)  # frees held blocks, or drops a still-queued prefill
        self.metrics.forget(st.request_id)
        if self.requests.get(st.request_id) is st:
            del self.requests[st.request_id]

    def on_member_left(self, node_id: str) -> None:
        for st in list(self.requests.values()):
            if st.decode_id != node_id:
                continue
            log.warning("decode node %s left the registry: dropping %s", node_id, st.request_id)
            self._abort(st, f"decode node {node_id} left the registry")
            if st.handle is not None and not st.handle.done():
                if st.channel is not None:
                    st.channel.close(f"decode node {node_id} left the registry")
                # A send blocked on a hung peer resolves only at its deadline (gloo cannot interrupt it),
                # so the blocks are given back now; the send's outcome is reported as failed.
                st.released = True
                self.ctx.spawn(self.ctx.engine.abort(st.request_id), f"prefill-release-{st.request_id}")

    async def quiesce(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        if self.ctx.view.members(role="decode"):
            # Decode nodes stop choosing a prefill node whose load record says it drains; until that
            # record went out (one load interval) new Prefill calls are still taken, not failed.
            grace = self.config.load_interval_s + 0.5
            await asyncio.sleep(max(0.0, min(grace, deadline - loop.time())))
        self.accepting = False
        had_work = bool(self.requests)
        # Every send must resolve before the lease goes: decode nodes fail a prefill whose node left.
        while self.requests and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if had_work:
            # The last TransferDone messages are on the wire; let the decode nodes read them before
            # the lease revocation reaches their registry views.
            await asyncio.sleep(min(0.25, max(0.0, deadline - loop.time())))

    async def close(self) -> None:
        for st in list(self.requests.values()):
            self._abort(st, "prefill node shutting down")
            if st.handle is not None and not st.handle.done() and st.channel is not None:
                st.channel.close("prefill node shutting down")
        deadline = time.monotonic() + 5.0
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m node.prefill` (and `pdserve prefill`)."""
    config, log_level = PrefillNodeConfig.from_argv(argv)
    setup_logging(log_level)
    return asyncio.run(run_node(config, "prefill", PrefillService, PrefillMetrics))
