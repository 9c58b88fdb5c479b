"""KV block transfers over a pair channel: whole-request or layer by layer.

Wire: a transfer is a sequence of messages tagged with its `seq_no`. Message i holds layers
``[i * k, min((i + 1) * k, L))`` with ``k = meta.layers_per_message``, packed with the kernel
ops' `pack_blocks` (wire format v1), so the concatenation of all messages is exactly the v1
buffer ``[L, 2, n, BS, Hkv, D]``. Layer-by-layer transfers use k = 1; whole-request transfers
use the largest k whose message fits `message_bytes`. Each side double-buffers: the sender packs
message i+1 while message i is on the wire, the receiver posts the receive of message i+1 before
unpacking message i, and both reach into the next queued transfer for its first message, so
back-to-back transfers stream without a gap. A transfer of zero blocks sends no message.

Ordering contract with the control plane:
  1. prefill: ``handle = sender.send(channel, kv, src_ids, ...)`` assigns ``handle.meta`` (with
     epoch and seq_no); the prefill node forwards ``handle.meta`` to the decode node.
  2. decode: for every meta it receives, it calls ``receiver.recv(channel, kv, dst_ids, meta)``
     (or ``receiver.discard(channel, meta)`` if it no longer wants the blocks) on the channel of
     ``meta.epoch``, in any order and from any thread; the channel worker runs them in seq_no order.
  3. The i-th source block lands in the i-th destination block. Blocks the decode node already
     holds (prefix-cache hits) are simply left out of both lists.
  4. Source blocks must stay untouched, and destination blocks unread, until the handle resolves.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np
import torch

from kernels.interface import KV_LAYOUT_VERSION, KernelOps
from kv_transfer import hostcopy
from kv_transfer.backend import PendingOp, TransferTimeout
from kv_transfer.channel import Channel, ChannelJob, WorkerContext
from kv_transfer.staging import StagingBuffers, StagingSlot
from kv_transfer.types import DECODE_RANK, PREFILL_RANK, ChannelError, TransferMeta, TransferResult

BlockIds = torch.Tensor | Sequence[int]
_TAG_SPACE = 1 << 31  # c10d tags are 32-bit; seq_no wraps far beyond any in-flight window


def message_ranges(num_layers: int, layers_per_message: int, num_blocks: int) -> list[tuple[int, int]]:
    """The [l0, l1) layer range of every message of a transfer (none when there are no blocks)."""
    if num_blocks == 0:
        return []
    k = max(1, layers_per_message)
    return [(l0, min(l0 + k, num_layers)) for l0 in range(0, num_layers, k)]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _block_ids(block_ids: BlockIds, device: torch.device, num_pool_blocks: int, unique: bool) -> torch.Tensor:
    """Validated int64 ids on `device`; raises ValueError. Plain lists are checked in Python: a
    few torch calls per submission would each hand the GIL to the busy channel workers."""
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1:
            raise ValueError(f"block ids must be 1-D, got shape {tuple(block_ids.shape)}")
        ids = block_ids.to(device=device, dtype=torch.int64)
        if ids.numel():
            lo, hi = (int(x) for x in torch.aminmax(ids))
            _check_range(lo, hi, num_pool_blocks)
            if unique and torch.unique(ids).numel() != ids.numel():
                raise ValueError("destination block ids must be distinct")
        return ids
    values = [int(x) for x in block_ids]
    if values:
        _check_range(min(values), max(values), num_pool_blocks)
        if unique and len(set(values)) != len(values):
            raise ValueError("destination block ids must be distinct")
    return torch.tensor(values, dtype=torch.int64, device=device)


def _check_range(lo: int, hi: int, num_pool_blocks: int) -> None:
    if lo < 0 or hi >= num_pool_blocks:
        raise ValueError(f"block ids must lie in [0, {num_pool_blocks}), got [{lo}, {hi}]")


class TransferHandle:
    """A submitted transfer. Thread-safe; await it from asyncio code with `await handle.wait()`."""

    def __init__(self, future: Future[TransferResult], meta: TransferMeta) -> None:
        self.future = future
        self.meta = meta

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> TransferResult:
        return self.future.result(timeout)

    async def wait(self) -> TransferResult:
        return await asyncio.wrap_future(self.future)


class _LayerGate:
    """Which layers of a send may be packed. On CUDA each layer carries an event recorded on the
    producer's stream, so the worker's stream waits for the compute instead of the host."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self._ready = [False] * num_layers
        self._events: list[torch.cuda.Event | None] = [None] * num_layers
        self._device = device
        self._cv = threading.Condition()
        self._abandoned = False

    def mark(self, layers: range) -> None:
        event = None
        if self._device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
        with self._cv:
            for layer in layers:
                if not self._ready[layer]:
                    self._ready[layer] = True
                    self._events[layer] = event
            self._cv.notify_all()

    def abandon(self) -> None:
        with self._cv:
            self._abandoned = True
            self._cv.notify_all()

    def ready(self, l0: int, l1: int) -> list[torch.cuda.Event] | None:
        """The layers' events if all of [l0, l1) are ready, else None; never waits."""
        with self._cv:
            if not all(self._ready[l0:l1]):
                return None
            return [e for e in self._events[l0:l1] if e is not None]

    def wait(self, l0: int, l1: int, deadline: float) -> list[torch.cuda.Event]:
        with self._cv:
            while not all(self._ready[l0:l1]):
                if self._abandoned:
                    raise ChannelError("channel went down while waiting for layers")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [i for i in range(l0, l1) if not self._ready[i]]
                    raise TransferTimeout(f"layers {missing} never became ready")
                self._cv.wait(left)
            return [e for e in self._events[l0:l1] if e is not None]


