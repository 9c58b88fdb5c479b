"""Waiting on a condition in tests: poll it until it holds or a deadline passes, instead of sleeping for
a guessed time. `wait_until` fails the test naming what it waited for; `poll` leaves the verdict to
the caller; `wait_until_async` is `wait_until` for coroutines (it yields to the event loop between
polls)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(condition: Callable[[], T], timeout_s: float, interval_s: float = 0.01) -> T:
    """`condition()`'s first truthy value within `timeout_s`, else its last (falsy) value."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() <= deadline:
        time.sleep(interval_s)  # the poll interval
    return value


def wait_until(condition: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.01) -> T:
    """The first truthy value `condition()` returns; AssertionError naming `what` after `timeout_s`."""
    value = poll(condition, timeout_s, interval_s)
    if not value:
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
    return value


async def wait_until_async(condition: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.01) -> T:
    """`wait_until` on an event loop: the loop runs between polls."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(interval_s)  # the poll interval
    return value
