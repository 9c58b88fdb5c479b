"""Drives a synchronous `LLMEngine` from asyncio: one engine thread, commands in, per-request outputs out.

The engine is single-threaded by design, so every call into it runs on the thread that steps it.
asyncio code submits commands (any callable taking the engine) through a thread-safe queue and awaits
their results; the thread runs pending commands between steps, then steps while there is work, and
sleeps on a condition variable when there is none (it never spins). Step outputs are handed to the
event loop in one `call_soon_threadsafe` per step and land in per-request asyncio queues, so a
consumer that falls behind finds several deltas waiting and can send them as one message.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pdserve.engine.block_manager import Reservation
from pdserve.engine.llm_engine import EngineLoad, LLMEngine, RequestOutput
from pdserve.engine.parallel import RankLost
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Resume, Sequence, TokenLogprob
from pdserve.engine.stopping import FinishReason

log = logging.getLogger(__name__)

T = TypeVar("T")

# While requests are unfinished but a step scheduled nothing (e.g. every block is reserved for
# transfers), the thread waits this long for a command before trying again.
_IDLE_RETRY_S = 0.005
_RATE_WINDOW_S = 5.0


@dataclass(eq=False)
class _Command(Generic[T]):
    fn: Callable[[LLMEngine], T]
    future: Future[T] = field(default_factory=Future)


@dataclass(eq=False)
class RequestStream:
    """The outputs of one request, in order. Read with `next_batch`; the last output is finished."""

    request_id: str
    queue: asyncio.Queue[RequestOutput] = field(default_factory=asyncio.Queue)
    finished: bool = False
    # The engine's sequence, owned by the engine thread. Other threads may read it only once it is
    # finished and holding its blocks (a hold_blocks request), when nothing changes it any more.
    seq: Sequence | None = None

    async def next_batch(self) -> list[RequestOutput]:
        """Waits for at least one output, then takes every output already waiting (up to the finished
        one), so fast tokens go out together."""
        batch = [await self.queue.get()]
        while not batch[-1].finished and not self.queue.empty():
            batch.append(self.queue.get_nowait())
        return batch

    def push(self, out: RequestOutput) -> None:
        """Appends an output (event-loop thread only); ignored once a finished output was pushed."""
        if self.finished:
            return
        self.finished = out.finished
        self.queue.put_nowait(out)


def abort_output(request_id: str, finish_reason: FinishReason = FinishReason.ABORT) -> RequestOutput:
    """A finished output with no tokens, for requests ended outside the engine's step."""
    return RequestOutput(
        request_id=request_id, new_token_ids=[], new_text="", new_logprobs=[], finished=True,
        finish_reason=finish_reason, stop_reason=None, num_prompt_tokens=0, num_completion_tokens=0,
        num_cached_tokens=0,
    )


_COST_MIN_TOKENS = 64  # prefill steps at least this big set the per-token cost (smaller ones are overhead)


@dataclass(frozen=True)
class EngineProgress:
    """Whether the engine thread makes progress: what a node's health is judged by."""

    step_failures: int  # steps that raised, in all
    consecutive_failures: int  # steps that raised since the last one that did not
    step_running_s: float  # how long the step in progress has run; 0.0 between steps
    lost: str | None = None  # why the engine can never step again (a tensor-parallel rank lost), else None
    # the longest a full step has been seen to need: the slowest seconds per computed token of the recent
    # prefill steps times the step's token budget (0.0 before any); a big model on few cores needs minutes
    full_step_s: float = 0.0


