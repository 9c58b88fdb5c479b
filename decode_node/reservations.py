"""The decode node's reservation queue: KV blocks for a remote request's prompt are reserved before any
prefill work is spent on it (prefix-cache hits shared). A request that does not fit waits in priority
order (`SamplingParams.priority`, lower first), FIFO within a priority; a wait past
`reservation_timeout_s` or a prompt that can never fit refuses it, and so does a full queue, unless a
less urgent request waits in it: that one is refused instead."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass

from pdserve.decode_node.request import DecodeRequest, Stage
from pdserve.engine.block_manager import Reservation
from pdserve.node_common.service import NodeContext

_POLL_S = 0.05  # re-try the queue head this often even without a blocks-freed signal


class ReservationRefused(Exception):
    """The request cannot get its blocks now (queue full, waited too long, never fits)."""


@dataclass(eq=False)
class _Waiter:
    request: DecodeRequest
    future: asyncio.Future[Reservation]


class ReservationQueue:
    """Requests waiting for blocks, most urgent first, FIFO within a priority. `kick` (on blocks freed)
    retries the head."""

    def __init__(self, ctx: NodeContext, limit: int, timeout_s: float) -> None:
        self._ctx = ctx
        self._limit = limit
        self._timeout_s = timeout_s
        self._queue: deque[_Waiter] = deque()
        self._pumping = False

    def __len__(self) -> int:
        return len(self._queue)

    async def reserve(self, req: DecodeRequest) -> Reservation:
        """Reserves the prompt's blocks, waiting in FIFO order while the KV cache is full. Raises
        ReservationRefused, or ValueError for a request the engine rejects. A reservation made just as
        the caller gave up is left to the abort that ends the request."""
        engine = self._ctx.engine
        num_tokens = len(req.context_ids)
        if engine.engine.block_manager.blocks_needed(num_tokens + 1) > engine.engine.num_blocks:
            raise ReservationRefused(f"a {num_tokens}-token prompt can never fit this node's KV cache")
        priority = req.params.priority
        if not any(w.request.params.priority <= priority for w in self._queue):  # nobody ahead of it
            reservation = await engine.reserve(req.key, req.prompt, req.params, req.resume)
            if reservation is not None:
                return reservation
        if len(self._queue) >= self._limit:
            self._make_room(priority)
        waiter = _Waiter(req, asyncio.get_running_loop().create_future())
        at = next((i for i, w in enumerate(self._queue) if w.request.params.priority > priority), len(self._queue))
        self._queue.insert(at, waiter)
        deadline = time.monotonic() + self._timeout_s
        try:
            while True:
                self.kick()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ReservationRefused(f"no KV blocks for {self._timeout_s:g}s")
                with contextlib.suppress(TimeoutError):
                    return await asyncio.wait_for(asyncio.shield(waiter.future), min(left, _POLL_S))
        finally:
            if not waiter.future.done():
                waiter.future.cancel()
            with contextlib.suppress(ValueError):
                self._queue.remove(waiter)

    def _make_room(self, priority: int) -> None:
        """Refuses the least urgent waiter (the newest among equals) when it is less urgent than
        `priority`; raises ReservationRefused for the newcomer otherwise."""
        tail = self._queue[-1]
        if tail.request.params.priority <= priority:
            raise ReservationRefused("reservation queue is full")
        self._queue.pop()
        if not tail.future.done():
            tail.future.set_exception(ReservationRefused("reservation queue is full of more urgent requests"))

    def refuse_all(self, reason: str) -> int:
        """Refuses every request waiting in the queue (its `reserve` raises ReservationRefused); returns
        how many. A reservation being made for the head is given back by the pump."""
        refused = 0
        for waiter in self._queue:
            if not waiter.future.done():
                waiter.future.set_exception(ReservationRefused(reason))
                refused += 1
        return refused

    def kick(self) -> None:
        """Retries the head of the queue (blocks may have been freed)."""
        if self._queue and not self._pumping:
            self._pumping = True
            self._ctx.spawn(self._pump(), "reservation-pump")

    async def _pump(self) -> None:
        try:
            while self._queue:
                waiter = self._queue[0]
                if waiter.future.done():
                    self._queue.popleft()
                    continue
                req = waiter.request
                try:
                    reservation = await self._ctx.engine.reserve(req.key, req.prompt, req.params, req.resume)
                except ValueError as err:
                    self._queue.popleft()
                    if not waiter.future.done():
                        waiter.future.set_exception(err)
                    continue
                if reservation is None:
                    return  # the head waits for blocks, everyone behind it too
                self._queue.popleft()
                if waiter.future.done():  # the caller gave up while the reservation was being made
                    await self._ctx.engine.abort(req.key)
                else:
                    waiter.future.set_result(reservation)
        finally:
            self._pumping = False

    def check_integrity(self, requests: dict[str, DecodeRequest]) -> None:
        """Asserts every waiter is a registered request still waiting for its blocks, in priority order."""
        priorities = [w.request.params.priority for w in self._queue]
        assert priorities == sorted(priorities), "the reservation queue is out of priority order"
        for waiter in self._queue:
            if waiter.future.done():
                continue  # given up or served; leaves the queue on its next pass
            req = waiter.request
            assert requests.get(req.key) is req, f"queued request {req.key} is not registered"
            assert req.stage == Stage.WAITING_FOR_BLOCKS, f"queued request {req.key} is {req.stage.name}"
