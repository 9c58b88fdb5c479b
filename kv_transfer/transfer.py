"""KV block transfers over a pair channel: whole-request or layer-wise.

Wire: a transfer is a sequence of messages tagged with its `seq_no`. Message i holds layers
``[i * k, min((i + 1) * k, L))`` with ``k = meta.layers_per_message``, packed with the kernel
ops' `pack_blocks` (wire format v1), so the concatenation of all messages is exactly the v1
buffer ``[L, 2, n, BS, Hkv, D]``. Layer-wise transfers use the smallest k whose message reaches
`layerwise_min_bytes` (k = 1 once a layer is that big); whole-request transfers use the largest k
whose message fits `message_bytes`. Each side has `StagingBuffers.NUM_SLOTS` slots: the sender packs
message i+1 while message i is on the wire, the receiver keeps that many receives posted while it
unpacks, and both reach into the next queued transfer for its first messages, so back-to-back
transfers stream without a gap. A transfer of zero blocks sends no message.

Integrity: the wire carries only the packed bytes. Each side digests the messages in order as they sit
in its staging slot (`kv_transfer.checksum`: the sender after packing, before the send; the receiver on
arrival, before unpacking) and reports the digest in its `TransferResult.checksum`. The sender's digest
goes to the decode node out of band, in the control plane's TransferDone (`kv_checksum`,
`kv_checksum_algo`); the decode node lets the blocks count as landed only when it equals the receiver's.
A mismatch (or a missing digest) fails the transfer: the blocks are never served.

Ordering contract with the control plane:
  1. prefill: ``handle = sender.send(channel, kv, src_ids, ...)`` assigns ``handle.meta`` (with
     epoch and seq_no); the prefill node forwards ``handle.meta`` to the decode node.
  2. decode: for every meta it receives, it calls ``receiver.recv(channel, kv, dst_ids, meta)``
     (or ``receiver.discard(channel, meta)`` if it no longer wants the blocks) on the channel of
     ``meta.epoch``, in any order and from any thread; the channel worker runs them in seq_no order.
  3. The i-th source block lands in the i-th destination block. Blocks the decode node already
     holds (prefix-cache hits) are simply left out of both lists.
  4. Source blocks must stay untouched, and destination blocks unread, until the handle resolves.

This module holds what both sides share (message ranges, block ids, handles); the sender is in
`kv_transfer.send`, the receiver in `kv_transfer.receive`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from pdserve.kv_transfer.channel import WorkerContext
from pdserve.kv_transfer.types import TransferMeta, TransferResult

BlockIds = torch.Tensor | Sequence[int]
TAG_SPACE = 1 << 31  # c10d tags are 32-bit; seq_no wraps far beyond any in-flight window


def message_ranges(num_layers: int, layers_per_message: int, num_blocks: int) -> list[tuple[int, int]]:
    """The [l0, l1) layer range of every message of a transfer (none when there are no blocks)."""
    if num_blocks == 0:
        return []
    k = max(1, layers_per_message)
    return [(l0, min(l0 + k, num_layers)) for l0 in range(0, num_layers, k)]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def block_id_tensor(block_ids: BlockIds, device: torch.device, num_pool_blocks: int, unique: bool) -> torch.Tensor:
    """Validated int64 ids on `device`; raises ValueError. Plain lists are checked in Python: a
    few torch calls per submission would each hand the GIL to the busy channel workers."""
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1:
            raise ValueError(f"block ids must be 1-D, got shape {tuple(block_ids.shape)}")
        ids = block_ids.to(device=device, dtype=torch.int64)
        if ids.numel():
            lo, hi = (int(x) for x in torch.aminmax(ids))
            check_range(lo, hi, num_pool_blocks)
            if unique and torch.unique(ids).numel() != ids.numel():
                raise ValueError("destination block ids must be distinct")
        return ids
    values = [int(x) for x in block_ids]
    if values:
        check_range(min(values), max(values), num_pool_blocks)
        if unique and len(set(values)) != len(values):
            raise ValueError("destination block ids must be distinct")
    return torch.tensor(values, dtype=torch.int64, device=device)


def check_range(lo: int, hi: int, num_pool_blocks: int) -> None:
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


def sync_device(ctx: WorkerContext) -> None:
    if ctx.stream is not None:
        ctx.stream.synchronize()


def failed_handle(meta: TransferMeta, error: str) -> TransferHandle:
    future: Future[TransferResult] = Future()
    future.set_result(
        TransferResult(ok=False, bytes=0, seconds=0.0, error=error, request_id=meta.request_id, seq_no=meta.seq_no)
    )
    return TransferHandle(future, meta)
