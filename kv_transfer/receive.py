"""The receiving side of KV transfers (decode node): `KVReceiver` posts the receive of an announced
transfer into destination blocks (or discards it, keeping the channel in step). Wire format and ordering
contract: `kv_transfer.transfer`."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from pdserve.kernels.interface import KV_LAYOUT_VERSION, KernelOps
from pdserve.kv_transfer import hostcopy
from pdserve.kv_transfer.backend import PendingOp
from pdserve.kv_transfer.channel import Channel, ChannelJob, WorkerContext
from pdserve.kv_transfer.checksum import KVDigest
from pdserve.kv_transfer.sharded import HeadShardedKV, KVPool
from pdserve.kv_transfer.staging import StagingBuffers, StagingSlot
from pdserve.kv_transfer.transfer import (
    TAG_SPACE,
    BlockIds,
    TransferHandle,
    block_id_tensor,
    dtype_from_name,
    dtype_name,
    failed_handle,
    message_ranges,
    sync_device,
)
from pdserve.kv_transfer.types import DECODE_RANK, TransferMeta


class _RecvJob(ChannelJob):
    """Receives a transfer and scatters it into the destination blocks (changes only those blocks);
    with no kv_cache it drains the messages and changes nothing."""

    def __init__(
        self, meta: TransferMeta, ops: KernelOps, kv_cache: KVPool | None, ids: torch.Tensor | None,
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
        self._dtype = dtype_from_name(meta.dtype)
        self._tag = meta.seq_no % TAG_SPACE
        self._ranges = message_ranges(meta.geometry[0], meta.layers_per_message, meta.num_blocks)
        self._slot_base = 0
        # Receives posted and not yet waited, in message order (the first ones maybe by `prepost`).
        self._posted: deque[tuple[StagingSlot, PendingOp, int, int]] = deque()
        self._next_post = 0  # the next message to post; the slot base is fixed once it is past 0
        self._digest = KVDigest()  # over the received messages, in order, before they are unpacked
        self._host_ids: np.ndarray | None = None  # [n] int64, set when the KV cache takes hostcopy.scatter
        if isinstance(kv_cache, torch.Tensor) and ids is not None and hostcopy.supported(kv_cache):
            self._host_ids = ids.numpy()

    def prepost(self, ctx: WorkerContext, slot_base: int, upto: int) -> None:
        """Posts this job's receives [0, upto) (those not yet posted) while the previous job finishes,
        so the sender never waits for the receiver between transfers. Called by the previous job, on
        the worker thread, with the slots of those messages free; `slot_base` must not change."""
        if self._next_post == 0:
            self._slot_base = slot_base
        self._post_upto(ctx, upto)

    def _post_upto(self, ctx: WorkerContext, upto: int) -> None:
        """Posts this job's receives up to (not including) message `upto`."""
        while self._next_post < min(upto, len(self._ranges)):
            self._posted.append(self._post(ctx, self._next_post))
            self._next_post += 1

    def _post(self, ctx: WorkerContext, i: int) -> tuple[StagingSlot, PendingOp, int, int]:
        _, bs, h, d = self.meta.geometry
        l0, l1 = self._ranges[i]
        index = (self._slot_base + i) % StagingBuffers.NUM_SLOTS
        slot = ctx.staging.slot(index, (l1 - l0, 2, self.meta.num_blocks, bs, h, d), self._dtype)
        t0 = time.perf_counter()
        op = ctx.group.irecv(slot.wire, ctx.peer, self._tag)  # waits for gloo's lock while it reads
        self.phases.wire += time.perf_counter() - t0
        return slot, op, l0, l1

    def execute(self, ctx: WorkerContext) -> int:
        ranges = self._ranges
        window = StagingBuffers.NUM_SLOTS
        posted = self._posted
        total = 0
        for i in range(len(ranges)):
            # Keep `window` receives posted: message j reuses the slot of message j - window, which
            # was unpacked in an earlier round. Past this job's end, the next queued job's first
            # messages take the free slots, so the stream never waits for the receiver to catch up.
            self._post_upto(ctx, i + window)
            beyond = i + window - len(ranges)
            if beyond > 0:
                nxt = ctx.peek(self.seq_no + 1)
                if isinstance(nxt, _RecvJob):
                    nxt.prepost(ctx, (self._slot_base + len(ranges)) % window, beyond)
            slot, op, l0, l1 = posted.popleft()
            t0 = time.perf_counter()
            op.wait(self.deadline)
            ctx.moved()
            t1 = time.perf_counter()
            self.phases.wire += t1 - t0
            total += slot.wire.numel() * slot.wire.element_size()
            if self._kv is None:
                continue
            self._digest.update(slot.wire)
            t2 = time.perf_counter()
            if slot.mirrored:
                slot.compute.copy_(slot.wire, non_blocking=True)
            self._unpack(slot, l0, l1)
            sync_device(ctx)  # the slot is reposted next round, and on_layer promises the blocks are written
            self.phases.digest += t2 - t1
            self.phases.copy += time.perf_counter() - t2
            if self._on_layer is not None:
                for layer in range(l0, l1):
                    self._on_layer(layer)
        if self._kv is not None:
            self.checksum = self._digest.value()
        return total

    def _unpack(self, slot: StagingSlot, l0: int, l1: int) -> None:
        assert self._kv is not None and self._ids is not None
        if isinstance(self._kv, HeadShardedKV):  # each head range into every rank's pool that holds it
            self._kv.scatter(slot.compute, l0, l1, self._ids)
        elif self._host_ids is not None:  # on this thread only (see hostcopy)
            hostcopy.scatter(slot.compute, self._kv[l0:l1], self._host_ids)
        elif l1 - l0 == 1:
            self._ops.unpack_blocks(slot.compute[0], self._kv, self._ids, layer=l0)
        else:
            self._ops.unpack_blocks(slot.compute, self._kv[l0:l1], self._ids)


