"""One object per request on a decode node (`DecodeRequest`), with its stage as an explicit, checked
state. The servicer's request table holds it from arrival until the engine let go of the request. Each
stage says what the request waits for.

    local:   IN_ENGINE ────────────────────────────────────────────────────────────────> ENDING ──> (dropped)
    remote:  WAITING_FOR_BLOCKS ──> WAITING_FOR_REMOTE_KV ──(KV landed)──> IN_ENGINE ──> ENDING ──> (dropped)
                 │                    ├──(failed before the first token: prefilled here, local)──> IN_ENGINE
                 │                    ├──(KV did not land after the first token: prompt + tokens so far
                 │                    │    re-prefilled here, local)──────────────────────────> IN_ENGINE
                 └────────────────────┴──(refused, cancelled, first token ended it)────> ENDING

KV blocks by stage (decode side): WAITING_FOR_BLOCKS holds none (it waits in the reservation queue);
WAITING_FOR_REMOTE_KV holds its reservation (the engine's RESERVED sequence, written by the transfer, with
the first token appended once it came); IN_ENGINE is the engine scheduler's; ENDING holds what the engine
has until the abort that ends it is done. WAITING_FOR_REMOTE_KV leaves for IN_ENGINE (prefilled here) only
once no receive can still write the reservation (the receive resolved, or none was posted), since the
engine frees it then.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.engine.async_engine import RequestStream
from pdserve.engine.block_manager import Reservation
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Resume
from pdserve.kv_transfer import Channel, TransferHandle
from pdserve.registry import Member
from pdserve.rpc import pdserve_pb2 as pb


class Stage(enum.Enum):
    WAITING_FOR_BLOCKS = "waiting_for_blocks"  # remote: in the reservation queue; holds no blocks
    # remote: blocks reserved; a prefill node computes the prompt's K/V and ships them into the reservation
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    IN_ENGINE = "in_engine"  # the engine's scheduler owns it: landed, or prefilled here
    ENDING = "ending"  # refused, failed, cancelled or finished: waiting for the engine to let go


_NEXT: dict[Stage, frozenset[Stage]] = {
    Stage.WAITING_FOR_BLOCKS: frozenset({Stage.WAITING_FOR_REMOTE_KV, Stage.ENDING}),
    Stage.WAITING_FOR_REMOTE_KV: frozenset({Stage.IN_ENGINE, Stage.ENDING}),
    Stage.IN_ENGINE: frozenset({Stage.ENDING}),
    Stage.ENDING: frozenset(),
}
# A remote request's stages before the engine owns it: it waits on its prefill node (queued work there).
REMOTE_WAITS = frozenset({Stage.WAITING_FOR_BLOCKS, Stage.WAITING_FOR_REMOTE_KV})


class FailureReason(enum.Enum):
    """Why a remote prefill or its KV transfer failed. The values are the `reason` labels of the fallback
    and re-prefill metrics (`decode_node.metrics`)."""

    UNAVAILABLE = "unavailable"  # the prefill node is gone, not listening, or draining
    REFUSED = "refused"  # it declined the request
    ERROR = "error"  # the call failed otherwise, or ended without a first token or the K/V
    TIMEOUT = "timeout"  # no first token within --prefill-timeout, or the receive ran past its deadline
    LEASE_LOST = "lease_lost"  # the prefill node left the registry
    SEND_FAILED = "send_failed"  # TransferDone said the send failed
    RECEIVE_FAILED = "receive_failed"  # the channel would not open, or the receive failed or its channel closed
    CHECKSUM = "checksum"  # the received bytes are not the ones the prefill node sent


@dataclass(frozen=True)
class Failure:
    """The first cause of a remote prefill's failure."""

    reason: FailureReason
    error: str  # what failed, for the log and the trace