class SendHandle(TransferHandle):
    """A submitted send. For a layer-by-layer send, call `layer_ready(l)` as each layer's KV is
    written (any order, any thread; on CUDA from the thread whose stream wrote it). If the prefill
    is abandoned halfway, still call `all_layers_ready()` and have the decode node `discard` the
    transfer: a layer that never becomes ready breaks the channel at the transfer's deadline."""

    def __init__(self, future: Future[TransferResult], meta: TransferMeta, gate: _LayerGate) -> None:
        super().__init__(future, meta)
        self._gate = gate

    def layer_ready(self, layer: int) -> None:
        """Marks one layer's KV as complete so the channel may ship it. Changes only the gate."""
        num_layers = self.meta.geometry[0]
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer must lie in [0, {num_layers}), got {layer}")
        self._gate.mark(range(layer, layer + 1))

    def all_layers_ready(self) -> None:
        """Marks every layer complete. Changes only the gate."""
        self._gate.mark(range(self.meta.geometry[0]))


def _sync(ctx: WorkerContext) -> None:
    if ctx.stream is not None:
        ctx.stream.synchronize()


class _SendJob(ChannelJob):
    """Packs and sends the source blocks; reads kv_cache, changes nothing of it."""

    def __init__(
        self, meta: TransferMeta, ops: KernelOps, kv_cache: torch.Tensor, ids: torch.Tensor,
        gate: _LayerGate, timeout_s: float,
    ) -> None:
        super().__init__(meta.request_id, timeout_s)
        self.meta = meta
        self._ops = ops
        self._kv = kv_cache  # [L, 2, NB, BS, Hkv, D]
        self._ids = ids  # [n] int64
        self._gate = gate
        self._tag = meta.seq_no % _TAG_SPACE
        self._ranges = message_ranges(kv_cache.shape[0], meta.layers_per_message, ids.numel())
        self._slot_base = 0
        # The first message, packed and posted by the previous job while its own last one was in flight.
        self._present: tuple[StagingSlot, PendingOp] | None = None
        self._host_copy = hostcopy.supported(kv_cache)

    def on_abandon(self) -> None:
        self._gate.abandon()

    def _slot(self, ctx: WorkerContext, i: int) -> StagingSlot:
        _, _, _, bs, h, d = self._kv.shape
        l0, l1 = self._ranges[i]
        index = (self._slot_base + i) % StagingBuffers.NUM_SLOTS
        return ctx.staging.slot(index, (l1 - l0, 2, self._ids.numel(), bs, h, d), self._kv.dtype)

    def _fill(self, ctx: WorkerContext, slot: StagingSlot, i: int, events: list[torch.cuda.Event]) -> None:
        l0, l1 = self._ranges[i]
        if ctx.stream is not None:
            for event in events:
                ctx.stream.wait_event(event)
        self._pack(slot, l0, l1)  # [l1-l0, 2, n, BS, Hkv, D]
        if slot.mirrored:
            slot.wire.copy_(slot.compute, non_blocking=True)
            _sync(ctx)  # gloo reads the pinned mirror from the host

    def presend(self, ctx: WorkerContext, slot_base: int) -> None:
        """Packs and posts this job's first message while the previous job's last one is still on
        the wire, if its layers are ready, so the transport has the next message queued when the
        previous one completes (as a raw stream of sends would). Called by the previous job, on the
        worker thread, after all of that job's messages were posted and with `slot_base` free."""
        if not self._ranges or self._present is not None:
            return
        l0, l1 = self._ranges[0]
        events = self._gate.ready(l0, l1)
        if events is None:
            return
        self._slot_base = slot_base
        slot = self._slot(ctx, 0)
        self._fill(ctx, slot, 0, events)
        self._present = (slot, ctx.group.isend(slot.wire, ctx.peer, self._tag))

    def execute(self, ctx: WorkerContext) -> int:
        in_flight: deque[PendingOp] = deque()
        total = 0
        for i, (l0, l1) in enumerate(self._ranges):
            if i == 0 and self._present is not None:
                slot, op = self._present
                self._present = None
            else:
                events = self._gate.wait(l0, l1, self.deadline)
                if len(in_flight) == StagingBuffers.NUM_SLOTS:
                    in_flight.popleft().wait(self.deadline)  # frees the slot this message reuses
                slot = self._slot(ctx, i)
                self._fill(ctx, slot, i, events)
                op = ctx.group.isend(slot.wire, ctx.peer, self._tag)
            in_flight.append(op)
            total += slot.wire.numel() * slot.wire.element_size()
        nxt = ctx.peek(self.seq_no + 1)
        if isinstance(nxt, _SendJob):
            if len(in_flight) == StagingBuffers.NUM_SLOTS:
                in_flight.popleft().wait(self.deadline)  # frees the slot the next job packs into
            nxt.presend(ctx, (self._slot_base + len(self._ranges)) % StagingBuffers.NUM_SLOTS)
        for op in in_flight:
            op.wait(self.deadline)
        return total

    def _pack(self, slot: StagingSlot, l0: int, l1: int) -> None:
        if self._host_copy:  # [l1-l0, 2, n, BS, Hkv, D], on this thread only (see hostcopy)
            hostcopy.gather(self._kv[l0:l1], self._ids, slot.compute)
        elif l1 - l0 == 1:
            self._ops.pack_blocks(self._kv, self._ids, layer=l0, out=slot.compute[0])
        else:
            self._ops.pack_blocks(self._kv[l0:l1], self._ids, out=slot.compute)