class KVReceiver:
    """Decode side: receives transfers into reserved blocks of the local KV cache (rank 1)."""

    def __init__(self, ops: KernelOps) -> None:
        self._ops = ops

    def recv(
        self,
        channel: Channel,
        kv_cache: KVPool,  # [L, 2, NB', BS, Hkv, D]; NB' may differ from the sender's
        dst_block_ids: BlockIds,  # [meta.num_blocks] reserved ids, matching the sender's order
        meta: TransferMeta,
        *,
        timeout_s: float,
        on_layer: Callable[[int], None] | None = None,
    ) -> TransferHandle:
        """Queues the receive of `meta`'s transfer and returns at once. `on_layer(l)` runs on the
        channel worker once layer l is in the KV cache. If the arguments don't match the metadata the
        transfer is still drained (so later ones stay in step) and resolves as failed."""
        if channel.rank != DECODE_RANK:
            raise ValueError("KVReceiver needs a decode-side channel (rank 1)")
        if meta.channel_key != channel.key:
            return failed_handle(meta, f"metadata is for {meta.channel_key.store_prefix}, channel is {channel.key.store_prefix}")
        ids = None
        problem = self._mismatch(meta, kv_cache)
        if problem is None:
            try:
                ids = block_id_tensor(dst_block_ids, kv_cache.device, kv_cache.shape[2], unique=True)
                if ids.numel() != meta.num_blocks:
                    problem = f"{ids.numel()} destination blocks for {meta.num_blocks} sent blocks"
            except ValueError as e:
                problem = str(e)
        return self._submit(channel, meta, timeout_s, None if problem else kv_cache, ids, on_layer, problem)

    def discard(self, channel: Channel, meta: TransferMeta, *, timeout_s: float) -> TransferHandle:
        """Consumes `meta`'s transfer without storing it (the request was dropped), keeping the
        channel in step. Changes no KV cache memory."""
        if channel.rank != DECODE_RANK:
            raise ValueError("KVReceiver needs a decode-side channel (rank 1)")
        if meta.channel_key != channel.key:
            return failed_handle(meta, f"metadata is for {meta.channel_key.store_prefix}, channel is {channel.key.store_prefix}")
        return self._submit(channel, meta, timeout_s, None, None, None, None)

    def _submit(
        self, channel: Channel, meta: TransferMeta, timeout_s: float, kv_cache: KVPool | None,
        ids: torch.Tensor | None, on_layer: Callable[[int], None] | None, problem: str | None,
    ) -> TransferHandle:
        try:
            job = _RecvJob(meta, self._ops, kv_cache, ids, timeout_s, on_layer, problem)
        except ValueError as e:
            # Without a known dtype the messages cannot even be sized: the stream is lost.
            channel.close(f"undecodable metadata for seq {meta.seq_no}: {e}")
            return failed_handle(meta, str(e))
        channel.submit(job)
        return TransferHandle(job.future, meta)

    @staticmethod
    def _mismatch(meta: TransferMeta, kv_cache: KVPool) -> str | None:
        if meta.layout_version != KV_LAYOUT_VERSION:
            return f"layout version {meta.layout_version} is not {KV_LAYOUT_VERSION}"
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            return f"kv_cache must be [L, 2, NB, BS, Hkv, D], got {tuple(kv_cache.shape)}"
        if dtype_name(kv_cache.dtype) != meta.dtype:
            return f"KV cache dtype {dtype_name(kv_cache.dtype)} differs from the sender's {meta.dtype}"
        num_layers, _, _, bs, h, d = kv_cache.shape
        if (num_layers, bs, h, d) != meta.geometry:
            return f"KV cache geometry (L, BS, Hkv, D) = {(num_layers, bs, h, d)} differs from the sender's {meta.geometry}"
        return None
