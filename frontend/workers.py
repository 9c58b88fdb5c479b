"""A bounded set of worker processes for the CPU work of admission (`frontend.prepare`: parsing large
bodies, chat templating, tokenization), so the event loop keeps streaming other requests' tokens meanwhile.

Processes, not threads. Chat templating and the Python side of tokenization hold the GIL, and a thread
holding it stalls the event loop however the OS schedules them: a low-priority thread that is preempted
while it holds the GIL keeps the loop waiting (priority inversion). Each worker process holds its own
copy of every served model's tokenizer (`ModelCatalog`, no weights) and gets the body or the validated
request pickled in; token ids come back. The copies cost a few tens of MB per worker and the pickling
about as much time as reading the body; a small body is cheaper to do inline (`prepare_inline_bytes`).

The workers run at a lower CPU priority (nice +WORKER_NICE) than the rest of the frontend and the nodes on
the same host: when the cores are busy, the work that streams tokens runs first and a long prompt's
preparation waits, since an inter-token gap is felt by every stream and a slower admission only by the
request it belongs to. The workers are bounded: at most `processes` tasks run and `queue_limit` wait;
beyond that `run` answers 503 at once. A worker that dies (killed, out of memory) fails only the tasks it
held, with 503, and the executor is started afresh.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import wait
from typing import TypeVar

from pdserve.frontend.config import ModelSpec
from pdserve.frontend.errors import OVERLOADED, APIError
from pdserve.frontend.models import ModelCatalog, ServedModel
from pdserve.frontend.prepare import Tokenized, parse_request, tokenize
from pdserve.frontend.protocol import GenerationRequest, RequestLimits

T = TypeVar("T")

WORKER_NICE = 19


class _Worker:
    """The state of one worker process: the served models, loaded once when the process starts."""

    catalog: ModelCatalog | None = None


def _exit_with_parent() -> None:
    """Ends this worker when the frontend process ends, however it ends. A worker holds both ends of the
    executor's task pipe, so it would never see end-of-file and would wait for tasks forever."""
    parent = multiprocessing.parent_process()
    assert parent is not None
    wait([parent.sentinel])
    os._exit(0)


def _start_worker(models: tuple[ModelSpec, ...], nice: int) -> None:
    """Worker process initializer."""
    threading.Thread(target=_exit_with_parent, name="parent-watch", daemon=True).start()
    # Ctrl-C reaches the whole process group; the frontend decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(nice)
    except OSError:  # not allowed: the workers keep the frontend's priority
        pass
    _Worker.catalog = ModelCatalog(models) if models else None


def _tokenize_by_name(req: GenerationRequest, model_name: str, version: str) -> Tokenized:
    """`tokenize` in a worker, with the worker's own copy of the model version's tokenizer."""
    assert _Worker.catalog is not None, "the prepare workers were started without models"
    return tokenize(req, _Worker.catalog.version(model_name, version))


def _ready() -> int:
    return os.getpid()


class PrepareWorkers:
    """Runs admission's CPU work in worker processes (changes only its own pending count, and its
    executor when a worker died)."""

    def __init__(self, processes: int, queue_limit: int, models: tuple[ModelSpec, ...] = (),
                 nice: int = WORKER_NICE) -> None:
        assert processes >= 1 and queue_limit >= 0, (processes, queue_limit)
        self._processes, self._models, self._nice = processes, models, nice
        self._capacity = processes + queue_limit
        self._executor: Executor = self._new_executor()
        self.pending = 0  # tasks running or waiting for a worker
        self.restarts = 0  # executors started afresh after a worker died

    def _new_executor(self) -> ProcessPoolExecutor:
        # spawn, not fork: the frontend has threads (gRPC, the registry watch) that fork would copy mid-state.
        return ProcessPoolExecutor(max_workers=self._processes, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start_worker, initargs=(self._models, self._nice))

    async def start(self) -> None:
        """Starts every worker now and waits until each has loaded the models, so the first long prompts
        do not wait for a process to start."""
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._executor, _ready) for _ in range(self._processes)))

    async def parse(self, kind: str, body: bytes, limits: RequestLimits) -> GenerationRequest:
        """`frontend.prepare.parse_request` in a worker."""
        return await self.run(parse_request, kind, body, limits)

    async def tokenize(self, req: GenerationRequest, model: ServedModel) -> Tokenized:
        """`frontend.prepare.tokenize` in a worker (which holds its own copy of `model`'s tokenizer)."""
        return await self.run(_tokenize_by_name, req, model.name, model.version)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` in a worker process (`fn` and the arguments are pickled); its exceptions (APIError
        included) propagate. 503 APIError with Retry-After when the queue is full or a worker died."""
        if self.pending >= self._capacity:
            raise APIError(503, "This frontend's request preparation queue is full; retry shortly.",
                           type=OVERLOADED, code="overloaded", headers={"retry-after": "1"})
        self.pending += 1
        executor = self._executor
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
        except BrokenProcessPool:
            if executor is self._executor:  # the first task to notice starts the executor afresh
                executor.shutdown(wait=False, cancel_futures=True)  # the broken one
                self._executor = self._new_executor()
                self.restarts += 1
            raise APIError(503, "A request preparation worker of this frontend stopped; retry shortly.",
                           type=OVERLOADED, code="overloaded", headers={"retry-after": "1"}) from None
        finally:
            self.pending -= 1

    def close(self, grace_s: float = 1.0) -> None:
        """Stops the workers: queued tasks are dropped and a running one has `grace_s` to end before its
        process is killed. At nice +19 on busy cores a worker's orderly exit can take longer than a stop
        signal's grace (17 s measured beside four busy processes on two cores), so it is not waited for."""
        executor = self._executor
        processes = list((getattr(executor, "_processes", None) or {}).values())  # pid -> Process
        executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + grace_s
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(5)
        executor.shutdown(wait=True)
        # The executor's queues hold named semaphores that are unlinked when they are collected; the frontend
        # may end by re-raising SIGTERM, with no exit handlers, so collect them now.
        closed = ThreadPoolExecutor(max_workers=1)
        closed.shutdown()  # refuses every task from now on
        self._executor = closed
        gc.collect()
