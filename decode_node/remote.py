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

A prefill or transfer that fails is not the caller's problem either. Every failure is recorded through
`RemotePrefill.fail` (the first cause wins; its reason is the metric's label), and `outcome` decides once
the Prefill call is over and no receive can still write the reservation: before the first token (the node
died, refused, errored, gave no first token within `--prefill-timeout`, or lost its lease) the request is
prefilled here as an ordinary local request (`pdserve_decode_local_prefill_fallbacks_total`); after it
(the node died or left the registry, the channel failed or closed, TransferDone said the send failed,
the receive timed out, the bytes failed their checksum) the prompt plus the tokens so far are prefilled
here and decoding continues after the last streamed token, with neither gap nor repeat
(`pdserve_decode_reprefills_total`). Only a cancelled request ends.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

import grpc

from pdserve.decode_node import trace
from pdserve.decode_node.config import DecodeNodeConfig
from pdserve.decode_node.metrics import DecodeMetrics
from pdserve.decode_node.request import DecodeRequest, FailureReason, RemotePrefill, SendReport, Stage
from pdserve.engine.async_engine import abort_output
from pdserve.engine.stopping import FinishReason
from pdserve.kernels import get_kernel_ops
from pdserve.kernels.interface import KV_LAYOUT_VERSION
from pdserve.kv_transfer import ChannelError, KVReceiver, TransferHandle, TransferResult
from pdserve.kv_transfer.checksum import CHECKSUM_ALGO
from pdserve.node_common.convert import logprob_from_proto, params_to_proto, transfer_meta_from_proto
from pdserve.node_common.kv_pool import transfer_pool
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


def failure_reason(code: grpc.StatusCode) -> FailureReason:
    """Why a Prefill call that failed with `code` failed."""
    if code == grpc.StatusCode.UNAVAILABLE:
        return FailureReason.UNAVAILABLE  # the process is gone, not listening, or draining
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return FailureReason.TIMEOUT
    return FailureReason.REFUSED if code in _REFUSED else FailureReason.ERROR


class Outcome(enum.Enum):
    """What becomes of a remote request once its Prefill call is over and no receive can write its
    reservation (`outcome`)."""

    LAND = "land"  # its K/V are in place: it joins the running batch
    FALLBACK = "fallback"  # the prefill failed before the first token: prefilled here from its context
    REPREFILL = "reprefill"  # the K/V did not land after the first token: context + tokens so far, here
    END = "end"  # cancelled, or its stream already ended (e.g. at a first token that ended the request)


def outcome(req: DecodeRequest) -> Outcome:
    """The one decision of a remote request's end: it lands only with its first token, no failure and
    its K/V in place; else it goes on here unless the caller cancelled or its stream already ended."""
    rem = req.remote
    assert rem is not None
    if req.cancelled or req.stream.finished:
        return Outcome.END
    if rem.first_token is None:
        return Outcome.FALLBACK
    return Outcome.LAND if rem.failure is None and rem.kv_in_place else Outcome.REPREFILL


def _wanted(req: DecodeRequest) -> bool:
    """Whether the request still wants its K/V (once False, it stays False)."""
    assert req.remote is not None
    return not req.cancelled and not req.stream.finished and req.remote.failure is None


class PrefillLink:
    """What a decode node's remote requests share: gRPC stubs to prefill nodes, the KV receiver and the
    node; `end` is the servicer's way of ending a request (frees what the engine holds, drops it)."""

    def __init__(self, ctx: NodeContext, config: DecodeNodeConfig, metrics: DecodeMetrics,
                 end: Callable[[DecodeRequest], Awaitable[None]]) -> None:
        self.ctx, self.config, self.metrics, self._end = ctx, config, metrics, end
        self._receiver = KVReceiver(get_kernel_ops(config.engine.kernel_backend, config.engine.device))
        self._stubs: dict[tuple[str, str], tuple[grpc.aio.Channel, pb_grpc.PrefillNodeStub]] = {}
        self._kv_dtype = str(ctx.engine.engine.kv_cache.dtype).removeprefix("torch.")
        self._pool = transfer_pool(ctx.engine.engine)  # every TP rank's heads, or the engine's pool

    def _stub(self, member: Member) -> pb_grpc.PrefillNodeStub:
        key = (member.node_id, member.record.grpc_address)
        entry = self._stubs.get(key)
        if entry is None:
            channel = self.config.rpc.aio_channel(member.record.grpc_address, options=GRPC_OPTIONS)
            entry = (channel, pb_grpc.PrefillNodeStub(channel))
            self._stubs[key] = entry
        return entry[1]

    async def drive(self, req: DecodeRequest) -> None:
        """Runs one request's prefill and transfer, then does what `outcome` decides: lands it in the
        engine, prefills it here (`_prefill_here`) or ends it. Owns the reservation from
        WAITING_FOR_REMOTE_KV until the request is in the engine or ends."""
        rem = req.remote
        assert rem is not None and req.stage == Stage.WAITING_FOR_REMOTE_KV
        tracer = self.ctx.tracer
        try:
            await self._run_prefill(req, rem)
            if req.cancelled and not req.stream.finished:
                # Tell the caller now: a receive already posted may take until its deadline to resolve.
                req.stream.push(abort_output(req.key, FinishReason.ABORT))
            await self._wait_kv(req, rem)
            decision = outcome(req)
            if decision is Outcome.LAND:
                req.landed_at = self.metrics.landed(req.key)
            if tracer is not None:
                trace.end_kv_wait(tracer, req, rem, req.landed_at or time.monotonic(), decision is Outcome.LAND)
        finally:
            if tracer is not None:  # cancelled (shutdown): the span still ends
                trace.end_kv_wait(tracer, req, rem, time.monotonic(), False)
        if decision is Outcome.LAND:
            await self._land(req)
        elif decision is Outcome.END:
            await self._end(req)
        else:
            await self._prefill_here(req, rem, decision)

    async def _land(self, req: DecodeRequest) -> None:
        req.advance(Stage.IN_ENGINE)  # before `land` is queued, so a later cancel aborts in the engine
        try:
            await self.ctx.engine.land(req.key)
        except (KeyError, ValueError) as err:
            req.error = f"landing after the transfer failed: {err}"
            await self._end(req)

    async def _run_prefill(self, req: DecodeRequest, rem: RemotePrefill) -> None:
        """The Prefill call, its failures recorded in `rem.failure`."""
        try:
            await self._read_prefill(req, rem)
        except grpc.aio.AioRpcError as err:
            first = rem.fail(failure_reason(err.code()),
                             f"prefill node {rem.prefill_node.node_id}: {err.code().name}: {err.details()}")
            self._close_channel(rem, first.error)
        except asyncio.CancelledError:
            # Our own cancel of the call (lease lost, first token late) lands here as well.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                await asyncio.shield(self._end(req))
                raise
            rem.fail(FailureReason.ERROR, f"prefill call to {rem.prefill_node.node_id} cancelled")
        except Exception as err:  # a bug here must not leak the reservation
            log.exception("request %s: driver failed", req.key)
            rem.fail(FailureReason.ERROR, f"{type(err).__name__}: {err}")

    async def _prefill_here(self, req: DecodeRequest, rem: RemotePrefill, decision: Outcome) -> None:
        """Goes on here with a request whose K/V did not land (`outcome`: FALLBACK or REPREFILL): the
        reservation is freed and the engine queues the request as a local one (`LLMEngine.prefill_here`),
        keeping its id, stream, params, seed and detokenizer: before the first token (the prefill
        failed: node dead, refusing, erroring, late, or its lease lost) from the prompt, counted as a
        fallback; after it (the node died or left, the channel failed, the send failed, the receive timed
        out or failed its checksum) from the prompt plus the tokens already streamed, counted as a
        re-prefill, so the next token follows the last one the caller got. From then on it is a local
        request (`remote` None, so later responses name this node as its prefill node)."""
        # A call that ended without a cause of its own counts as an error.
        missing = "the K/V" if rem.first_token is not None else "a first token"
        failure = rem.fail(FailureReason.ERROR,
                           f"prefill node {rem.prefill_node.node_id} ended the call without {missing}")
        if decision is Outcome.REPREFILL:
            log.warning("request %s: KV from %s did not land after the first token (%s: %s); re-prefilling here",
                        req.key, rem.prefill_node.node_id, failure.reason.value, failure.error)
            self.metrics.reprefill(failure.reason)
        else:
            log.warning("request %s: prefill on %s failed before its first token (%s: %s); prefilling here",
                        req.key, rem.prefill_node.node_id, failure.reason.value, failure.error)
            self.metrics.local_prefill_fallback(failure.reason)
        req.remote, req.reservation = None, None
        req.advance(Stage.IN_ENGINE)  # before the engine hears of it, so a later cancel aborts in the engine
        try:
            await self.ctx.engine.prefill_here(req.key)
        except (KeyError, ValueError, RuntimeError) as err:
            req.error = f"local prefill after the remote one failed: {err}"
            await self._end(req)

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
            request_id=req.request_id, attempt=req.attempt, prompt_token_ids=req.context_ids,
            params=params_to_proto(req.params),
            num_prompt_tokens=len(req.prompt) if req.resume is not None else 0,
            decode_node_id=self.config.node_id, num_skip_blocks=req.reservation.num_cached_blocks,
            dst_block_ids=list(req.reservation.fill_block_ids), block_size=self.config.engine.block_size,
            kv_dtype=self._kv_dtype, layout_version=KV_LAYOUT_VERSION, model_fingerprint=self.ctx.fingerprint,
        )
        # Tracing on: the Prefill call carries the KV wait span's traceparent.
        metadata = trace.start_kv_wait(self.ctx.tracer, req, rem) if self.ctx.tracer is not None else None
        rem.call = self._stub(rem.prefill_node).Prefill(msg, metadata=metadata)
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
        if rem.first_token is not None or rem.call is None or rem.call.done():
            return
        first = rem.fail(FailureReason.TIMEOUT,
                         f"no first token from {rem.prefill_node.node_id} in {self.config.prefill_timeout_s:g}s")
        # A layer-wise send may have been announced before the first token: its receive resolves now.
        self._close_channel(rem, first.error)
        rem.call.cancel()

    async def _on_first_token(self, req: DecodeRequest, rem: RemotePrefill, first: pb.FirstToken) -> None:
        rem.first_token = first.token_id
        rem.cached_tokens = first.num_cached_tokens
        req.timing.prefill_queue_s = first.queue_s
        req.timing.prefill_s = first.prefill_s
        if req.cancelled or req.stream.finished:
            return
        logprob = logprob_from_proto(first.logprob) if first.HasField("logprob") else None
        await self.ctx.engine.append_first_token(req.key, first.token_id, logprob)

    def _on_transfer_start(self, req: DecodeRequest, rem: RemotePrefill, ts: pb.TransferStart) -> None:
        assert req.reservation is not None
        meta = transfer_meta_from_proto(ts, req.key, rem.prefill_node.node_id, self.config.node_id)
        address = ts.prefill_kv_address or rem.prefill_node.record.kv_address
        try:
            channel = self.ctx.channels.channel_from(rem.prefill_node.node_id, address, meta.epoch)
        except ChannelError as err:
            rem.fail(FailureReason.RECEIVE_FAILED, f"cannot open the KV channel: {err}")
            return
        rem.channel = channel
        timeout = self.config.transfer_timeout_s
        if not _wanted(req):
            # Nobody wants these blocks any more; consuming the bytes keeps later transfers in step.
            rem.recv = self._receiver.discard(channel, meta, timeout_s=timeout)
            return
        recv = self._receiver.recv(channel, self._pool, list(req.reservation.fill_block_ids),
                                   meta, timeout_s=timeout)
        rem.recv = recv
        loop = asyncio.get_running_loop()
        recv.future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._on_received, rem, recv))

    def _on_received(self, rem: RemotePrefill, recv: TransferHandle) -> None:
        """A receive resolved (event loop). A failed one ends the Prefill call at once, so the request
        is re-prefilled here without waiting for the prefill node's own verdict on its send."""
        result = recv.result()
        if result.ok or rem.call is None or rem.call.done():
            return
        self._receive_failed(rem, result)
        rem.call.cancel()

    def _vouched(self, rem: RemotePrefill, result: TransferResult) -> bool:
        """Whether a completed receive's bytes are the ones the prefill node sent: its digest (from
        TransferDone ok) equals ours, same algorithm. Fails closed: a send that was not reported done
        lands nothing, and a mismatch (or a missing digest) is counted and fails the transfer."""
        if rem.sent is None:
            rem.fail(FailureReason.ERROR, "the prefill node did not report its send done")
            return False
        if rem.sent.checksum == (CHECKSUM_ALGO, result.checksum):
            return True
        self.metrics.kv_checksum_failure()
        rem.fail(FailureReason.CHECKSUM, f"KV checksum mismatch: sent {rem.sent.checksum}, received "
                                         f"{(CHECKSUM_ALGO, result.checksum)}")
        return False

    @staticmethod
    def _receive_failed(rem: RemotePrefill, result: TransferResult) -> None:
        timed_out = (result.error or "").startswith("timeout")
        rem.fail(FailureReason.TIMEOUT if timed_out else FailureReason.RECEIVE_FAILED,
                 f"KV receive failed: {result.error}")

    def _on_transfer_done(self, req: DecodeRequest, rem: RemotePrefill, done: pb.TransferDone) -> None:
        if done.ok:
            checksum = (done.kv_checksum_algo, done.kv_checksum) if done.kv_checksum_algo else None
            rem.sent = SendReport(skipped=done.skipped, checksum=checksum)
            req.timing.transfer_s = done.transfer_s
            return
        rem.fail(FailureReason.SEND_FAILED, f"prefill node {rem.prefill_node.node_id}: {done.error}")
        self._close_channel(rem, f"prefill node reported a failed send: {done.error}")

    async def _wait_kv(self, req: DecodeRequest, rem: RemotePrefill) -> None:
        """Waits out a posted receive, then records whether the K/V are in the reserved blocks, intact
        (`rem.kv_in_place`). Once it returns no receive can write the reservation."""
        if rem.recv is None:
            rem.kv_in_place = rem.sent is not None and rem.sent.skipped
            return
        result = await rem.recv.wait()
        if not result.ok:
            self._receive_failed(rem, result)
        elif _wanted(req):
            # Only a receive into the reservation is checked: one posted for a request already cancelled,
            # finished or failed discarded its bytes.
            rem.kv_in_place = self._vouched(rem, result)

    def cancel(self, req: DecodeRequest) -> None:
        """The caller is gone: the driver stops the prefill and frees what the request holds."""
        if req.cancelled:
            return
        req.cancelled = True
        if req.remote is not None and req.remote.call is not None:
            self.send_abort(req)

    def send_abort(self, req: DecodeRequest) -> None:
        assert req.remote is not None
        prefill = req.remote.prefill_node

        async def abort() -> None:
            try:
                message = pb.AbortRequest(request_id=req.request_id, attempt=req.attempt)
                await self._stub(prefill).Abort(message, timeout=5.0)
            except grpc.aio.AioRpcError as err:
                log.info("abort of %s on %s failed: %s", req.key, prefill.node_id, err.code().name)

        self.ctx.spawn(abort(), f"prefill-abort-{req.key}")

    @staticmethod
    def prefill_left(node_id: str, requests: Iterable[DecodeRequest]) -> None:
        """Fails the requests a departed prefill node was still serving (its sends are dropped)."""
        for req in requests:
            rem = req.remote
            if rem is None or rem.prefill_node.node_id != node_id or req.stage != Stage.WAITING_FOR_REMOTE_KV:
                continue
            if rem.sent is not None:  # its part is done: its leaving no longer concerns the request
                continue
            log.warning("prefill node %s left the registry: failing %s", node_id, req.key)
            rem.fail(FailureReason.LEASE_LOST, f"prefill node {node_id} left the registry")
            if rem.channel is not None:
                rem.channel.close(f"prefill node {node_id} left the registry")
            if rem.call is not None:
                rem.call.cancel()

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