@dataclass(frozen=True)
class SendReport:
    """What the prefill node reported of its send (TransferDone ok): its part is done, so its leaving the
    registry no longer concerns the request (a drained prefill node revokes its lease right after its
    last send)."""

    skipped: bool  # nothing was shipped (the first token ended the request)
    checksum: tuple[str, int] | None  # (algorithm, digest) of the bytes it sent; None: none reported


@dataclass(eq=False)
class RemotePrefill:
    """Where a remote request's prefill and transfer stand (owned by its `decode_node.remote` driver)."""

    prefill_node: Member
    call: grpc.aio.UnaryStreamCall | None = None  # the Prefill call
    channel: Channel | None = None
    recv: TransferHandle | None = None
    first_token: int | None = None  # the token id FirstToken carried, once it came
    cached_tokens: int = 0  # the prefill node's prefix-cache hit (FirstToken)
    sent: SendReport | None = None  # TransferDone ok
    # The receive completed into the reservation and TransferDone vouched for its bytes, or nothing had to
    # be shipped: set by the driver once no receive can write the reservation.
    kv_in_place: bool = False
    failure: Failure | None = None  # set by `fail` only
    span: Any = None  # tracing on: the KV wait span (the Prefill call's parent) until it ends

    def fail(self, reason: FailureReason, error: str) -> Failure:
        """Records why the prefill or transfer failed, unless a cause is recorded already (the first cause
        wins); returns the recorded one."""
        if self.failure is None:
            self.failure = Failure(reason, error)
        return self.failure


def context_ids(prompt: list[int], resume: Resume | None) -> list[int]:
    """What a request is prefilled from, here or remotely: its prompt, followed by a resumed request's
    resumed tokens."""
    return prompt + list(resume.token_ids) if resume is not None else prompt


@dataclass(eq=False)
class DecodeRequest:
    """A request on this decode node, from arrival until the engine let go of it."""

    key: str  # this attempt on this node (`call_key`): what the tables, the engine and the transfer know it by
    request_id: str
    attempt: int
    prompt: list[int]
    params: SamplingParams
    arrived: float
    stream: RequestStream
    stage: Stage
    remote: RemotePrefill | None = None  # None: prefilled here (from the start, or after a failed remote prefill)
    reservation: Reservation | None = None  # set when WAITING_FOR_BLOCKS ends
    cancelled: bool = False  # the caller went away or aborted
    # What the caller is told when the request ends with an error (its landing, or the local prefill after
    # a remote one, failed); why a remote prefill failed is its `remote.failure`.
    error: str | None = None
    timing: pb.Timing = field(default_factory=pb.Timing)
    # A resumed request (GenerateRequest.resume_token_ids): the completion tokens another node delivered.
    resume: Resume | None = None
    landed_at: float | None = None  # time.monotonic() when its transferred KV was handed to the engine
    local_prefill_s: float = 0.0  # prefilled here: arrival to its first message (its reported prefill time)
    span: Any = None  # tracing on: the request's span on this node (`decode_node.trace`)

    def __post_init__(self) -> None:
        assert (self.stage == Stage.IN_ENGINE) == (self.remote is None), "local requests start in the engine"

    @property
    def context_ids(self) -> list[int]:
        """What it is prefilled from (the module's `context_ids`)."""
        return context_ids(self.prompt, self.resume)

    @property
    def prefill_id(self) -> str:
        """Who prefills it ("" for this node)."""
        return self.remote.prefill_node.node_id if self.remote is not None else ""

    def advance(self, stage: Stage) -> None:
        """Moves to `stage`; asserts the move is one the diagram allows."""
        assert stage in _NEXT[self.stage], f"request {self.request_id}: {self.stage.name} -> {stage.name}"
        self.stage = stage

    def check(self) -> None:
        """Asserts the fields agree with the stage."""
        if self.stage == Stage.WAITING_FOR_BLOCKS:
            assert self.reservation is None and self.remote is not None and self.remote.call is None
        if self.stage == Stage.WAITING_FOR_REMOTE_KV:
            assert self.reservation is not None and self.remote is not None
