"""The decode node's gRPC service: admission, local or remote prefill, transfer, streaming decode.

Generate, per request:
  1. Route: a prefill node is the router's hint or the least loaded one in the registry view; none
     (or force_local_prefill, or an uncached prompt part below the threshold) means local prefill,
     which is an ordinary engine request (the engine queues it until it fits).
  2. Admission (remote path): the prompt's blocks are reserved before any prefill work is spent,
     prefix-cache hits shared. A request that does not fit waits in a FIFO queue; a full queue or a
     wait past admission_timeout_s refuses it with RESOURCE_EXHAUSTED.
  3. A driver task calls PrefillNode.Prefill with the reserved block ids. FirstToken is appended and
     detokenized here and goes to the caller at once; TransferStart posts the receive into the
     reserved blocks; when the receive lands the request joins the running batch and decodes.
  4. Tokens are streamed, batched per message when several are waiting.

Cancellation and failures: the caller cancelling marks the request; the driver calls
PrefillNode.Abort and keeps reading the Prefill stream to its end, discarding a transfer that was
already announced (keeping the pair channel in step) and waiting out one already posted before it
frees the reservation. A prefill node that leaves the registry (lease gone) has its calls cancelled
and its channel closed, which resolves posted receives at once; the reservations are then freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import grpc

from engine.async_engine import RequestStream, abort_output
from engine.block_manager import Reservation
from engine.llm_engine import RequestOutput
from engine.sampling_params import SamplingParams
from kernels import get_kernel_ops
from kernels.interface import KV_LAYOUT_VERSION
from kv_transfer import Channel, ChannelError, KVReceiver, TransferHandle, TransferMeta
from node.control import (
    GRPC_OPTIONS,
    NodeContext,
    NodeService,
    logprob_from_proto,
    logprob_to_proto,
    params_from_proto,
    params_to_proto,
    run_node,
    setup_logging,
)
from node.decode.config import DecodeNodeConfig
from node.decode.metrics import DecodeMetrics
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from registry import Member

log = logging.getLogger(__name__)

_ADMISSION_POLL_S = 0.05  # re-try the queue head this often even without a blocks-freed signal


class AdmissionRefused(Exception):
    """The request cannot be admitted now (queue full, waited too long, never fits)."""


@dataclass(eq=False)
class RemoteRequest:
    """A request prefilled on a prefill node: its reservation and where its transfer stands."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    prefill: Member
    stream: RequestStream
    arrived: float
    reservation: Reservation | None = None
    stage: str = "admission"  # admission -> prefill -> decoding | done
    cancelled: bool = False  # the caller went away or aborted
    error: str | None = None  # why it failed, for the caller
    call: grpc.aio.UnaryStreamCall | None = None  # the Prefill call
    channel: Channel | None = None
    recv: TransferHandle | None = None
    admitted_at: float = 0.0
    timing: pb.Timing = field(default_factory=pb.Timing)
    prefill_cached_tokens: int = 0
    # The prefill node reported its part done (TransferDone ok): its leaving the registry no longer
    # concerns this request (a drained prefill node revokes its lease right after its last send).
    prefill_done: bool = False


@dataclass(eq=False)
class _Waiter:
    st: RemoteRequest
    future: asyncio.Future[Reservation]