class AsyncEngine:
    """Owns the engine thread of one node. Every coroutine here must run on the loop given to `start`."""

    def __init__(self, engine: LLMEngine, name: str = "engine") -> None:
        self.engine = engine
        self._name = name
        self._cv = threading.Condition()
        self._commands: deque[_Command[object]] = deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        self._load = engine.load()  # replaced (never mutated) by the engine thread
        self._token_times: deque[tuple[float, int]] = deque()  # (time, tokens) per step, for tokens/s
        self._on_blocks_freed: list[Callable[[], None]] = []
        # Written by the engine thread only; read anywhere (`progress`).
        self._step_failures = 0
        self._consecutive_failures = 0
        self._lost: str | None = None  # set once, by the engine thread (EngineProgress.lost)
        self._step_started: float | None = None
        self._step_costs: deque[float] = deque(maxlen=64)  # seconds per token of recent prefill steps

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the engine thread; outputs are delivered to the running event loop."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=f"{self._name}-loop", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Stops the thread after its current step; unfinished requests are aborted and their streams
        get a finished "abort" output."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        for stream in list(self._streams.values()):
            stream.push(abort_output(stream.request_id))
        self._streams.clear()
        await asyncio.to_thread(self.engine.close)  # the KV tier's pending blocks go to disk

    # -- commands -----------------------------------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs `fn(engine)` on the engine thread between steps and returns its result (or raises its
        exception). Whatever `fn` changes, it changes there. Once called, `fn` runs even if the caller
        is cancelled meanwhile; undo its effect with a later command (commands run in call order)."""
        return await asyncio.wrap_future(self.post(fn))

    def post(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Queues `fn(engine)` for the engine thread without waiting; returns its future."""
        cmd: _Command[T] = _Command(fn)
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine is stopped")
            self._commands.append(cmd)  # type: ignore[arg-type]
            self._cv.notify_all()
        return cmd.future

    def open_stream(self, request_id: str) -> RequestStream:
        """Registers the stream that receives `request_id`'s step outputs (before the request is added,
        so no output can be missed). Raises ValueError if one is open."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} already has a stream")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        """Stops delivering outputs of `request_id` (the consumer is gone)."""
        self._streams.pop(request_id, None)

    async def add_request(
        self, request_id: str, prompt: list[int], params: SamplingParams, *, hold_blocks: bool = False,
        resume: Resume | None = None,
    ) -> RequestStream:
        """Queues a request in the engine and returns its output stream. Raises ValueError as
        `LLMEngine.add_request` does (no stream is left open then)."""
        await self._prepare_grammar(params)
        stream = self.open_stream(request_id)
        try:
            stream.seq = await self.call(
                lambda e: e.add_request(request_id, prompt, params, hold_blocks=hold_blocks, resume=resume))
        except asyncio.CancelledError:
            # The add still runs on the engine thread; the abort queued after it undoes it.
            self.close_stream(request_id)
            self.post(lambda e: e.abort(request_id))
            raise
        except BaseException:
            self.close_stream(request_id)
            raise
        return stream

    async def abort(self, request_id: str) -> bool:
        """Aborts a request wherever it is in the engine, freeing its blocks; its stream (if open) ends
        with a finished "abort" output. Returns whether the engine knew it."""
        found = await self.call(lambda e: e.abort(request_id))
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.push(abort_output(request_id))
        self._notify_blocks_freed()
        return found

    async def reserve(
        self, request_id: str, prompt: list[int], params: SamplingParams, resume: Resume | None = None
    ) -> Reservation | None:
        """`LLMEngine.reserve` on the engine thread."""
        await self._prepare_grammar(params)
        return await self.call(lambda e: e.reserve(request_id, prompt, params, resume))

    async def _prepare_grammar(self, params: SamplingParams) -> None:
        """Compiles a structured-output request's grammar on a worker thread (outside the GIL), so the
        engine thread finds it cached instead of compiling between two steps. Raises GrammarError."""
        if params.structured is not None:
            spec = params.structured
            await asyncio.to_thread(lambda: self.engine.grammars.prepare(spec))

    async def append_first_token(
        self, request_id: str, token_id: int, logprob: TokenLogprob | None
    ) -> RequestOutput:
        """`LLMEngine.append_first_token` on the engine thread; the output goes to the request's stream
        as well as being returned."""
        out = await self.call(lambda e: e.append_first_token(request_id, token_id, logprob))
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.push(out)
            if out.finished:
                self._streams.pop(request_id, None)
        return out

    async def land(self, request_id: str) -> None:
        """`LLMEngine.land` on the engine thread: the request decodes from the next step."""
        await self.call(lambda e: e.land(request_id))

    async def prefill_here(self, request_id: str) -> None:
        """`LLMEngine.prefill_here` on the engine thread: the reserved request is queued as an ordinary
        one, its outputs going to the stream it already has; the freed reservation wakes block waiters."""
        seq = await self.call(lambda e: e.prefill_here(request_id))
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.seq = seq
        self._notify_blocks_freed()

    @property
    def open_streams(self) -> frozenset[str]:
        """Request ids whose outputs are delivered to a stream (event-loop thread)."""
        return frozenset(self._streams)

    def progress(self) -> EngineProgress:
        """Step failures and the running step's age (no engine call; any thread)."""
        started = self._step_started
        budget = self.engine.cfg.max_num_batched_tokens
        full = max(self._step_costs, default=0.0) * budget
        return EngineProgress(self._step_failures, self._consecutive_failures,
                              0.0 if started is None else time.monotonic() - started, self._lost, full)

    def load(self) -> EngineLoad:
        """The engine's load as of its latest step or command (no engine call; any thread)."""
        return self._load

    def tokens_per_s(self) -> float:
        """Tokens computed per second over the last few seconds (prefill and decode)."""
        now = time.monotonic()
        items = [(t, n) for t, n in list(self._token_times) if now - t <= _RATE_WINDOW_S]
        return sum(n for _, n in items) / _RATE_WINDOW_S if items else 0.0

    def on_blocks_freed(self, callback: Callable[[], None]) -> None:
        """Calls `callback` on the event loop whenever requests finish or release blocks."""
        self._on_blocks_freed.append(callback)

    # -- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        idle = False
        while True:
            with self._cv:
                while not self._commands and not self._stopping and (idle or not engine.has_unfinished()):
                    if not self._cv.wait(_IDLE_RETRY_S if idle else None):
                        break  # retry the step after an idle pause
                if self._stopping:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for cmd in commands:
                self._execute(cmd)
            outputs: list[RequestOutput] = []
            idle = self._lost is not None  # a lost engine only runs commands (the node's hand-over)
            if engine.has_unfinished() and self._lost is None:
                began = self._step_started = time.monotonic()
                try:
                    outputs = engine.step()
                except RankLost as err:  # no step can run again: the requests stay for the node to hand over
                    log.error("%s: %s; the engine stops stepping", self._name, err)
                    self._lost = str(err)
                except Exception:
                    log.exception("%s: engine step failed; aborting every request", self._name)
                    self._step_failures += 1
                    self._consecutive_failures += 1
                    outputs = self._abort_all()
                else:
                    self._consecutive_failures = 0
                finally:
                    self._step_started = None
                stats = engine.last_step
                computed = stats.num_decode_tokens + stats.num_prefill_tokens
                idle = computed == 0 and not outputs
                if stats.num_prefill_tokens >= _COST_MIN_TOKENS:
                    self._step_costs.append((time.monotonic() - began) / computed)
                if computed:
                    self._token_times.append((time.monotonic(), computed))
                    while len(self._token_times) > 4096:
                        self._token_times.popleft()
            self._load = engine.load()
            if outputs:
                self._deliver(outputs)
        self._load = engine.load()

    def _execute(self, cmd: _Command[object]) -> None:
        # A command whose caller was cancelled still runs (its effect must not depend on who is still
        # waiting), only its result goes nowhere; once running, the future can't be cancelled any more.
        wanted = cmd.future.set_running_or_notify_cancel()
        try:
            result = cmd.fn(self.engine)
        except BaseException as err:  # handed to the awaiting coroutine
            self._load = self.engine.load()
            if wanted:
                cmd.future.set_exception(err)
        else:
            # Whoever awaited the command sees the load it left behind.
            self._load = self.engine.load()
            if wanted:
                cmd.future.set_result(result)

    def _abort_all(self) -> list[RequestOutput]:
        ids = list(self._streams)
        for rid in ids:
            self.engine.abort(rid)
        return [abort_output(rid, FinishReason.ERROR) for rid in ids]

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        any_finished = False
        for out in outputs:
            any_finished |= out.finished
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.push(out)
            if out.finished:
                del self._streams[out.request_id]
        if any_finished:
            self._notify_blocks_freed()

    def _notify_blocks_freed(self) -> None:
        for callback in self._on_blocks_freed:
            try:
                callback()
            except Exception:
                log.exception("%s: blocks-freed callback failed", self._name)
