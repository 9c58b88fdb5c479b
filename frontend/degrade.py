"""Degradation policies: what a model's requests give up under pressure instead of being refused.

A model's `degrade` mapping in the models file (re-read while the frontend runs) names its policies:

- `cap_max_tokens`: while the model's pool is under pressure (its decode nodes' KV use or the queue its
  nodes report reaches a threshold), a request's output is capped at `max_tokens` (max_tokens,
  max_completion_tokens or the model's default alike), so the pool drains sooner;
- `trim_history`: a chat prompt over the model's context loses its oldest turns (system messages and the
  last user turn stay) until it fits, when the request says `truncation: "auto"` or the policy's default
  is `auto`; otherwise the context-length error stands;
- `long_prompt_lane`: prompts over `above_tokens` wait in a lane of their own, at most `max_concurrent`
  of them in flight per model, so short prompts are not queued behind long ones at the prefill nodes.

A policy counts as applied to a request when it changed what the request got (fewer output tokens, fewer
messages, a wait in the lane). Applied policies are named in the response's `x-pdserve-degraded` header and
the request log line, and counted in `pdserve_frontend_degradations_total{model,policy}`.

The rules are pure functions here (`pool_pressure`, `pressure_cap`, `trim_allowed`, `next_drop`); the
lanes (`Lanes`) are the one piece of state, read and changed on the event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from annotated_types import Ge, Gt, Le

from pdserve.frontend.config_files import ConfigError, FileEntry, Requirement
from pdserve.frontend.errors import OVERLOADED, APIError
from pdserve.registry.view import Member

HEADER = "x-pdserve-degraded"
CAP_MAX_TOKENS = "cap_max_tokens"
TRIM_HISTORY = "trim_history"
LONG_PROMPT_LANE = "long_prompt_lane"
POLICIES = (CAP_MAX_TOKENS, TRIM_HISTORY, LONG_PROMPT_LANE)  # the `policy` label values
TRUNCATIONS = ("auto", "disabled")


# --- the policies, as the models file gives them ----------------------------------------------------


@dataclass(frozen=True)
class CapMaxTokens:
    """Caps output at `max_tokens` while the pool's KV use reaches `kv_use_above` or its reported queue
    reaches `queue_above` (None: that signal is not looked at; 0: always under pressure)."""

    max_tokens: int
    kv_use_above: float | None = None
    queue_above: int | None = None


@dataclass(frozen=True)
class TrimHistory:
    """Whether a request that says nothing of `truncation` may be trimmed to fit ("auto") or not."""

    default: str = "disabled"


@dataclass(frozen=True)
class LongPromptLane:
    """Prompts over `above_tokens` run at most `max_concurrent` at a time per model; at most
    `max_waiting` wait for a place (then 503 with Retry-After)."""

    above_tokens: int
    max_concurrent: int = 1
    max_waiting: int = 64


@dataclass(frozen=True)
class DegradePolicy:
    """A model's degradation policies (None: that policy is off)."""

    cap_max_tokens: CapMaxTokens | None = None
    trim_history: TrimHistory | None = None
    long_prompt_lane: LongPromptLane | None = None

    def describe(self) -> str:
        on = [name for name in POLICIES if getattr(self, name) is not None]
        return ", ".join(on) or "none"


NO_POLICY = DegradePolicy()

_Positive = Annotated[int, Gt(0)]


class CapEntry(FileEntry):
    kind: ClassVar[str] = "degrade.cap_max_tokens"
    max_tokens: Annotated[_Positive, Requirement("max_tokens is required and must be a "
                                                 "positive integer, got {value!r}")]
    kv_use_above: Annotated[Annotated[float, Ge(0), Le(1)] | None,
                            Requirement("kv_use_above must be a number in [0, 1] or null, "
                                        "got {value!r}")] = None
    queue_above: Annotated[Annotated[int, Ge(0)] | None,
                           Requirement("queue_above must be an integer >= 0 or null, "
                                       "got {value!r}")] = None

    def policy(self) -> CapMaxTokens:
        if self.kv_use_above is None and self.queue_above is None:
            raise ConfigError("degrade.cap_max_tokens needs kv_use_above or queue_above (or both): the pressure "
                              "it applies under")
        kv = None if self.kv_use_above is None else float(self.kv_use_above)
        return CapMaxTokens(self.max_tokens, kv, self.queue_above)


class TrimEntry(FileEntry):
    kind: ClassVar[str] = "degrade.trim_history"
    default: Annotated[Literal["auto", "disabled"],
                       Requirement("default must be auto or disabled, got {value!r}")] = "disabled"

    def policy(self) -> TrimHistory:
        return TrimHistory(self.default)


class LaneEntry(FileEntry):
    kind: ClassVar[str] = "degrade.long_prompt_lane"
    above_tokens: Annotated[_Positive, Requirement("above_tokens is required and must be "
                                                   "a positive integer, got {value!r}")]
    max_concurrent: Annotated[_Positive, Requirement("max_concurrent must be a positive "
                                                     "integer, got {value!r}")] = 1
    max_waiting: Annotated[Annotated[int, Ge(0)], Requirement("max_waiting must be an "
                                                              "integer >= 0, got {value!r}")] = 64

    def policy(self) -> LongPromptLane:
        return LongPromptLane(self.above_tokens, self.max_concurrent, self.max_waiting)


def _section(entry: type[CapEntry] | type[TrimEntry] | type[LaneEntry], name: str, value: Any) -> Any:
    # `trim_history: auto` is short for `trim_history: {default: auto}`.
    if name == TRIM_HISTORY and isinstance(value, str):
        value = {"default": value}
    return entry.read(f"degrade.{name}", value).policy()


