"""Fault injection into node processes the harness starts (the hooks of `node_common.faults`).

A fault hook here is a frozen dataclass deriving from `FaultSpec` and from a node kind's hook class: a
test builds it, `LocalCluster.spawn_node(..., faults=...)` hands its class and fields to the node process
(`FaultSpec.env`), and the node builds the same hook from them as it starts:

    cluster.spawn_node("prefill", "p-stall", faults=SendFaults(stall_s=30.0))
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from dataclasses import dataclass

import torch

from pdserve.kernels.interface import KernelOps
from pdserve.kv_transfer import Channel, KVSender, SendHandle, TransferResult
from pdserve.kv_transfer.channel import WorkerContext
from pdserve.kv_transfer.send import _SendJob
from pdserve.kv_transfer.staging import StagingSlot
from pdserve.kv_transfer.transfer import BlockIds
from pdserve.node_common.faults import FAULTS_ENV, FAULTS_SPEC_ENV
from pdserve.prefill_node.call import PrefillCall
from pdserve.prefill_node.faults import PrefillFaults

FAILED_SEND = "fault injection: send failed"


class FaultSpec:
    """A fault hook that travels to a node process as its class's name and its (dataclass) fields."""

    def env(self) -> dict[str, str]:
        """The environment that makes a node process build this hook (`node_common.faults`)."""
        cls = type(self)
        spec = dataclasses.asdict(self)  # type: ignore[call-overload]
        return {FAULTS_ENV: f"{cls.__module__}:{cls.__qualname__}", FAULTS_SPEC_ENV: json.dumps(spec)}

    def node_args(self) -> list[str]:
        """Node flags the faults need to take effect."""
        return []


@dataclass(frozen=True)
class SendFaults(FaultSpec, PrefillFaults):
    """Faults in a prefill node's KV sends, each off by default."""

    # Wait this long after the first token went out before queuing the send: a window in which the
    # call has its first token and no send. The node queues its sends after the first token
    # (--no-layerwise-send), since a layer-wise send is queued before it.
    delay_s: float = 0.0
    # Announce each send and ship half its layers (a layer-wise send's as the forward computes them, one
    # queued after the first token's at once); the rest go this long after all were ready.
    stall_s: float = 0.0
    # Report every send as failed (TransferDone ok=false) once it resolved. A failed send breaks its
    # channel (`kv_transfer.channel`), so the reported failure closes it too.
    failed: bool = False
    # Flip one byte of every send's first staged message after its checksum was taken.
    corrupt: bool = False

    def __post_init__(self) -> None:
        if self.delay_s < 0 or self.stall_s < 0:
            raise ValueError(f"fault delays must be >= 0: {self}")

    def node_args(self) -> list[str]:
        return ["--no-layerwise-send"] if self.delay_s else []

    def new_sender(self, ops: KernelOps) -> KVSender:
        return FaultySender(ops, self) if self.stall_s or self.failed or self.corrupt else KVSender(ops)

    async def after_first_token(self, call: PrefillCall) -> None:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)  # the fault itself, not a synchronisation


class FaultySender(KVSender):
    """A KV sender whose sends suffer `faults` (its stall, failed and corrupt parts)."""

    def __init__(self, ops: KernelOps, faults: SendFaults, **kwargs: int | None) -> None:
        super().__init__(ops, **kwargs)  # type: ignore[arg-type]
        self.faults = faults
        if faults.corrupt:
            self._job_type = _CorruptingJob

    def send(
        self, channel: Channel, kv_cache: torch.Tensor, block_ids: BlockIds, *, request_id: str, num_tokens: int,
        timeout_s: float, layerwise: bool = False,
    ) -> SendHandle:
        stall = self.faults.stall_s > 0
        handle = super().send(channel, kv_cache, block_ids, request_id=request_id, num_tokens=num_tokens,
                              timeout_s=timeout_s, layerwise=layerwise or stall)
        if not (stall or self.faults.failed):
            return handle
        faulty = _FaultyHandle(handle, channel, self.faults)
        if stall and not layerwise:
            faulty.all_layers_ready()  # a whole send's layers are ready at once: half go now
        return faulty


class _FaultyHandle(SendHandle):
    """A send under a stall (only its first half of layers goes when ready, the rest `stall_s` after
    all were) or reported as failed."""

    def __init__(self, handle: SendHandle, channel: Channel, faults: SendFaults) -> None:
        super().__init__(handle.future, handle.meta, handle._gate)
        self._channel = channel
        self._faults = faults
        self._half = handle.meta.geometry[0] // 2

    def layer_ready(self, layer: int) -> None:
        if not self._faults.stall_s or layer < self._half:
            super().layer_ready(layer)

    def all_layers_ready(self) -> None:
        if not self._faults.stall_s:
            super().all_layers_ready()
            return
        for layer in range(self._half):
            super().layer_ready(layer)
        rest = threading.Timer(self._faults.stall_s, super().all_layers_ready)
        rest.name, rest.daemon = f"fault-stall-{self.meta.request_id}", True
        rest.start()

    def result(self, timeout: float | None = None) -> TransferResult:
        return self._reported(super().result(timeout))

    async def wait(self) -> TransferResult:
        return self._reported(await super().wait())

    def _reported(self, result: TransferResult) -> TransferResult:
        if not self._faults.failed:
            return result
        self._channel.close("fault injection: send reported as failed")
        return dataclasses.replace(result, ok=False, error=FAILED_SEND, checksum=None)


class _CorruptingJob(_SendJob):
    """Flips one byte of the first message after it was digested: the receiver's checksum differs."""

    def _fill(self, ctx: WorkerContext, slot: StagingSlot, i: int, events: list[torch.cuda.Event]) -> None:
        super()._fill(ctx, slot, i, events)
        if i == 0:
            flip_one_byte(slot.wire)


def flip_one_byte(t: torch.Tensor) -> None:
    """Inverts the middle byte of a staged message in place (a corruption in flight the checksum must
    catch)."""
    flat = t.reshape(-1).view(torch.uint8)
    mid = flat.numel() // 2
    flat[mid] = 255 - int(flat[mid])