class DecodeService(NodeService, pb_grpc.DecodeNodeServicer):
    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        assert isinstance(ctx.config, DecodeNodeConfig)
        self.config: DecodeNodeConfig = ctx.config
        assert isinstance(ctx.metrics, DecodeMetrics)
        self.metrics: DecodeMetrics = ctx.metrics
        self._remote: dict[str, RemoteRequest] = {}
        self._local: set[str] = set()
        self._queue: deque[_Waiter] = deque()
        self._pumping = False
        self._receiver = KVReceiver(get_kernel_ops(ctx.config.engine.kernel_backend, ctx.config.engine.device))
        self._stubs: dict[tuple[str, str], tuple[grpc.aio.Channel, pb_grpc.PrefillNodeStub]] = {}
        engine = ctx.engine.engine
        self._kv_dtype = str(engine.kv_cache.dtype).removeprefix("torch.")
        self._num_blocks = engine.num_blocks
        self._vocab = engine.model_config.vocab_size
        ctx.engine.on_blocks_freed(self._kick_admission)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_DecodeNodeServicer_to_server(self, server)

    def load_extra(self) -> Mapping[str, float]:
        load = self.ctx.engine.load()
        return {
            "kv_blocks_reserved": load.reserved_blocks,
            "reserved_requests": load.reserved_requests,
            "admission_queue": len(self._queue),
            "in_flight": len(self._remote) + len(self._local),
        }

    # -- RPCs -----------------------------------------------------------------------------------------

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        return self.load_response()

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        rid = request.request_id
        st = self._remote.get(rid)
        if st is not None:
            self._cancel_remote(st)
            st.stream.push(abort_output(rid))
            return pb.AbortResponse(found=True)
        if rid in self._local:
            return pb.AbortResponse(found=await self.ctx.engine.abort(rid))
        return pb.AbortResponse(found=False)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        arrived = time.monotonic()
        await self.refuse_if_draining(context)
        rid = request.request_id or f"req-{uuid.uuid4().hex}"
        prompt = list(request.prompt_token_ids)
        try:
            params = params_from_proto(request.params)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if not prompt or any(not 0 <= t < self._vocab for t in prompt):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt must be non-empty ids in [0, {self._vocab})")
        if rid in self._remote or rid in self._local:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already running")
        prefill = None if request.force_local_prefill else self._pick_prefill(request.prefill_node_id)
        if prefill is not None:
            hit = await self.ctx.engine.call(lambda e: e.prefix_hit_tokens(prompt))
            if len(prompt) - hit < self.config.local_prefill_threshold:
                prefill = None
        st: RemoteRequest | None = None
        if prefill is None:
            if self.ctx.engine.load().waiting >= self.config.max_local_waiting:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode node queue is full")
            try:
                stream = await self.ctx.engine.add_request(rid, prompt, params)
            except ValueError as err:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            self._local.add(rid)
        else:
            stream = self.ctx.engine.open_stream(rid)
            st = RemoteRequest(rid, prompt, params, prefill, stream, arrived)
            self._remote[rid] = st
            try:
                st.reservation = await self._admit(st)
            except (AdmissionRefused, ValueError) as err:
                self._remote.pop(rid, None)
                self.ctx.engine.close_stream(rid)
                # A reservation granted just as the wait ran out is given back by this abort.
                self.ctx.engine.post(lambda e: e.abort(rid))
                code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(err, ValueError) else grpc.StatusCode.RESOURCE_EXHAUSTED
                await context.abort(code, str(err))
            except BaseException:
                # Cancelled while a reservation may have been made: the abort queued now runs after it.
                self._remote.pop(rid, None)
                self.ctx.engine.close_stream(rid)
                self.ctx.engine.post(lambda e: e.abort(rid))
                raise
            st.admitted_at = time.monotonic()
            st.timing.decode_admission_s = st.admitted_at - arrived
            st.stage = "prefill"
            self.ctx.spawn(self._drive(st), f"drive-{rid}")
        prefill_id = st.prefill.node_id if st is not None else self.config.node_id
        completion = 0
        first = True
        try:
            while True:
                batch = await stream.next_batch()
                completion += sum(len(o.new_token_ids) for o in batch)
                yield self._response(request, rid, batch, completion, first, st, prefill_id, arrived)
                first = False
                if batch[-1].finished:
                    break
        finally:
            if st is None:
                self._local.discard(rid)
                if not stream.finished:  # the caller went away: stop the work and free its blocks
                    self.ctx.spawn(self.ctx.engine.abort(rid), f"abort-{rid}")
            elif not stream.finished:
                self._cancel_remote(st)
            elif st.stage == "decoding" and self._remote.get(rid) is st:
                del self._remote[rid]  # finished in the engine, which already freed its blocks
            self.ctx.engine.close_stream(rid)
            self.metrics.forget(rid)

    # -- routing and admission -----------------------------------------------------------------------

    def _pick_prefill(self, hint: str) -> Member | None:
        """The hinted prefill node if it is in this node's pool, else the least loaded one (None: none)."""
        pool = [
            m for m in self.ctx.view.members(role="prefill", model=self.config.model_name)
            if m.record.model_fingerprint == self.ctx.fingerprint
            and m.record.block_size == self.config.engine.block_size
            and not (m.load is not None and m.load.extra.get("draining"))
        ]
        if not pool:
            return None
        by_id = {m.node_id: m for m in pool}
        if hint in by_id:
            return by_id[hint]
        mine: dict[str, int] = {}
        for st in self._remote.values():
            mine[st.prefill.node_id] = mine.get(st.prefill.node_id, 0) + 1

        def score(m: Member) -> tuple[int, str]:
            published = (m.load.queue_len + m.load.running) if m.load is not None else 0
            return (published + mine.get(m.node_id, 0), m.node_id)

        return min(pool, key=score)

    async def _admit(self, st: RemoteRequest) -> Reservation:
        """Reserves the prompt's blocks, waiting in FIFO order while the pool is full. Raises
        AdmissionRefused or ValueError (a request the engine rejects)."""
        bm = self.ctx.engine.engine.block_manager
        if bm.blocks_needed(len(st.prompt) + 1) > self._num_blocks:
            raise AdmissionRefused(f"a {len(st.prompt)}-token prompt can never fit this node's KV pool")
        if not self._queue:
            reservation = await self.ctx.engine.reserve(st.request_id, st.prompt, st.params)
            if reservation is not None:
                return reservation
        if len(self._queue) >= self.config.admission_queue_limit:
            raise AdmissionRefused("admission queue is full")
        waiter = _Waiter(st, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        deadline = time.monotonic() + self.config.admission_timeout_s
        try:
            while True:
                self._kick_admission()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AdmissionRefused(f"no KV blocks for {self.config.admission_timeout_s:g}s")
                with contextlib.suppress(TimeoutError):
                    return await asyncio.wait_for(asyncio.shield(waiter.future), min(left, _ADMISSION_POLL_S))
        finally:
            if not waiter.future.done():
                waiter.future.cancel()
            with contextlib.suppress(ValueError):
                self._queue.remove(waiter)

    def _kick_admission(self) -> None:
        if self._queue and not self._pumping:
            self._pumping = True
            self.ctx.spawn(self._pump(), "admission-pump")

    async def _pump(self) -> None:
        try:
            while self._queue:
                waiter = self._queue[0]
                if waiter.future.done():
                    self._queue.popleft()
                    continue
                st = waiter.st
                try:
                    reservation = await self.ctx.engine.reserve(st.request_id, st.prompt, st.params)
                except ValueError as err:
                    self._queue.popleft()
                    if not waiter.future.done():
                        waiter.future.set_exception(err)
                    continue
                if reservation is None:
                    return  # FIFO: the head waits for blocks, everyone behind it too
                self._queue.popleft()
                if waiter.future.done():  # the caller gave up while the reservation was being made
                    await self.ctx.engine.abort(st.request_id)
                else:
                    waiter.future.set_result(reservation)
        finally:
            self._pumping = False

    # -- remote prefill and transfer ------------------------------------------------------------------

    def _stub(self, member: Member) -> pb_grpc.PrefillNodeStub:
        key = (member.node_id, member.record.grpc_address)
        entry = self._stubs.get(key)
        if entry is None:
            channel = grpc.aio.insecure_channel(member.record.grpc_address, options=GRPC_OPTIONS)
            entry = (channel, pb_grpc.PrefillNodeStub(channel))
            self._stubs[key] = entry
        return entry[1]

    async def _drive(self, st: RemoteRequest) -> None:
        """Runs one request's prefill and transfer, then hands it to the engine or frees it. Owns the
        reservation from admission until the request decodes or is freed."""
        assert st.reservation is not None
        rid = st.request_id
        got_first = False
        skipped = False
        try:
            req = pb.PrefillRequest(
                request_id=rid, prompt_token_ids=st.prompt, params=params_to_proto(st.params),
                decode_node_id=self.config.node_id, num_skip_blocks=st.reservation.num_cached_blocks,
                dst_block_ids=list(st.reservation.fill_block_ids), block_size=self.config.engine.block_size,
                kv_dtype=self._kv_dtype, layout_version=KV_LAYOUT_VERSION, model_fingerprint=self.ctx.fingerprint,
            )
            st.call = self._stub(st.prefill).Prefill(req)
            if st.cancelled:
                self._send_abort(st)
            async for msg in st.call:
                kind = msg.WhichOneof("event")
                if kind == "first_token":
                    got_first = True
                    await self._on_first_token(st, msg.first_token)
                elif kind == "transfer_start":
                    self._on_transfer_start(st, msg.transfer_start)
                elif kind == "transfer_done":
                    done = msg.transfer_done
                    skipped = done.ok and done.skipped
                    if done.ok:
                        st.prefill_done = True
                        st.timing.transfer_s = done.transfer_s
                    else:
                        st.error = st.error or f"prefill node {st.prefill.node_id}: {done.error}"
                        if st.recv is not None and not st.recv.done() and st.channel is not None:
                            st.channel.close(f"prefill node reported a failed send: {done.error}")
        except grpc.aio.AioRpcError as err:
            st.error = st.error or f"prefill node {st.prefill.node_id}: {err.code().name}: {err.details()}"
        except asyncio.CancelledError:
            # Our own cancel of the call (the prefill node left the registry) lands here as well.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                await asyncio.shield(self._free(st))
                raise
            st.error = st.error or f"prefill call to {st.prefill.node_id} cancelled"
        except Exception as err:  # a bug here must not leak the reservation
            log.exception("request %s: driver failed", rid)
            st.error = st.error or f"{type(err).__name__}: {err}"
        if (st.error is not None or st.cancelled) and not st.stream.finished:
            # Tell the caller now: a receive already posted may take until its deadline to resolve.
            st.stream.push(abort_output(rid, "abort" if st.cancelled else "error"))
        landed = False
        if st.recv is not None:
            result = await st.recv.wait()
            landed = result.ok and not st.cancelled and st.stream.finished is False
            if not result.ok:
                st.error = st.error or f"KV receive failed: {result.error}"
        elif skipped:
            landed = True
        usable = got_first and not st.cancelled and st.error is None and not st.stream.finished
        if usable and landed:
            st.stage = "decoding"  # set before admit is queued, so a later cancel aborts in the engine
            try:
                self.metrics.admitted(rid)
                await self.ctx.engine.land(rid)
                return
            except (KeyError, ValueError) as err:
                st.error = f"admission after transfer failed: {err}"
        await self._free(st)

    async def _on_first_token(self, st: RemoteRequest, first: pb.FirstToken) -> None:
        st.prefill_cached_tokens = first.num_cached_tokens
        st.timing.prefill_queue_s = first.queue_s
        st.timing.prefill_s = first.prefill_s
        if st.cancelled or st.stream.finished:
            return
        logprob = logprob_from_proto(first.logprob) if first.HasField("logprob") else None
        await self.ctx.engine.append_first_token(st.request_id, first.token_id, logprob)

    def _on_transfer_start(self, st: RemoteRequest, ts: pb.TransferStart) -> None:
        assert st.reservation is not None
        meta = TransferMeta(
            request_id=st.request_id, prefill_id=st.prefill.node_id, decode_id=self.config.node_id,
            epoch=ts.channel_epoch, seq_no=ts.seq_no, num_blocks=ts.num_blocks, num_tokens=ts.num_tokens,
            layout_version=ts.layout_version, dtype=ts.dtype, geometry=tuple(ts.geometry),  # type: ignore[arg-type]
            layers_per_message=ts.layers_per_message,
        )
        address = ts.prefill_kv_address or st.prefill.record.kv_address
        try:
            channel = self.ctx.channels.channel_from(st.prefill.node_id, address, meta.epoch)
        except ChannelError as err:
            st.error = st.error or f"cannot open the KV channel: {err}"
            return
        st.channel = channel
        timeout = self.config.transfer_timeout_s
        if st.cancelled or st.stream.finished or st.error is not None:
            # Nobody wants these blocks any more; consuming the bytes keeps later transfers in step.
            st.recv = self._receiver.discard(channel, meta, timeout_s=timeout)
        else:
            st.recv = self._receiver.recv(
                channel, self.ctx.engine.engine.kv_cache, list(st.reservation.fill_block_ids), meta, timeout_s=timeout
            )

    async def _free(self, st: RemoteRequest) -> None:
        """Ends a request that will not decode: tells the caller why (if still listening) and frees its
        reservation. Only called once no receive can still write the reserved blocks."""
        st.stage = "done"
        if not st.stream.finished:
            st.stream.push(abort_output(st.request_id, "abort" if st.cancelled else "error"))
        await self.ctx.engine.abort(st.request_id)
        if self._remote.get(st.request_id) is st:
            del self._remote[st.request_id]

    def _cancel_remote(self, st: RemoteRequest) -> None:
        """The caller is gone: stop the request wherever it is; the driver frees what it holds."""
        if st.stage == "decoding":
            self.ctx.spawn(self._end_decoding(st), f"abort-{st.request_id}")
            return
        if st.cancelled:
            return
        st.cancelled = True
        if st.call is not None:
            self._send_abort(st)

    async def _end_decoding(self, st: RemoteRequest) -> None:
        await self.ctx.engine.abort(st.request_id)
        if self._remote.get(st.request_id) is st:
            del self._remote[st.request_id]

    def _send_abort(self, st: RemoteRequest) -> None:
        async def abort() -> None:
            try:
                await self._stub(st.prefill).Abort(pb.AbortRequest(request_id=st.request_id), timeout=5.0)
            except grpc.aio.AioRpcError as err:
                log.info("abort of %s on %s failed: %s", st.request_id, st.prefill.node_id, err.code().name)

        self.ctx.spawn(abort(), f"prefill-abort-{st.request_id}")

    def on_member_left(self, node_id: str) -> None:
        for st in list(self._remote.values()):
            if st.prefill.node_id != node_id or st.stage != "prefill" or st.prefill_done:
                continue
            log.warning("prefill node %s left the registry: failing %s", node_id, st.request_id)
            st.error = st.error or f"prefill node {node_id} left the registry"
            if st.channel is not None:
                st.channel.close(f"prefill node {node_id} left the registry")
            if st.call is not None:
                st.call.cancel()

    # -- responses ------------------------------------------------------------------------------------

    def _response(
        self, request: pb.GenerateRequest, rid: str, batch: list[RequestOutput], completion: int, first: bool,
        st: RemoteRequest | None, prefill_id: str, arrived: float,
    ) -> pb.GenerateResponse:
        last = batch[-1]
        msg = pb.GenerateResponse(
            request_id=rid,
            token_ids=[t for o in batch for t in o.new_token_ids],
            logprobs=[logprob_to_proto(lp) for o in batch for lp in o.new_logprobs],
            finished=last.finished, num_prompt_tokens=len(request.prompt_token_ids),
            num_completion_tokens=completion, prefill_node_id=prefill_id, decode_node_id=self.config.node_id,
        )
        if request.return_text:
            msg.text = "".join(o.new_text for o in batch)
        cached = max((o.num_cached_tokens for o in batch), default=0)
        if st is not None:
            msg.num_cached_tokens_decode = st.reservation.num_cached_tokens if st.reservation else 0
            msg.num_cached_tokens_prefill = st.prefill_cached_tokens
            cached = max(cached, msg.num_cached_tokens_decode, msg.num_cached_tokens_prefill)
        else:
            msg.num_cached_tokens_decode = cached
        msg.num_cached_tokens = cached
        if last.finished:
            msg.finish_reason = last.finish_reason or ""
            if last.stop_reason is not None:
                msg.stop_reason = str(last.stop_reason)
            if last.finish_reason == "error":
                msg.error = (st.error if st is not None else None) or "internal error"
        if first or last.finished:  # the last message repeats it, complete (transfer time included)
            timing = pb.Timing()
            if st is not None:
                timing.CopyFrom(st.timing)
                first_step = self.metrics.first_step_seconds(rid)
                if first_step is not None:
                    timing.first_decode_step_s = first_step
            else:
                timing.prefill_s = time.monotonic() - arrived
            msg.timing.CopyFrom(timing)
        return msg

    # -- drain and shutdown ---------------------------------------------------------------------------

    def queued_outside_engine(self) -> int:
        return len(self._queue)

    async def quiesce(self, deadline: float) -> None:
        # Frontends route by registry membership and retry UNAVAILABLE elsewhere, so new work stops now;
        # the lease stays until no request waits on a prefill node, which drops its sends to a node
        # that leaves the registry.
        self.accepting = False
        loop = asyncio.get_running_loop()
        while loop.time() < deadline and any(st.stage in ("admission", "prefill") for st in self._remote.values()):
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        for st in list(self._remote.values()):
            self._cancel_remote(st)
            if st.channel is not None and st.stage == "prefill":
                st.channel.close("decode node shutting down")
        for rid in list(self._local):
            await self.ctx.engine.abort(rid)
        deadline = time.monotonic() + 5.0
        while self._remote and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for channel, _ in self._stubs.values():
            await channel.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m node.decode` (and `pdserve decode`)."""
    config, log_level = DecodeNodeConfig.from_argv(argv)
    setup_logging(log_level)
    return asyncio.run(run_node(config, "decode", DecodeService, DecodeMetrics))
