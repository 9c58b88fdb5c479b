"""One Prefill call on a prefill node (`PrefillCall`) and its stages; `prefill_node.service` serves it,
`prefill_node.sends` queues its KV send."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from pdserve.kv_transfer import Channel, SendHandle, TransferResult
from pdserve.prefill_node.metrics import PrefillTiming


class Stage(enum.Enum):
    """Where a Prefill call is (`request_stages` reports the values)."""

    IN_ENGINE = "in_engine"  # the engine's scheduler owns it, until its first token (then its blocks are held)
    SENDING = "sending"  # the send of its blocks is queued; they are held until it resolves
    ENDING = "ending"  # the call is over: blocks are given back once no send reads them


_NEXT = {Stage.IN_ENGINE: {Stage.SENDING, Stage.ENDING}, Stage.SENDING: {Stage.ENDING}, Stage.ENDING: set()}


@dataclass(frozen=True)
class LayerwiseSend:
    """What the engine thread needs to queue a call's layer-wise send: the source blocks are
    block_table[skip : skip + count] of the call's sequence."""

    skip: int
    count: int
    num_tokens: int


@dataclass(eq=False)
class PrefillCall:
    """One Prefill call on this node, from arrival until the engine let go of its blocks."""

    key: str  # this attempt on this node (`call_key`): what the tables, the engine and the send know it by
    request_id: str
    attempt: int
    decode_id: str
    arrived: float
    stage: Stage = Stage.IN_ENGINE
    aborted: str | None = None  # why, once aborted (caller's Abort, decode node gone, shutdown)
    handle: SendHandle | None = None  # set once the send is queued; blocks are held until it resolves
    channel: Channel | None = None
    # The blocks were given back while the send was still in flight (the decode node's lease lapsed):
    # whatever the send still ships is reported as failed, so the decode node never uses it.
    released_under_send: bool = False
    # Set when the send is to be queued layer-wise by the engine thread in the step of the last prompt chunk.
    layerwise: LayerwiseSend | None = None
    # Set (on the event loop) once the engine thread queued that layer-wise send.
    layerwise_queued: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    # What its spans are made of (tracing on): the call's span, the times FirstToken reported, when
    # the send was queued (time.monotonic) and how it went.
    span: Any = None
    timing: PrefillTiming | None = None
    send_queued_at: float | None = None
    send_result: TransferResult | None = None

    def advance(self, stage: Stage) -> None:
        """Moves to `stage`; asserts the move is allowed."""
        assert stage in _NEXT[self.stage], f"request {self.key}: {self.stage.name} -> {stage.name}"
        self.stage = stage

    def close_channel_under_send(self, reason: str) -> bool:
        """Closes the pair channel under a send still in flight, so that it fails at once instead of at its
        deadline; returns whether there was one."""
        if self.handle is None or self.handle.done():
            return False
        if self.channel is not None:
            self.channel.close(reason)
        return True
