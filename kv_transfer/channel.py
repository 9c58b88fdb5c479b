"""One pair channel on one side: a lazily connected process group plus a single FIFO worker thread.

NCCL matches sends and receives by posting order, so both ends must execute a channel's transfers
in the same order. The sender numbers them (`seq_no`, from 0 in every epoch) as they are submitted;
the number travels in the metadata; the receiver's worker runs them strictly in `seq_no` order and
waits for a missing one until some queued transfer's deadline passes. A deadline bounds how long the
channel stands still, not a transfer's whole life: every move (a transfer starting or ending, a message
completing, a layer of a layer-wise send becoming ready) restarts the deadline of every transfer on the
channel, so transfers queued behind a layer-wise send that lasts as long as a slow prefill step wait for
it, and a transfer whose metadata never comes fails `timeout_s` after the channel's last move. Any failure (timeout, peer
gone, connect failure) breaks the channel: every queued transfer fails, the group is aborted (which
interrupts NCCL; a gloo op runs on to its own deadline) and then released by the worker, which
closes the connection so the peer's pending ops fail at once; the channel is never used again and
the owner opens a new epoch.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pdserve.kv_transfer.backend import PairGroup, TransferTimeout
from pdserve.kv_transfer.staging import StagingBuffers
from pdserve.kv_transfer.types import ChannelError, ChannelKey, ChannelState, PhaseSeconds, TransferResult


@dataclass
class WorkerContext:
    """What a job may use while it runs on the channel's worker thread."""

    group: PairGroup
    staging: StagingBuffers
    peer: int
    device: torch.device
    stream: torch.cuda.Stream | None  # the worker's own stream on CUDA pools
    peek: Callable[[int], ChannelJob | None]  # the queued job with that seq_no, left in the queue
    moved: Callable[[], None]  # the running job made progress: every deadline on the channel restarts


class JobOutcome(NamedTuple):
    """A finished job's result, and whether the byte stream is still in step with the peer
    (False breaks the channel; a rejected-but-drained receive keeps it)."""

    result: TransferResult
    channel_ok: bool


class ChannelJob(ABC):
    """One transfer (or drain) executed by a channel worker. Its future resolves exactly once."""

    def __init__(self, request_id: str, timeout_s: float) -> None:
        self.request_id = request_id
        self.seq_no = -1
        self.timeout_s = timeout_s
        self.submitted = time.monotonic()
        self.deadline = self.submitted + timeout_s  # moved on by `Channel._moved` while the channel moves
        self.future: Future[TransferResult] = Future()
        self.future.set_running_or_notify_cancel()  # a queued transfer cannot be cancelled halfway
        self._finished = threading.Lock()
        self._done = False
        # Set by jobs that consume their messages but must still report failure (a rejected receive).
        self.rejection: str | None = None
        self.checksum: int | None = None  # set by `execute` once every message was digested
        self.phases = PhaseSeconds()  # accumulated by `execute` (and by a previous job's look-ahead)

    @abstractmethod
    def execute(self, ctx: WorkerContext) -> int:
        """Moves the data; returns the payload bytes. Raises on any failure. Changes only what the
        concrete job documents (the destination blocks for a receive, nothing for a send)."""

    def run(self, ctx: WorkerContext) -> JobOutcome:
        """Executes the job without resolving its future: the worker first takes the channel down
        if needed, so whoever sees a failed result already finds the channel broken."""
        start = time.monotonic()
        if start >= self.deadline:
            return JobOutcome(self.failure("timed out while queued", start), False)
        try:
            nbytes = self.execute(ctx)
        except TransferTimeout as e:
            return JobOutcome(self.failure(f"timeout: {e}", start), False)
        except Exception as e:  # any error leaves the stream in an unknown state: the channel breaks
            return JobOutcome(self.failure(f"{type(e).__name__}: {e}", start), False)
        if self.rejection is not None:
            return JobOutcome(self.failure(self.rejection, start), True)
        result = TransferResult(
            ok=True, bytes=nbytes, seconds=time.monotonic() - start, request_id=self.request_id,
            seq_no=self.seq_no, queued_seconds=start - self.submitted, checksum=self.checksum,
            phases=self.phases,
        )
        return JobOutcome(result, True)

    def failure(self, error: str, started: float | None = None) -> TransferResult:
        now = time.monotonic()
        begin = started if started is not None else now
        return TransferResult(
            ok=False, bytes=0, seconds=now - begin, error=error, request_id=self.request_id,
            seq_no=self.seq_no, queued_seconds=begin - self.submitted,
        )

    def fail(self, error: str) -> TransferResult:
        """Resolves the job as failed without running it."""
        return self.finish(self.failure(error))

    def finish(self, result: TransferResult) -> TransferResult:
        with self._finished:
            if not self._done:
                self._done = True
                self.future.set_result(result)
        return result

    def on_abandon(self) -> None:  # noqa: B027 - an optional hook; most jobs wait on nothing
        """Called when the job fails without running; wakes anything the job waits on."""