def parse_degrade(value: Any) -> DegradePolicy:
    """A models-file entry's `degrade` mapping (null, or a policy's null: off). Raises ConfigError naming
    the field."""
    if isinstance(value, DegradePolicy):
        return value
    if value is None:
        return NO_POLICY
    if not isinstance(value, dict):
        raise ConfigError(f"degrade must be a mapping of policies ({', '.join(POLICIES)}), got {value!r}")
    unknown = sorted(set(value) - set(POLICIES))
    if unknown:
        raise ConfigError(f"degrade: unknown policy(ies) {unknown}; allowed: {list(POLICIES)}")
    entries = {CAP_MAX_TOKENS: CapEntry, TRIM_HISTORY: TrimEntry, LONG_PROMPT_LANE: LaneEntry}
    return DegradePolicy(**{name: _section(entries[name], name, section) for name, section in value.items()
                            if section is not None})


# --- cap_max_tokens ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolPressure:
    """What the frontend knows of a pool's load from its nodes' load reports: the fraction of its decode
    nodes' KV blocks in use, and the requests its nodes (prefill and decode) report waiting."""

    kv_use: float
    queue: int

    def describe(self) -> str:
        return f"kv_use={self.kv_use:.2f} queue={self.queue}"


def pool_pressure(decode: Sequence[Member], prefill: Sequence[Member]) -> PoolPressure:
    """The pressure of a pool from its members' last load reports (a node without one counts as idle)."""
    used = total = 0
    for m in decode:
        blocks = (m.load.kv_blocks_total if m.load is not None else 0) or m.record.capacity.num_kv_blocks
        total += blocks
        used += 0 if m.load is None else min(blocks, m.load.kv_blocks_used)
    queue = sum(m.load.queue_len for m in (*decode, *prefill) if m.load is not None)
    return PoolPressure(used / total if total else 0.0, queue)


def under_pressure(cap: CapMaxTokens, pressure: PoolPressure) -> bool:
    """Whether either configured signal has reached its threshold (a threshold of 0 always has)."""
    return ((cap.kv_use_above is not None and pressure.kv_use >= cap.kv_use_above)
            or (cap.queue_above is not None and pressure.queue >= cap.queue_above))


def pressure_cap(policy: DegradePolicy, pressure: PoolPressure) -> int | None:
    """The output cap in force for a new request (None: no cap now)."""
    cap = policy.cap_max_tokens
    return cap.max_tokens if cap is not None and under_pressure(cap, pressure) else None


# --- trim_history -----------------------------------------------------------------------------------


def trim_allowed(policy: DegradePolicy, truncation: str | None) -> bool:
    """Whether a chat over the context may be trimmed: the request says "auto", or it says nothing and the
    model's trim_history default is "auto"."""
    if truncation is not None:
        return truncation == "auto"
    return policy.trim_history is not None and policy.trim_history.default == "auto"


def next_drop(messages: Sequence[dict[str, Any]]) -> list[int]:
    """The indices of the messages to drop next to shorten a chat: its oldest message that is neither a
    system (or developer) message nor the last user message or after it, with the tool results that follow
    it (a call's results go with it). Empty when nothing may go."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=len(messages) - 1)
    first = next((i for i in range(last_user) if messages[i].get("role") not in ("system", "developer")), None)
    if first is None:
        return []
    drop = [first]
    j = first + 1
    while j < last_user and messages[j].get("role") == "tool":
        drop.append(j)
        j += 1
    return drop


# --- long_prompt_lane -------------------------------------------------------------------------------


@dataclass(eq=False)
class Lane:
    """One model's long-prompt lane: how many are in flight and who waits for a place, in order."""

    active: int = 0
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)


@dataclass(eq=False)
class LaneSlot:
    """A place in a lane, held until the job ends; `release` is idempotent."""

    lanes: Lanes
    key: str
    waited: bool
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.lanes.release(self.key)


class Lanes:
    """The long-prompt lanes of the served models (keyed by model name; the policy in force is passed on
    each call, so a reloaded models file applies to the next request)."""

    def __init__(self) -> None:
        self._lanes: dict[str, Lane] = {}
        self._limits: dict[str, int] = {}

    def lane(self, key: str) -> Lane:
        return self._lanes.setdefault(key, Lane())

    async def acquire(self, key: str, policy: LongPromptLane, what: str) -> LaneSlot:
        """A place in the lane of `key`, at once when one is free and nobody waits, else after the ones
        ahead. 503 APIError (Retry-After) when `policy.max_waiting` already wait. Cancel-safe."""
        lane = self.lane(key)
        self._limits[key] = policy.max_concurrent
        if lane.active < policy.max_concurrent and not lane.waiters:
            lane.active += 1
            return LaneSlot(self, key, waited=False)
        if len(lane.waiters) >= policy.max_waiting:
            raise APIError(503, f"{what}: its long-prompt lane (prompts over {policy.above_tokens} tokens, "
                           f"{policy.max_concurrent} at a time) has {len(lane.waiters)} waiting already. Retry "
                           "shortly or send a shorter prompt.", type=OVERLOADED, code="overloaded",
                           headers={"retry-after": "1"})
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        lane.waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(key)  # the place was handed over as the wait was cancelled: pass it on
            else:
                lane.waiters.remove(waiter)
            raise
        return LaneSlot(self, key, waited=True)

    def release(self, key: str) -> None:
        """A place is given back: the next waiter takes it while the lane is under its limit."""
        lane = self._lanes[key]
        assert lane.active > 0, f"lane {key!r} released more places than it gave"
        lane.active -= 1
        limit = self._limits.get(key, 1)
        while lane.waiters and lane.active < limit:
            waiter = lane.waiters.popleft()
            if not waiter.done():
                lane.active += 1
                waiter.set_result(None)
