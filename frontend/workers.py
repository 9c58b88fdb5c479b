"""A bounded pool of threads for the CPU work of admission: parsing large bodies, chat templating and
tokenization, so the event loop keeps streaming other requests' tokens meanwhile.

Threads, not processes: the tokenizer releases the GIL while it encodes (`engine.tokenizer.Tokenizer.encode`
goes through `encode_batch` for that reason), and the pure-Python parts (JSON validation, jinja rendering)
hold it at most one switch interval (5 ms) at a time, so the loop keeps its turns; a process pool would
add a copy of every tokenizer per worker and pickle every request and prompt both ways. The pool is
bounded: at most `threads` run and `queue_limit` wait; beyond that `run` answers 503 at once.

The threads run at a lower CPU priority (nice +WORKER_NICE) than the event loop: when the cores are
busy, the loop that streams tokens to clients runs first and a long prompt's preparation waits, since an
inter-token gap is felt by every stream and a slower admission only by the request it belongs to.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from frontend.errors import OVERLOADED, APIError

T = TypeVar("T")

WORKER_NICE = 5


def _lower_priority() -> None:
    """Thread initializer: raise this thread's nice value (Linux schedules threads one by one)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICE)
    except (OSError, AttributeError):  # not Linux, or not allowed: the threads keep the process's priority
        pass


class PrepareWorkers:
    """Runs admission's CPU work off the event loop (changes only its own pending count)."""

    def __init__(self, threads: int, queue_limit: int) -> None:
        assert threads >= 1 and queue_limit >= 0, (threads, queue_limit)
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="prepare",
                                            initializer=_lower_priority)
        self._capacity = threads + queue_limit
        self.pending = 0  # jobs running or waiting for a thread

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on a worker thread; its exceptions (APIError included) propagate. 503 APIError with
        Retry-After when the pool is full."""
        if self.pending >= self._capacity:
            raise APIError(503, "This frontend's request preparation queue is full; retry shortly.",
                           type=OVERLOADED, code="overloaded", headers={"retry-after": "1"})
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self.pending -= 1

    def close(self) -> None:
        """Stops the threads once their current job is done; queued jobs are dropped."""
        self._executor.shutdown(wait=False, cancel_futures=True)