class Channel:
    """One side of one pair channel. Thread-safe; never blocks the caller on the network."""

    def __init__(
        self,
        key: ChannelKey,
        rank: int,
        connect: Callable[[], PairGroup],
        device: torch.device,
        host_mirror: bool,
        on_down: Callable[[Channel], None],
    ) -> None:
        self.key = key
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        self._connect = connect
        self._on_down = on_down
        self._staging = StagingBuffers(device, host_mirror=host_mirror)
        self._cv = threading.Condition()
        self._state = ChannelState.CONNECTING
        self._reason = ""
        self._group: PairGroup | None = None
        self._jobs: dict[int, ChannelJob] = {}  # queued, by seq_no
        self._current: ChannelJob | None = None
        self._next_assign = 0  # sender side: next seq_no to hand out
        self._next_run = 0  # next seq_no the worker executes
        self.last_used = time.monotonic()
        self._thread = threading.Thread(target=self._work, name=f"kv-channel-{key.store_prefix}", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- introspection
    @property
    def state(self) -> ChannelState:
        return self._state

    @property
    def usable(self) -> bool:
        return self._state in (ChannelState.CONNECTING, ChannelState.READY)

    @property
    def down_reason(self) -> str:
        return self._reason

    @property
    def busy(self) -> bool:
        with self._cv:
            return bool(self._jobs) or self._current is not None

    def idle_seconds(self, now: float) -> float:
        with self._cv:
            if self._jobs or self._current is not None:
                return 0.0
            return now - self.last_used

    def wait_connected(self, timeout_s: float) -> PairGroup:
        """The connected group, for diagnostics and benchmarks; using it while transfers are queued
        would interleave with them. Raises ChannelError if the channel is down or not up in time."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._state == ChannelState.CONNECTING:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChannelError(f"channel {self.key.store_prefix} not connected after {timeout_s}s")
                self._cv.wait(left)
            if self._state != ChannelState.READY or self._group is None:
                raise ChannelError(f"channel {self.key.store_prefix} is {self._state.value}: {self._reason}")
            return self._group

    # ----------------------------------------------------------------- submission
    def submit_next(self, make_job: Callable[[int], ChannelJob]) -> ChannelJob:
        """Sender side: builds the job with the next sequence number and queues it, atomically, so
        numbers are handed out in queue order. `make_job` must not raise."""
        with self._cv:
            job = make_job(self._next_assign)
            job.seq_no = self._next_assign
            refusal = self._refusal(job)
            if refusal is None:
                self._next_assign += 1
                self._enqueue(job)
        if refusal is not None:
            job.fail(refusal)  # outside the lock: done-callbacks may call back into the channel
        return job

    def submit(self, job: ChannelJob) -> ChannelJob:
        """Receiver side: queues a job whose `seq_no` came with the metadata."""
        with self._cv:
            refusal = self._refusal(job)
            if refusal is None:
                self._enqueue(job)
        if refusal is not None:
            job.fail(refusal)
        return job

    def _refusal(self, job: ChannelJob) -> str | None:
        if not self.usable:
            return f"channel {self.key.store_prefix} is {self._state.value}: {self._reason}"
        if job.seq_no < self._next_run or job.seq_no in self._jobs or (
            self._current is not None and self._current.seq_no == job.seq_no
        ):
            return f"sequence number {job.seq_no} was already submitted on {self.key.store_prefix}"
        return None

    def _enqueue(self, job: ChannelJob) -> None:
        self._jobs[job.seq_no] = job
        self.last_used = time.monotonic()
        self._cv.notify_all()

    # ----------------------------------------------------------------- shutdown paths
    def close(self, reason: str) -> None:
        """Closes on purpose: queued transfers fail, the group is torn down. Idempotent."""
        self._go_down(ChannelState.CLOSED, reason)

    def join(self, timeout_s: float) -> bool:
        """Waits until the worker has exited and released the group; returns whether it did. A
        running gloo op ends only at its deadline, so this can take until then."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def expire_overdue(self, now: float) -> bool:
        """Breaks the channel if a queued (not running) transfer is past its deadline; the running one
        watches its own deadline. Returns whether it broke the channel."""
        with self._cv:
            overdue = [j for j in self._jobs.values() if j.deadline <= now]
        if not overdue:
            return False
        first = min(overdue, key=lambda j: j.seq_no)
        with self._cv:
            behind = ""
            if self._state == ChannelState.READY and self._current is not None:
                behind = f" behind seq {self._current.seq_no}, which did not move"
            elif self._state == ChannelState.READY and self._next_run not in self._jobs:
                behind = f" (seq {self._next_run} never came)"
        self._go_down(ChannelState.BROKEN, f"transfer seq {first.seq_no} timed out while queued{behind}")
        return True

    def _moved(self) -> None:
        """The channel made progress: the deadline of every queued and running transfer restarts."""
        now = time.monotonic()
        with self._cv:
            jobs = list(self._jobs.values())
            if self._current is not None:
                jobs.append(self._current)
            for job in jobs:
                job.deadline = max(job.deadline, now + job.timeout_s)

    def _go_down(self, state: ChannelState, reason: str) -> None:
        with self._cv:
            if not self.usable:
                return
            self._state = state
            self._reason = reason
            jobs = sorted(self._jobs.values(), key=lambda j: j.seq_no)
            self._jobs.clear()
            group = self._group
            current = self._current
            self._cv.notify_all()
        for job in jobs:
            job.on_abandon()
            job.fail(f"channel {self.key.store_prefix} {state.value}: {reason}")
        if current is not None:
            current.on_abandon()  # a send waiting for layers must stop waiting
        if group is not None:
            group.abort()  # interrupts the running transfer where the backend can
        self._on_down(self)

    # ----------------------------------------------------------------- worker
    def _work(self) -> None:
        try:
            group = self._connect()
        except Exception as e:  # a connect failure of any kind breaks the channel
            self._go_down(ChannelState.BROKEN, f"connect failed: {e}")
            return
        with self._cv:
            if self._state == ChannelState.CONNECTING:
                self._group = group
                self._state = ChannelState.READY
                self._cv.notify_all()
                group = None
        if group is not None:  # closed while the rendezvous was running
            group.close()
            return
        stream = None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(self.device)
        ctx = WorkerContext(group=self._group, staging=self._staging, peer=self.peer, device=self.device,
                            stream=stream, peek=self._peek, moved=self._moved)
        try:
            while True:
                job = self._next_job()
                if job is None:
                    return
                if stream is not None:
                    with torch.cuda.stream(stream):
                        outcome = job.run(ctx)
                else:
                    outcome = job.run(ctx)
                if not outcome.channel_ok:
                    self._go_down(ChannelState.BROKEN, f"transfer seq {job.seq_no} failed: {outcome.result.error}")
                with self._cv:
                    self._current = None
                    self.last_used = time.monotonic()
                self._moved()
                job.finish(outcome.result)
                if not outcome.channel_ok:
                    return
        finally:
            # Only the worker drops the group, after its last op: gloo keeps the connection open
            # while an op is pending, and closing it is what tells the peer at once.
            with self._cv:
                group, self._group = self._group, None
            if group is not None:
                group.close()
            self._staging.release()

    def _peek(self, seq_no: int) -> ChannelJob | None:
        with self._cv:
            return self._jobs.get(seq_no) if self._state == ChannelState.READY else None

    def _next_job(self) -> ChannelJob | None:
        while True:
            expired = False
            with self._cv:
                if self._state != ChannelState.READY:
                    return None
                job = self._jobs.pop(self._next_run, None)
                if job is not None:
                    self._next_run += 1
                    self._current = job
                    return job
                now = time.monotonic()
                earliest = min((j.deadline for j in self._jobs.values()), default=None)
                if earliest is not None and earliest <= now:
                    expired = True
                else:
                    self._cv.wait(None if earliest is None else earliest - now)
            if expired:
                self.expire_overdue(time.monotonic())
