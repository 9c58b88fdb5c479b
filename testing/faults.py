"""Fault injection into node processes the harness starts (the hooks of `node_common.faults`).

A fault hook here is a frozen dataclass deriving from `FaultSpec` and from a node kind's hook class: a
test builds it, `LocalCluster.spawn_node(..., faults=...)` (or `UpCluster.start(..., env=faults.env())`,
for every node `pdserve up` starts) hands its class and fields to the node process (`FaultSpec.env`), and
the node builds the same hook from them as it starts:

    cluster.spawn_node("prefill", "p-stall", faults=Faults(send_stall_s=30.0))
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

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
class Faults(FaultSpec, PrefillFaults):
    """Faults in a node's engine steps and in a prefill node's KV sends, each off by default. A prefill
    node's hook, so that one hook serves either node kind (a decode node runs its step faults only)."""

    # Engine steps, while a trigger file exists (a test creates it at a moment of its choosing): with
    # `STEP_TRIGGER.fail`, every engine step raises; with `STEP_TRIGGER.hang`, a step blocks until
    # that file is removed. "" arms neither.
    step_trigger: str = ""
    # Wait this long after the first token went out before queuing the send: a window in which the
    # call has its first token and no send. The node queues its sends after the first token
    # (--no-layerwise-send), since a layer-wise send is queued before it.
    send_delay_s: float = 0.0
    # Announce each send and ship half its layers (a layer-wise send's as the forward computes them, one
    # queued after the first token's at once); the rest go this long after all were ready.
    send_stall_s: float = 0.0
    # Report every send as failed (TransferDone ok=false) once it resolved. A failed send breaks its
    # channel (`kv_transfer.channel`), so the reported failure closes it too.
    send_failed: bool = False
    # Flip one byte of every send's first staged message after its checksum was taken.
    send_corrupt: bool = False

    def __post_init__(self) -> None:
        if self.send_delay_s < 0 or self.send_stall_s < 0:
            raise ValueError(f"fault delays must be >= 0: {self}")

    @property
    def step_fail_file(self) -> Path:
        return Path(self.step_trigger + ".fail")

    @property
    def step_hang_file(self) -> Path:
        return Path(self.step_trigger + ".hang")

    def node_args(self) -> list[str]:
        return ["--no-layerwise-send"] if self.send_delay_s else []

    def before_step(self) -> None:
        if not self.step_trigger:
            return
        if self.step_fail_file.exists():
            raise RuntimeError(f"injected step failure ({self.step_fail_file})")
        while self.step_hang_file.exists():
            time.sleep(0.05)  # the fault itself: the step hangs until the test removes the file

    def new_sender(self, ops: KernelOps) -> KVSender:
        sends = self.send_stall_s or self.send_failed or self.send_corrupt
        return FaultySender(ops, self) if sends else KVSender(ops)

    async def after_first_token(self, call: PrefillCall) -> None:
        if self.send_delay_s:
            await asyncio.sleep(self.send_delay_s)  # the fault itself, not a synchronisation


class FaultySender(KVSender):
    """A KV sender whose sends suffer `faults` (its send_stall_s, send_failed and send_corrupt parts)."""

    def __init__(self, ops: KernelOps, faults: Faults, **kwargs: int | None) -> None:
        super().__init__(ops, **kwargs)  # type: ignore[arg-type]
        self.faults = faults
        if faults.send_corrupt:
            self._job_type = _CorruptingJob

    def send(
        self, channel: Channel, kv_cache: torch.Tensor, block_ids: BlockIds, *, request_id: str, num_tokens: int,
        timeout_s: float, layerwise: bool = False,
    ) -> SendHandle:
        stall = self.faults.send_stall_s > 0
        handle = super().send(channel, kv_cache, block_ids, request_id=request_id, num_tokens=num_tokens,
                              timeout_s=timeout_s, layerwise=layerwise or stall)
        if not (stall or self.faults.send_failed):
            return handle
        faulty = _FaultyHandle(handle, channel, self.faults)
        if stall and not layerwise:
            faulty.all_layers_ready()  # a whole send's layers are ready at once: half go now
        return faulty


class _FaultyHandle(SendHandle):
    """A send under a stall (only its first half of layers goes when ready, the rest `send_stall_s`
    after all were) or reported as failed."""

    def __init__(self, handle: SendHandle, channel: Channel, faults: Faults) -> None:
        super().__init__(handle.future, handle.meta, handle._gate)
        self._channel = channel
        self._faults = faults
        self._half = handle.meta.geometry[0] // 2

    def layer_ready(self, layer: int) -> None:
        if not self._faults.send_stall_s or layer < self._half:
            super().layer_ready(layer)

    def all_layers_ready(self) -> None:
        if not self._faults.send_stall_s:
            super().all_layers_ready()
            return
        for layer in range(self._half):
            super().layer_ready(layer)
        rest = threading.Timer(self._faults.send_stall_s, super().all_layers_ready)
        rest.name, rest.daemon = f"fault-stall-{self.meta.request_id}", True
        rest.start()

    def result(self, timeout: float | None = None) -> TransferResult:
        return self._reported(super().result(timeout))

    async def wait(self) -> TransferResult:
        return self._reported(await super().wait())

    def _reported(self, result: TransferResult) -> TransferResult:
        if not self._faults.send_failed:
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
