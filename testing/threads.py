"""Helper threads whose failures reach the test: `start_thread(fn)` returns a Future, and `.result()`
re-raises what `fn` raised (an assertion in a plain `threading.Thread` only prints a warning)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def start_thread(fn: Callable[..., T], *args: Any, name: str | None = None) -> Future[T]:
    """Runs `fn(*args)` in a daemon thread; the future holds its result or its exception."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - everything goes to the test that waits on it
            future.set_exception(err)

    threading.Thread(target=run, daemon=True, name=name or getattr(fn, "__name__", "helper")).start()
    return future
