"""A remote request's prefill and KV transfer, driven by one task per request (`PrefillLink.drive`).

The driver calls PrefillNode.Prefill with the reserved block ids. FirstToken is appended and detokenized
here and goes to the caller at once; TransferStart posts the receive into the reserved blocks; when the
receive lands the request joins the running batch (`land`) and decodes. TransferStart may come before
FirstToken (a layer-wise send is announced while the prefill still runs): the receive is posted all the
same, and the request lands only once it has its first token, the receive completed and TransferDone
vouched for the bytes, whatever their order. Otherwise the request ends and its reservation is freed,
only once no receive can still write the reserved blocks (a request that ends at its first token waits
out a receive already posted).

Cancellation and failures: the caller cancelling marks the request; the driver calls PrefillNode.Abort
and keeps reading the Prefill stream to its end, discarding a transfer that was already announced
(keeping the pair channel in step) and waiting out one already posted before it frees the reservation.
A prefill node that leaves the registry (lease gone) has its calls cancelled and its channel closed,
which resolves posted receives at once; the reservations are then freed.

A prefill or transfer that fails is not the caller's problem either (`_prefill_here` decides, once the
Prefill call is over and no receive can still write the reservation): before the first token (the node
died, refused, errored, gave no first token within `--prefill-timeout`, or lost its lease) the request is
prefilled here as an ordinary local request (`pdserve_decode_local_prefill_fallbacks_total`); after it
(the node died or left the registry, the channel failed or closed, TransferDone said the send failed,
the receive timed out, the bytes failed their checksum) the prompt plus the tokens so far are prefilled
here and decoding continues after the last streamed token, with neither gap nor repeat
(`pdserve_decode_reprefills_total`). Only a cancelled request ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

import grpc

from pdserve.decode_node import trace
from pdserve.decode_node.config import DecodeNodeConfig
from pdserve.decode_node.metrics import DecodeMetrics
from pdserve.decode_node.request import DecodeRequest, RemotePrefill, Stage
from pdserve.engine.async_engine import abort_output
from pdserve.kernels import get_kernel_ops
from pdserve.kernels.interface import KV_LAYOUT_VERSION
from pdserve.kv_transfer import ChannelError, KVReceiver, TransferHandle, TransferResult
from pdserve.kv_transfer.checksum import CHECKSUM_ALGO
from pdserve.node_common.convert import logprob_from_proto, params_to_proto, transfer_meta_from_proto
from pdserve.node_common.runtime import GRPC_OPTIONS
from pdserve.node_common.service import NodeContext
from pdserve.registry import Member
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# gRPC codes by which a prefill node declines a request it could not or would not take.
_REFUSED = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                      grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION,
                      grpc.StatusCode.OUT_OF_RANGE})


def failure_reason(code: grpc.StatusCode) -> str:
    """The fallback metric's reason for a Prefill call that failed with `code`."""
    if code == grpc.StatusCode.UNAVAILABLE:
        return "unavailable"  # the process is gone, not listening, or draining
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout"
    return "refused" if code in _REFUSED else "error"