class _RecvJob(ChannelJob):
    """Receives a transfer and scatters it into the destination blocks (changes only those blocks);
    with no kv_cache it drains the messages and changes nothing."""

    def __init__(
        self, meta: TransferMeta, ops: KernelOps, kv_cache: torch.Tensor | None, ids: torch.Tensor | None,
        timeout_s: float, on_layer: Callable[[int], None] | None, rejection: str | None,
    ) -> None:
        super().__init__(meta.request_id, timeout_s)
        self.meta = meta
        self.seq_no = meta.seq_no
        self.rejection = rejection
        self._ops = ops
        self._kv = kv_cache  # [L, 2, NB, BS, Hkv, D] or None to drain
        self._ids = ids  # [n] int64
        self._on_layer = on_layer
        self._dtype = _dtype_from_name(meta.dtype)
        self._tag = meta.seq_no % _TAG_SPACE
        self._ranges = message_ranges(meta.geometry[0], meta.layers_per_message, meta.num_blocks)
        self._slot_base = 0
        self._preposted: tuple[StagingSlot, PendingOp, int, int] | None = None
        self._host_ids: np.ndarray | None = None  # [n] int64, set when the pool takes hostcopy.scatter
        if kv_cache is not None and ids is not None and hostcopy.supported(kv_cache):
            self._host_ids = ids.numpy()

    def prepost(self, ctx: WorkerContext, slot_base: int) -> None:
        """Posts this job's first receive while the previous job finishes, so the sender never waits
        for the receiver between transfers. Called by the previous job, on the worker thread."""
        if self._ranges and self._preposted is None:
            self._slot_base = slot_base
            self._preposted = self._post(ctx, 0)

    def _post(self, ctx: WorkerContext, i: int) -> tuple[StagingSlot, PendingOp, int, int]:
        _, bs, h, d = self.meta.geometry
        l0, l1 = self._ranges[i]
        index = (self._slot_base + i) % StagingBuffers.NUM_SLOTS
        slot = ctx.staging.slot(index, (l1 - l0, 2, self.meta.num_blocks, bs, h, d), self._dtype)
        return slot, ctx.group.irecv(slot.wire, ctx.peer, self._tag), l0, l1

    def execute(self, ctx: WorkerContext) -> int:
        ranges = self._ranges
        posted: deque[tuple[StagingSlot, PendingOp, int, int]] = deque()
        if self._preposted is not None:
            posted.append(self._preposted)
            self._preposted = None
        elif ranges:
            posted.append(self._post(ctx, 0))
        total = 0
        for i in range(len(ranges)):
            # The slot posted now held message i-1 (or the previous job's last), already unpacked.
            if i + 1 < len(ranges):
                posted.append(self._post(ctx, i + 1))
            else:
                nxt = ctx.peek(self.seq_no + 1)
                if isinstance(nxt, _RecvJob):
                    nxt.prepost(ctx, (self._slot_base + i + 1) % StagingBuffers.NUM_SLOTS)
            slot, op, l0, l1 = posted.popleft()
            op.wait(self.deadline)
            total += slot.wire.numel() * slot.wire.element_size()
            if self._kv is None:
                continue
            if slot.mirrored:
                slot.compute.copy_(slot.wire, non_blocking=True)
            self._unpack(slot, l0, l1)
            _sync(ctx)  # the slot is reposted next round, and on_layer promises the blocks are written
            if self._on_layer is not None:
                for layer in range(l0, l1):
                    self._on_layer(layer)
        return total

    def _unpack(self, slot: StagingSlot, l0: int, l1: int) -> None:
        assert self._kv is not None and self._ids is not None
        if self._host_ids is not None:  # on this thread only (see hostcopy)
            hostcopy.scatter(slot.compute, self._kv[l0:l1], self._host_ids)
        elif l1 - l0 == 1:
            self._ops.unpack_blocks(slot.compute[0], self._kv, self._ids, layer=l0)
        else:
            self._ops.unpack_blocks(slot.compute, self._kv[l0:l1], self._ids)


