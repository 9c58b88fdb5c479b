"""Reusable, double-buffered staging memory for one side of one channel.

The KV cache itself is never handed to the transport: a message is packed into a staging slot
and sent from there, and received into a staging slot and unpacked from there. So a message
left in flight by an aborted channel can only ever touch staging memory, never KV cache blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_GROW_ALIGN = 1 << 20  # grow in whole MiB so slowly growing requests don't reallocate every time


@dataclass(frozen=True)
class StagingSlot:
    """`compute` is what pack/unpack work on (KV cache device); `wire` is what the transport sees.
    They are the same tensor except for CUDA pools over gloo, where `wire` is a pinned host mirror."""

    compute: torch.Tensor
    wire: torch.Tensor

    @property
    def mirrored(self) -> bool:
        return self.wire.data_ptr() != self.compute.data_ptr()


class StagingBuffers:
    """`NUM_SLOTS` byte buffers (slots) per side, grown on demand and kept until the channel closes."""

    # Messages in flight per side: one on the wire while the other is packed or unpacked. Four
    # (`bench/kv_transfer_bench.py --window 4`) measured no faster on a 2-core machine, where the
    # two sides' copies, digests and socket copies already keep both cores busy; it would double
    # the staging memory.
    NUM_SLOTS = 2

    def __init__(self, device: torch.device, host_mirror: bool) -> None:
        self._device = device
        # Only a CUDA KV cache sent over a host transport needs a pinned mirror.
        self._host_mirror = host_mirror and device.type == "cuda"
        self._compute: list[torch.Tensor | None] = [None] * self.NUM_SLOTS  # flat uint8
        self._wire: list[torch.Tensor | None] = [None] * self.NUM_SLOTS
        # The last view handed out per slot: back-to-back transfers of one shape (the common case)
        # then cost a tuple compare instead of four tensor ops per message.
        self._views: list[tuple[tuple[int, ...], torch.dtype, StagingSlot] | None] = [None] * self.NUM_SLOTS

    @property
    def nbytes(self) -> int:
        total = 0
        for bufs in (self._compute, self._wire):
            total += sum(b.numel() for b in bufs if b is not None)
        return total

    def slot(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> StagingSlot:
        """A view of slot `index` shaped `shape`. Reallocates the slot (dropping its old contents)
        only when it is too small; the caller must have finished every op on that slot."""
        cached = self._views[index]
        if cached is not None and cached[0] == shape and cached[1] == dtype:
            return cached[2]
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        compute = self._ensure(self._compute, index, nbytes, self._device, pin=False)
        wire = self._ensure(self._wire, index, nbytes, torch.device("cpu"), pin=True) if self._host_mirror else compute
        slot = StagingSlot(
            compute=compute[:nbytes].view(dtype).view(shape),
            wire=wire[:nbytes].view(dtype).view(shape),
        )
        self._views[index] = (shape, dtype, slot)
        return slot

    @staticmethod
    def _ensure(
        bufs: list[torch.Tensor | None], index: int, nbytes: int, device: torch.device, pin: bool
    ) -> torch.Tensor:
        buf = bufs[index]
        if buf is None or buf.numel() < nbytes:
            size = max(_GROW_ALIGN, -(-nbytes // _GROW_ALIGN) * _GROW_ALIGN)
            buf = torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pin)
            bufs[index] = buf
        return buf

    def release(self) -> None:
        """Drops all staging memory."""
        self._compute = [None] * self.NUM_SLOTS
        self._wire = [None] * self.NUM_SLOTS
        self._views = [None] * self.NUM_SLOTS
