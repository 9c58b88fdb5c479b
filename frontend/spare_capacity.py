"""How many batch lines a frontend may run now without slowing its interactive requests.

Batch lines are a scavenger class: they may use what interactive traffic leaves, and must not make it
measurably slower. What is "left" depends on the model, the machine and the load, so the rule is learned
from the interactive requests themselves (the way LEDBAT-style background transfers yield to delay):

- **Idle** (no interactive request in flight here, none ended in the last `idle_s`): all
  `--batch-max-inflight` slots.
- **Busy**: at most `cap` lines. Each finished interactive request is a sample (TTFT, TPOT). A sample is
  *clean* when no batch line ran at any moment of its life; clean samples are the baseline (the last
  `_BASE_KEEP`, none older than `_BASE_MAX_AGE_S`). A sample whose whole life was at the current cap is a
  *loaded* one (the lines running never above the cap); after `_WINDOW` of them the medians are compared with the baseline's:
  either ratio over `1 + budget` halves the cap (a failed first line, cap 1 -> 0), over half the budget
  holds it, otherwise the cap grows by one (additive increase, multiplicative decrease; the hold zone
  keeps the cap from swinging over the budget and back, which is what the slowest requests would see). At cap 0 a line is tried again after a
  back-off that doubles with every failed try (`_PROBE_S` to `_PROBE_MAX_S`).
- Without a fresh baseline (none yet, or too old) the busy cap is 0 until `_BASE_MIN` clean samples
  have been seen: lines already running finish, so the next requests measure the cluster alone.

Lines already running are never stopped: the cap only gates new ones.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

_WINDOW = 6            # loaded samples per decision
_BASE_MIN = 4          # clean samples a baseline needs
_BASE_KEEP = 32        # clean samples kept
_BASE_MAX_AGE_S = 120.0
_PROBE_S = 4.0         # first back-off at cap 0
_PROBE_MAX_S = 60.0


@dataclass(frozen=True)
class Sample:
    """One finished interactive request (seconds; None where it measured nothing)."""

    at: float
    arrived: float
    ttft: float | None
    tpot: float | None


class SpareCapacity:
    """The batch-line cap of one frontend. `line_started`/`line_ended` bracket every batch line,
    `observe` takes every finished interactive request, `slots(interactive)` is the cap now."""

    def __init__(self, limit: int, budget: float, idle_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert limit >= 0 and budget > 0
        self.limit, self.budget, self.idle_s, self._clock = limit, budget, idle_s, clock
        self.cap = 0                  # busy-mode cap
        self.last_ratio: float | None = None  # the last decision's max(TTFT, TPOT) median ratio
        self._lines = 0               # batch lines running now
        self._idle_since = -float("inf")  # when _lines last became 0 (-inf: never ran)
        self._cap_since = clock()     # loaded samples must have arrived after this
        self._base: deque[Sample] = deque(maxlen=_BASE_KEEP)
        self._loaded: list[Sample] = []
        self._last_interactive = -float("inf")
        self._probe_s = _PROBE_S
        self._probe_at = clock()

    # --- events ---

    def line_started(self) -> None:
        self._lines += 1

    def line_ended(self) -> None:
        assert self._lines > 0
        self._lines -= 1
        now = self._clock()
        if self._lines == 0:
            self._idle_since = now
        if self._lines == self.cap:  # back down to the cap (after idle mode or a cut): measure from here
            self._cap_since = now

    def observe(self, arrived: float, ttft: float | None, tpot: float | None) -> None:
        """An interactive request that arrived at `arrived` (the same clock) ended now."""
        now = self._clock()
        self._last_interactive = now
        s = Sample(now, arrived, ttft, tpot)
        if self._lines == 0 and arrived >= self._idle_since:
            self._base.append(s)
        elif self._lines <= self.cap and self.cap > 0 and arrived >= self._cap_since:
            self._loaded.append(s)
            if len(self._loaded) >= _WINDOW:
                self._decide(now)

    # --- the rule ---

    def slots(self, interactive: int) -> int:
        """Batch lines this frontend may have running with `interactive` interactive requests in flight."""
        now = self._clock()
        if interactive > 0:
            self._last_interactive = now
        elif now - self._last_interactive >= self.idle_s:
            return self.limit
        if not self._fresh_base(now):
            return 0
        if self.cap == 0 and now >= self._probe_at:
            self._set_cap(1, now)
        return self.cap

    def _fresh_base(self, now: float) -> bool:
        return sum(1 for s in self._base if now - s.at <= _BASE_MAX_AGE_S) >= _BASE_MIN

    def _decide(self, now: float) -> None:
        ratio = max(_ratio(self._loaded, self._base, "ttft"), _ratio(self._loaded, self._base, "tpot"))
        self.last_ratio = ratio
        if ratio > 1.0 + self.budget:
            if self.cap <= 1:
                self._probe_at = now + self._probe_s
                self._probe_s = min(_PROBE_MAX_S, self._probe_s * 2)
            self._set_cap(self.cap // 2, now)
        elif ratio > 1.0 + self.budget / 2:  # close to the budget: hold, so the cap does not swing over it
            self._probe_s = _PROBE_S
            self._set_cap(self.cap, now)
        else:
            self._probe_s = _PROBE_S
            self._set_cap(min(self.limit, self.cap + 1), now)

    def _set_cap(self, cap: int, now: float) -> None:
        self.cap, self._cap_since, self._loaded = cap, now, []


def _ratio(loaded: list[Sample], base: deque[Sample], what: str) -> float:
    """median(loaded) / median(baseline) of one latency; 1.0 where either has no value."""
    a = [v for s in loaded if (v := getattr(s, what)) is not None]
    b = [v for s in base if (v := getattr(s, what)) is not None]
    if not a or not b:
        return 1.0
    ref = statistics.median(b)
    return statistics.median(a) / ref if ref > 0 else 1.0