class PrefillLink:
    """What a decode node's remote requests share: gRPC stubs to prefill nodes, the KV receiver and the
    node; `end` is the servicer's way of ending a request (frees what the engine holds, drops it)."""

    def __init__(self, ctx: NodeContext, config: DecodeNodeConfig, metrics: DecodeMetrics,
                 end: Callable[[DecodeRequest], Awaitable[None]]) -> None:
        self.ctx, self.config, self.metrics, self._end = ctx, config, metrics, end
        self._receiver = KVReceiver(get_kernel_ops(config.engine.kernel_backend, config.engine.device))
        self._stubs: dict[tuple[str, str], tuple[grpc.aio.Channel, pb_grpc.PrefillNodeStub]] = {}
        self._kv_dtype = str(ctx.engine.engine.kv_cache.dtype).removeprefix("torch.")

    def _stub(self, member: Member) -> pb_grpc.PrefillNodeStub:
        key = (member.node_id, member.record.grpc_address)
        entry = self._stubs.get(key)
        if entry is None:
            channel = self.config.rpc.aio_channel(member.record.grpc_address, options=GRPC_OPTIONS)
            entry = (channel, pb_grpc.PrefillNodeStub(channel))
            self._stubs[key] = entry
        return entry[1]

    async def drive(self, req: DecodeRequest) -> None:
        """Runs one request's prefill and transfer, then lands it in the engine, prefills it here (the
        prefill or transfer failed, `_prefill_here`) or ends it (cancelled). Owns the reservation from
        WAITING_FOR_REMOTE_KV until the request is in the engine or ends."""
        rem = req.remote
        assert rem is not None and req.stage == Stage.WAITING_FOR_REMOTE_KV
        tracer = self.ctx.tracer
        try:
            await self._run_prefill(req, rem)
            if req.cancelled and not req.stream.finished:
                # Tell the caller now: a receive already posted may take until its deadline to resolve.
                req.stream.push(abort_output(req.request_id, "abort"))
            landed = await self._kv_in_place(req, rem)
            if landed:
                req.landed_at = self.metrics.landed(req.request_id)
            if tracer is not None:
                trace.end_kv_wait(tracer, req, rem, req.landed_at or time.monotonic(), landed)
        finally:
            if tracer is not None:  # cancelled (shutdown): the span still ends
                trace.end_kv_wait(tracer, req, rem, time.monotonic(), False)
        if landed:
            req.advance(Stage.IN_ENGINE)  # before `land` is queued, so a later cancel aborts in the engine
            try:
                await self.ctx.engine.land(req.request_id)
                return
            except (KeyError, ValueError) as err:
                req.error = f"landing after the transfer failed: {err}"
        elif await self._prefill_here(req, rem):
            return
        await self._end(req)

    async def _run_prefill(self, req: DecodeRequest, rem: RemotePrefill) -> None:
        """The Prefill call, its failures turned into `req.error` and a `rem.failure` reason."""
        try:
            await self._read_prefill(req, rem)
        except grpc.aio.AioRpcError as err:
            rem.failure = rem.failure or failure_reason(err.code())
            req.error = req.error or f"prefill node {rem.prefill.node_id}: {err.code().name}: {err.details()}"
            self._close_channel(rem, req.error)
        except asyncio.CancelledError:
            # Our own cancel of the call (lease lost, first token late) lands here as well.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                await asyncio.shield(self._end(req))
                raise
            rem.failure = rem.failure or "error"
            req.error = req.error or f"prefill call to {rem.prefill.node_id} cancelled"
        except Exception as err:  # a bug here must not leak the reservation
            log.exception("request %s: driver failed", req.request_id)
            rem.failure = rem.failure or "error"
            req.error = req.error or f"{type(err).__name__}: {err}"

    async def _prefill_here(self, req: DecodeRequest, rem: RemotePrefill) -> bool:
        """The one place that decides "go on here or end" for a request whose K/V did not land, once
        the Prefill call is over and no receive can still write the reservation. Unless the caller
        cancelled (or the stream already ended, e.g. at a first token that ended the request), the
        reservation is freed and the engine queues the request as a local one (`LLMEngine.prefill_here`),
        keeping its id, stream, params, seed and detokenizer: before the first token (the prefill
        failed: node dead, refusing, erroring, late, or its lease lost) from the prompt, counted as a
        fallback; after it (the node died or left, the channel failed, the send failed, the receive timed
        out or failed its checksum) from the prompt plus the tokens already streamed, counted as a
        re-prefill, so the next token follows the last one the caller got. From then on it is a local
        request (`remote` None, so later responses name this node as its prefill node). Returns False,
        changing nothing, when the request is to end."""
        if req.cancelled or req.stream.finished:
            return False
        reason = rem.failure or "error"  # a call that ended without a reason of its own counts as an error
        if rem.got_first:
            log.warning("request %s: KV from %s did not land after the first token (%s: %s); re-prefilling here",
                        req.request_id, rem.prefill.node_id, reason, req.error)
            self.metrics.reprefill(reason)
        else:
            log.warning("request %s: prefill on %s failed before its first token (%s: %s); prefilling here",
                        req.request_id, rem.prefill.node_id, reason, req.error)
            self.metrics.local_prefill_fallback(reason)
        req.error, req.remote, req.reservation = None, None, None
        req.advance(Stage.IN_ENGINE)  # before the engine hears of it, so a later cancel aborts in the engine
        try:
            await self.ctx.engine.prefill_here(req.request_id)
        except (KeyError, ValueError, RuntimeError) as err:
            req.error = f"local prefill after the remote one failed: {err}"
            await self._end(req)
        return True

    @staticmethod
    def _close_channel(rem: RemotePrefill, why: str) -> None:
        """Closes the pair channel under a receive still posted, so it resolves now instead of at its
        deadline (the prefill node closes its side too when its call ends mid-send)."""
        if rem.recv is not None and not rem.recv.done() and rem.channel is not None:
            rem.channel.close(why)

    async def _read_prefill(self, req: DecodeRequest, rem: RemotePrefill) -> None:
        assert req.reservation is not None
        # A resumed request is prefilled from prompt + resumed tokens; num_prompt_tokens tells the prefill
        # node where the completion starts (seeded position, penalties, the stop decision).
        msg = pb.PrefillRequest(
            request_id=req.request_id, prompt_token_ids=req.context, params=params_to_proto(req.params),
            num_prompt_tokens=len(req.prompt) if req.resume is not None else 0,
            decode_node_id=self.config.node_id, num_skip_blocks=req.reservation.num_cached_blocks,
            dst_block_ids=list(req.reservation.fill_block_ids), block_size=self.config.engine.block_size,
            kv_dtype=self._kv_dtype, layout_version=KV_LAYOUT_VERSION, model_fingerprint=self.ctx.fingerprint,
        )
        # Tracing on: the Prefill call carries the KV wait span's traceparent.
        metadata = trace.start_kv_wait(self.ctx.tracer, req, rem) if self.ctx.tracer is not None else None
        rem.call = self._stub(rem.prefill).Prefill(msg, metadata=metadata)
        if req.cancelled:
            self.send_abort(req)
        timeout = self.config.prefill_timeout_s
        timer = asyncio.get_running_loop().call_later(timeout, self._first_token_late, req, rem) if timeout else None
        try:
            async for event in rem.call:
                kind = event.WhichOneof("event")
                if kind == "first_token":
                    await self._on_first_token(req, rem, event.first_token)
                elif kind == "transfer_start":
                    self._on_transfer_start(req, rem, event.transfer_start)
                elif kind == "transfer_done":
                    self._on_transfer_done(req, rem, event.transfer_done)
        finally:
            if timer is not None:
                timer.cancel()

    def _first_token_late(self, req: DecodeRequest, rem: RemotePrefill) -> None:
        """No first token within the prefill timeout: the call is cancelled (the prefill node drops the
        work) and the driver decides what follows."""
        if rem.got_first or rem.call is None or rem.call.done():
            return
        rem.failure = rem.failure or "timeout"
        req.error = req.error or f"no first token from {rem.prefill.node_id} in {self.config.prefill_timeout_s:g}s"
        # A layer-wise send may have been announced before the first token: its receive resolves now.
        self._close_channel(rem, req.error)
        rem.call.cancel()

    async def _on_first_token(self, req: DecodeRequest, rem: RemotePrefill, first: pb.FirstToken) -> None:
        rem.got_first = True
        rem.cached_tokens = first.num_cached_tokens
        req.timing.prefill_queue_s = first.queue_s
        req.timing.prefill_s = first.prefill_s
        if req.cancelled or req.stream.finished:
            return
        logprob = logprob_from_proto(first.logprob) if first.HasField("logprob") else None
        await self.ctx.engine.append_first_token(req.request_id, first.token_id, logprob)

    def _on_transfer_start(self, req: DecodeRequest, rem: RemotePrefill, ts: pb.TransferStart) -> None:
        assert req.reservation is not None
        meta = transfer_meta_from_proto(ts, req.request_id, rem.prefill.node_id, self.config.node_id)
        address = ts.prefill_kv_address or rem.prefill.record.kv_address
        try:
            channel = self.ctx.channels.channel_from(rem.prefill.node_id, address, meta.epoch)
        except ChannelError as err:
            rem.failure = rem.failure or "receive_failed"
            req.error = req.error or f"cannot open the KV channel: {err}"
            return
        rem.channel = channel
        timeout = self.config.transfer_timeout_s
        if req.cancelled or req.stream.finished or req.error is not None:
            # Nobody wants these blocks any more; consuming the bytes keeps later transfers in step.
            rem.recv = self._receiver.discard(channel, meta, timeout_s=timeout)
            return
        recv = self._receiver.recv(channel, self.ctx.engine.engine.kv_cache, list(req.reservation.fill_block_ids),
                                   meta, timeout_s=timeout)
        rem.recv = recv
        loop = asyncio.get_running_loop()
        recv.future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._on_received, req, rem, recv))

    def _on_received(self, req: DecodeRequest, rem: RemotePrefill, recv: TransferHandle) -> None:
        """A receive resolved (event loop). A failed one ends the Prefill call at once, so the request
        is re-prefilled here without waiting for the prefill node's own verdict on its send."""
        result = recv.result()
        if result.ok or rem.call is None or rem.call.done():
            return
        self._receive_failed(req, rem, result)
        rem.call.cancel()

    def _intact(self, req: DecodeRequest, rem: RemotePrefill, result: TransferResult) -> bool:
        """Whether a completed receive's bytes are the ones the prefill node sent: its digest (from
        TransferDone ok) equals ours, same algorithm. Fails closed: a send that was not reported done
        lands nothing, and a mismatch (or a missing digest) is counted and fails the transfer."""
        if not rem.done:
            rem.failure = rem.failure or "error"
            req.error = req.error or "the prefill node did not report its send done"
            return False
        if rem.sent_checksum == (CHECKSUM_ALGO, result.checksum):
            return True
        self.metrics.kv_checksum_failure()
        rem.failure = rem.failure or "checksum"
        req.error = req.error or (f"KV checksum mismatch: sent {rem.sent_checksum}, received "
                                  f"{(CHECKSUM_ALGO, result.checksum)}")
        return False

    @staticmethod
    def _receive_failed(req: DecodeRequest, rem: RemotePrefill, result: TransferResult) -> None:
        rem.failure = rem.failure or ("timeout" if (result.error or "").startswith("timeout") else "receive_failed")
        req.error = req.error or f"KV receive failed: {result.error}"

    def _on_transfer_done(self, req: DecodeRequest, rem: RemotePrefill, done: pb.TransferDone) -> None:
        rem.skipped = done.ok and done.skipped
        if done.ok:
            rem.done = True
            req.timing.transfer_s = done.transfer_s
            if done.kv_checksum_algo:
                rem.sent_checksum = (done.kv_checksum_algo, done.kv_checksum)
            return
        rem.failure = rem.failure or "send_failed"
        req.error = req.error or f"prefill node {rem.prefill.node_id}: {done.error}"
        self._close_channel(rem, f"prefill node reported a failed send: {done.error}")

    async def _kv_in_place(self, req: DecodeRequest, rem: RemotePrefill) -> bool:
        """Waits out a posted receive; whether the prompt K/V are in the reserved blocks, intact, and the
        request still wants them. Once it returns no receive can write the reservation."""
        landed = rem.skipped
        if rem.recv is not None:
            result = await rem.recv.wait()
            if not result.ok:
                self._receive_failed(req, rem, result)
            # Only a receive into the reservation is checked: one posted for a request already cancelled,
            # finished or failed discarded its bytes (the conditions stay true once set).
            wanted = not req.cancelled and not req.stream.finished and req.error is None
            landed = result.ok and wanted and self._intact(req, rem, result)
        usable = rem.got_first and not req.cancelled and req.error is None and not req.stream.finished
        return usable and landed

    def cancel(self, req: DecodeRequest) -> None:
        """The caller is gone: the driver stops the prefill and frees what the request holds."""
        if req.cancelled:
            return
        req.cancelled = True
        if req.remote is not None and req.remote.call is not None:
            self.send_abort(req)

    def send_abort(self, req: DecodeRequest) -> None:
        assert req.remote is not None
        prefill = req.remote.prefill

        async def abort() -> None:
            try:
                await self._stub(prefill).Abort(pb.AbortRequest(request_id=req.request_id), timeout=5.0)
            except grpc.aio.AioRpcError as err:
                log.info("abort of %s on %s failed: %s", req.request_id, prefill.node_id, err.code().name)

        self.ctx.spawn(abort(), f"prefill-abort-{req.request_id}")

    @staticmethod
    def prefill_left(node_id: str, requests: Iterable[DecodeRequest]) -> None:
        """Fails the requests a departed prefill node was still serving (its sends are dropped)."""
        for req in requests:
            rem = req.remote
            if rem is None or rem.prefill.node_id != node_id or req.stage != Stage.WAITING_FOR_REMOTE_KV or rem.done:
                continue
            log.warning("prefill node %s left the registry: failing %s", node_id, req.request_id)
            rem.failure = rem.failure or "lease_lost"
            req.error = req.error or f"prefill node {node_id} left the registry"
            if rem.channel is not None:
                rem.channel.close(f"prefill node {node_id} left the registry")
            if rem.call is not None:
                rem.call.cancel()

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
