"""The sending side of KV transfers (prefill node): `KVSender` queues a request's blocks on a pair channel
and returns a `SendHandle`; layer-wise sends wait for each layer's K/V (see `SendHandle.layer_ready`).
Wire format and ordering contract: `kv_transfer.transfer`."""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future

import torch

from pdserve.kernels.interface import KV_LAYOUT_VERSION, KernelOps
from pdserve.kv_transfer import hostcopy
from pdserve.kv_transfer.backend import PendingOp, TransferTimeout
from pdserve.kv_transfer.channel import Channel, ChannelJob, WorkerContext
from pdserve.kv_transfer.checksum import KVDigest
from pdserve.kv_transfer.sharded import HeadShardedKV, KVPool
from pdserve.kv_transfer.staging import StagingBuffers, StagingSlot
from pdserve.kv_transfer.transfer import (
    TAG_SPACE,
    BlockIds,
    TransferHandle,
    block_id_tensor,
    dtype_name,
    message_ranges,
    sync_device,
)
from pdserve.kv_transfer.types import PREFILL_RANK, ChannelError, TransferMeta, TransferResult


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
    """A submitted send. For a layer-wise send, call `layer_ready(l)` as each layer's KV is
    written (any order, any thread; on CUDA from the thread whose stream wrote it). If the prefill
    fails halfway, still call `all_layers_ready()` and have the decode node `discard` the
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


class _SendJob(ChannelJob):
    """Packs and sends the source blocks; reads kv_cache, changes nothing of it."""

    def __init__(
        self, meta: TransferMeta, ops: KernelOps, kv_cache: KVPool, ids: torch.Tensor,
        gate: _LayerGate, timeout_s: float,
    ) -> None:
        super().__init__(meta.request_id, timeout_s)
        self._digest = KVDigest()  # over the staged messages, in order (`_fill` runs in message order)
        self.meta = meta
        self._ops = ops
        self._kv = kv_cache  # [L, 2, NB, BS, Hkv, D]
        self._ids = ids  # [n] int64
        self._gate = gate
        self._tag = meta.seq_no % TAG_SPACE
        self._ranges = message_ranges(kv_cache.shape[0], meta.layers_per_message, ids.numel())
        self._slot_base = 0
        # The first message, packed and posted by the previous job while its own last one was in flight.
        self._present: tuple[StagingSlot, PendingOp] | None = None
        self._host_copy = isinstance(kv_cache, torch.Tensor) and hostcopy.supported(kv_cache)

    def on_abandon(self) -> None:
        self._gate.abandon()

    def _slot(self, ctx: WorkerContext, i: int) -> StagingSlot:
        _, _, _, bs, h, d = self._kv.shape
        l0, l1 = self._ranges[i]
        index = (self._slot_base + i) % StagingBuffers.NUM_SLOTS
        return ctx.staging.slot(index, (l1 - l0, 2, self._ids.numel(), bs, h, d), self._kv.dtype)

    def _fill(self, ctx: WorkerContext, slot: StagingSlot, i: int, events: list[torch.cuda.Event]) -> None:
        """Packs message i into `slot` and digests it; what `slot.wire` holds afterwards is what is sent."""
        l0, l1 = self._ranges[i]
        if ctx.stream is not None:
            for event in events:
                ctx.stream.wait_event(event)
        t0 = time.perf_counter()
        self._pack(slot, l0, l1)  # [l1-l0, 2, n, BS, Hkv, D]
        if slot.mirrored:
            slot.wire.copy_(slot.compute, non_blocking=True)
            sync_device(ctx)  # gloo reads the pinned mirror from the host
        t1 = time.perf_counter()
        self._digest.update(slot.wire)
        self.phases.copy += t1 - t0
        self.phases.digest += time.perf_counter() - t1

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
        t0 = time.perf_counter()
        self._present = (slot, ctx.group.isend(slot.wire, ctx.peer, self._tag))
        self.phases.wire += time.perf_counter() - t0

    def execute(self, ctx: WorkerContext) -> int:
        in_flight: deque[PendingOp] = deque()
        total = 0
        for i, (l0, l1) in enumerate(self._ranges):
            if i == 0 and self._present is not None:
                slot, op = self._present
                self._present = None
            else:
                t0 = time.perf_counter()
                events = self._gate.wait(l0, l1, self.deadline)
                ctx.moved()  # the prefill computed these layers
                t1 = time.perf_counter()
                if len(in_flight) == StagingBuffers.NUM_SLOTS:
                    in_flight.popleft().wait(self.deadline)  # frees the slot this message reuses
                    ctx.moved()
                self.phases.layers += t1 - t0
                self.phases.wire += time.perf_counter() - t1
                slot = self._slot(ctx, i)
                self._fill(ctx, slot, i, events)
                t0 = time.perf_counter()
                op = ctx.group.isend(slot.wire, ctx.peer, self._tag)  # gloo may write the bytes right here
                self.phases.wire += time.perf_counter() - t0
            in_flight.append(op)
            total += slot.wire.numel() * slot.wire.element_size()
        nxt = ctx.peek(self.seq_no + 1)
        if isinstance(nxt, _SendJob):
            if len(in_flight) == StagingBuffers.NUM_SLOTS:
                t0 = time.perf_counter()
                in_flight.popleft().wait(self.deadline)  # frees the slot the next job packs into
                self.phases.wire += time.perf_counter() - t0
            nxt.presend(ctx, (self._slot_base + len(self._ranges)) % StagingBuffers.NUM_SLOTS)
        t0 = time.perf_counter()
        for op in in_flight:
            op.wait(self.deadline)
            ctx.moved()
        self.phases.wire += time.perf_counter() - t0
        self.checksum = self._digest.value()
        return total

    def _pack(self, slot: StagingSlot, l0: int, l1: int) -> None:
        if isinstance(self._kv, HeadShardedKV):  # every rank's heads, straight from its pool
            self._kv.gather(l0, l1, self._ids, slot.compute)
        elif self._host_copy:  # [l1-l0, 2, n, BS, Hkv, D], on this thread only (see hostcopy)
            hostcopy.gather(self._kv[l0:l1], self._ids, slot.compute)
        elif l1 - l0 == 1:
            self._ops.pack_blocks(self._kv, self._ids, layer=l0, out=slot.compute[0])
        else:
            self._ops.pack_blocks(self._kv[l0:l1], self._ids, out=slot.compute)


class KVSender:
    """Prefill side: ships KV blocks from the local KV cache over a channel (rank 0)."""

    # The job that ships one send; a subclass may name one of its own (the tests' corrupting sender).
    _job_type: type[_SendJob] = _SendJob

    def __init__(
        self, ops: KernelOps, message_bytes: int | None = 1 << 20, *, layerwise_min_bytes: int = 256 << 10,
    ) -> None:
        # message_bytes: target size of a whole-request message (at least one layer each);
        # None sends a whole request as a single message.
        # layerwise_min_bytes: a layer-wise message holds as few whole layers as reach this size.
        # Every message costs a fixed ~0.1 ms on each side (a rendezvous with the peer and thread
        # wake-ups, measured by bench/kv_transfer_bench.py), as much as moving ~200 KiB; layers below
        # that travel in groups, so a short prompt's transfer pays a few such costs instead of one per
        # layer, at the price of the last group's first layers leaving a little later.
        self._ops = ops
        self._message_bytes = message_bytes
        self._layerwise_min_bytes = layerwise_min_bytes

    def layers_per_message(self, num_layers: int, layer_bytes: int, layerwise: bool) -> int:
        if layerwise:  # the fewest layers that reach layerwise_min_bytes
            return max(1, min(num_layers, -(-self._layerwise_min_bytes // max(layer_bytes, 1))))
        if self._message_bytes is None or layer_bytes == 0:
            return num_layers
        return max(1, min(num_layers, self._message_bytes // layer_bytes))

    def send(
        self,
        channel: Channel,
        kv_cache: KVPool,  # [L, 2, NB, BS, Hkv, D], or every TP rank's heads (HeadShardedKV)
        block_ids: BlockIds,  # [n] source block ids, in the order the receiver's ids follow
        *,
        request_id: str,
        num_tokens: int,
        timeout_s: float,
        layerwise: bool = False,
    ) -> SendHandle:
        """Queues a transfer of exactly `block_ids` and returns at once. Whole-request mode ships
        every layer as soon as the worker reaches it; layer-wise mode ships layer l once
        `handle.layer_ready(l)` was called. Raises ValueError for bad arguments (no seq_no is then
        used); a channel already down yields a handle that is resolved as failed."""
        if channel.rank != PREFILL_RANK:
            raise ValueError("KVSender needs a prefill-side channel (rank 0)")
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache must be [L, 2, NB, BS, Hkv, D], got {tuple(kv_cache.shape)}")
        if kv_cache.device.type != channel.device.type:
            raise ValueError(f"kv_cache is on {kv_cache.device}, channel serves {channel.device}")
        num_layers, _, num_pool_blocks, bs, h, d = kv_cache.shape
        ids = block_id_tensor(block_ids, kv_cache.device, num_pool_blocks, unique=False)
        layer_bytes = 2 * ids.numel() * bs * h * d * kv_cache.element_size()
        gate = _LayerGate(num_layers, kv_cache.device)
        if not layerwise:
            gate.mark(range(num_layers))
        key = channel.key

        def make(seq_no: int) -> _SendJob:
            meta = TransferMeta(
                request_id=request_id, prefill_id=key.prefill_id, decode_id=key.decode_id, epoch=key.epoch,
                seq_no=seq_no, num_blocks=ids.numel(), num_tokens=num_tokens, layout_version=KV_LAYOUT_VERSION,
                dtype=dtype_name(kv_cache.dtype), geometry=(num_layers, bs, h, d),
                layers_per_message=self.layers_per_message(num_layers, layer_bytes, layerwise),
            )
            return self._job_type(meta, self._ops, kv_cache, ids, gate, timeout_s)

        job = channel.submit_next(make)
        assert isinstance(job, _SendJob)
        return SendHandle(job.future, job.meta, gate)