def _failed(meta: TransferMeta, error: str) -> TransferHandle:
    future: Future[TransferResult] = Future()
    future.set_result(
        TransferResult(ok=False, bytes=0, seconds=0.0, error=error, request_id=meta.request_id, seq_no=meta.seq_no)
    )
    return TransferHandle(future, meta)


class KVSender:
    """Prefill side: ships KV blocks from the local pool over a channel (rank 0)."""

    def __init__(self, ops: KernelOps, message_bytes: int | None = 1 << 20) -> None:
        # message_bytes: target size of a whole-request message (at least one layer each);
        # None sends a whole request as a single message.
        self._ops = ops
        self._message_bytes = message_bytes

    def layers_per_message(self, num_layers: int, layer_bytes: int, layerwise: bool) -> int:
        if layerwise:
            return 1
        if self._message_bytes is None or layer_bytes == 0:
            return num_layers
        return max(1, min(num_layers, self._message_bytes // layer_bytes))

    def send(
        self,
        channel: Channel,
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
        block_ids: BlockIds,  # [n] source block ids, in the order the receiver's ids follow
        *,
        request_id: str,
        num_tokens: int,
        timeout_s: float,
        layerwise: bool = False,
    ) -> SendHandle:
        """Queues a transfer of exactly `block_ids` and returns at once. Whole-request mode ships
        every layer as soon as the worker reaches it; layer-by-layer mode ships layer l once
        `handle.layer_ready(l)` was called. Raises ValueError for bad arguments (no seq_no is then
        used); a channel already down yields a handle that is resolved as failed."""
        if channel.rank != PREFILL_RANK:
            raise ValueError("KVSender needs a prefill-side channel (rank 0)")
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache must be [L, 2, NB, BS, Hkv, D], got {tuple(kv_cache.shape)}")
        if kv_cache.device.type != channel.device.type:
            raise ValueError(f"kv_cache is on {kv_cache.device}, channel serves {channel.device}")
        num_layers, _, num_pool_blocks, bs, h, d = kv_cache.shape
        ids = _block_ids(block_ids, kv_cache.device, num_pool_blocks, unique=False)
        layer_bytes = 2 * ids.numel() * bs * h * d * kv_cache.element_size()
        gate = _LayerGate(num_layers, kv_cache.device)
        if not layerwise:
            gate.mark(range(num_layers))
        key = channel.key

        def make(seq_no: int) -> _SendJob:
            meta = TransferMeta(
                request_id=request_id, prefill_id=key.prefill_id, decode_id=key.decode_id, epoch=key.epoch,
                seq_no=seq_no, num_blocks=ids.numel(), num_tokens=num_tokens, layout_version=KV_LAYOUT_VERSION,
                dtype=_dtype_name(kv_cache.dtype), geometry=(num_layers, bs, h, d),
                layers_per_message=self.layers_per_message(num_layers, layer_bytes, layerwise),
            )
            return _SendJob(meta, self._ops, kv_cache, ids, gate, timeout_s)

        job = channel.submit_next(make)
        assert isinstance(job, _SendJob)
        return SendHandle(job.future, job.meta, gate)


class KVReceiver:
    """Decode side: receives transfers into reserved blocks of the local pool (rank 1)."""

    def __init__(self, ops: KernelOps) -> None:
        self._ops = ops

    def recv(
        self,
        channel: Channel,
        kv_cache: torch.Tensor,  # [L, 2, NB', BS, Hkv, D]; NB' may differ from the sender's
        dst_block_ids: BlockIds,  # [meta.num_blocks] reserved ids, matching the sender's order
        meta: TransferMeta,
        *,
        timeout_s: float,
        on_layer: Callable[[int], None] | None = None,
    ) -> TransferHandle:
        """Queues the receive of `meta`'s transfer and returns at once. `on_layer(l)` runs on the
        channel worker once layer l is in the pool. If the arguments don't match the metadata the
        transfer is still drained (so later ones stay in step) and resolves as failed."""
        if channel.rank != DECODE_RANK:
            raise ValueError("KVReceiver needs a decode-side channel (rank 1)")
        if meta.channel_key != channel.key:
            return _failed(meta, f"metadata is for {meta.channel_key.store_prefix}, channel is {channel.key.store_prefix}")
        ids = None
        problem = self._mismatch(meta, kv_cache)
        if problem is None:
            try:
                ids = _block_ids(dst_block_ids, kv_cache.device, kv_cache.shape[2], unique=True)
                if ids.numel() != meta.num_blocks:
                    problem = f"{ids.numel()} destination blocks for {meta.num_blocks} sent blocks"
            except ValueError as e:
                problem = str(e)
        return self._submit(channel, meta, timeout_s, None if problem else kv_cache, ids, on_layer, problem)

    def discard(self, channel: Channel, meta: TransferMeta, *, timeout_s: float) -> TransferHandle:
        """Consumes `meta`'s transfer without storing it (the request was dropped), keeping the
        channel in step. Changes no pool memory."""
        if channel.rank != DECODE_RANK:
            raise ValueError("KVReceiver needs a decode-side channel (rank 1)")
        if meta.channel_key != channel.key:
            return _failed(meta, f"metadata is for {meta.channel_key.store_prefix}, channel is {channel.key.store_prefix}")
        return self._submit(channel, meta, timeout_s, None, None, None, None)

    def _submit(
        self, channel: Channel, meta: TransferMeta, timeout_s: float, kv_cache: torch.Tensor | None,
        ids: torch.Tensor | None, on_layer: Callable[[int], None] | None, problem: str | None,
    ) -> TransferHandle:
        try:
            job = _RecvJob(meta, self._ops, kv_cache, ids, timeout_s, on_layer, problem)
        except ValueError as e:
            # Without a known dtype the messages cannot even be sized: the stream is lost.
            channel.close(f"undecodable metadata for seq {meta.seq_no}: {e}")
            return _failed(meta, str(e))
        channel.submit(job)
        return TransferHandle(job.future, meta)

    @staticmethod
    def _mismatch(meta: TransferMeta, kv_cache: torch.Tensor) -> str | None:
        if meta.layout_version != KV_LAYOUT_VERSION:
            return f"layout version {meta.layout_version} is not {KV_LAYOUT_VERSION}"
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            return f"kv_cache must be [L, 2, NB, BS, Hkv, D], got {tuple(kv_cache.shape)}"
        if _dtype_name(kv_cache.dtype) != meta.dtype:
            return f"pool dtype {_dtype_name(kv_cache.dtype)} differs from the sender's {meta.dtype}"
        num_layers, _, _, bs, h, d = kv_cache.shape
        if (num_layers, bs, h, d) != meta.geometry:
            return f"pool geometry (L, BS, Hkv, D) = {(num_layers, bs, h, d)} differs from the sender's {meta.geometry}"
        return None
