"""How many batch lines a frontend may run now without slowing its interactive requests.

Batch lines are a scavenger class: they may use what interactive traffic leaves, and must not make it
measurably slower. What is "left" depends on the model, the machine and the load, so the rule is learned
from the interactive requests themselves (the way LEDBAT-style background transfers yield to delay):

- **Idle** (no interactive request in flight here, none ended in the last `idle_s`): all
  `--batch-max-inflight` slots.
- **Busy**: at most `cap` lines. Two latencies of the interactive requests are watched: each request's
  TTFT (when it ends) and each gap between its streamed token messages (as it arrives: the decode
  step time its stream sees, a fast signal even when requests are long). A sample is *clean* when no
  batch line ran at any moment of its span; clean samples are the baseline (the latest, none older
  than `_BASE_MAX_AGE_S`). A sample whose whole span was at the current cap (never more lines running)
  is a *loaded* one. After a window of loaded samples of either latency (`_TTFT` requests, `_GAPS`
  gaps) the medians are compared with the baseline's, by the larger ratio:
  - over `1 + budget`: the cap is halved (a failed first line: 1 -> 0);
  - over `1 + budget/2`: held (so the cap does not swing over the budget and back, which is what the
    slowest requests would see);
  - else: one more (additive increase, multiplicative decrease).
  Backing off is quicker than growing: a third of a window over twice the budget halves the cap at
  once. At cap 0 a line is tried again after a back-off that doubles with every failed try
  (`_PROBE_S` to `_PROBE_MAX_S`).
- Without a fresh baseline (none yet, or too old) the busy cap is 0 until enough clean samples
  have been seen: lines already running finish, so the next requests measure the cluster alone.

Lines already running are never stopped: the cap only gates new ones.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

_BASE_MAX_AGE_S = 120.0
_PROBE_S = 4.0         # first back-off at cap 0
_PROBE_MAX_S = 60.0


@dataclass(eq=False)
class _Latency:
    """One latency the rule watches: its clean baseline and the loaded samples at the current cap."""

    window: int     # loaded samples per decision (a third of it when over twice the budget)
    base_min: int   # clean samples a fresh baseline needs
    base: deque[tuple[float, float]]  # (when, seconds) of clean samples, the latest kept
    loaded: list[float] = field(default_factory=list)
    _ref: float | None = None  # median of the baseline, None until asked for after a change

    def add_clean(self, at: float, value: float) -> None:
        self.base.append((at, value))
        self._ref = None

    def fresh(self, now: float) -> bool:
        return sum(1 for at, _ in self.base if now - at <= _BASE_MAX_AGE_S) >= self.base_min

    def ratio(self) -> float | None:
        """median(loaded) / median(baseline); None under a third of a window or without a baseline."""
        if len(self.loaded) < max(1, self.window // 3) or not self.base:
            return None
        if self._ref is None:
            self._ref = statistics.median(v for _, v in self.base)
        return statistics.median(self.loaded) / self._ref if self._ref > 0 else None


_TTFT = (6, 4, 32)    # a request's TTFT: window, baseline minimum, baseline kept
_GAPS = (24, 32, 512)  # a gap between token messages


class SpareCapacity:
    """The batch-line cap of one frontend. `line_started`/`line_ended` bracket every batch line,
    `observe` takes every finished interactive request and `observe_gap` each of their token messages
    after the first; `slots(interactive)` is the cap now."""

    def __init__(self, limit: int, budget: float, idle_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert limit >= 0 and budget > 0
        self.limit, self.budget, self.idle_s, self._clock = limit, budget, idle_s, clock
        self.cap = 0                  # busy-mode cap
        self.last_ratio: float | None = None  # the last decision's larger median ratio
        self._lines = 0               # batch lines running now
        self._idle_since = -float("inf")  # when _lines last became 0 (-inf: never ran)
        self._cap_since = clock()     # loaded samples must have started after this
        self._ttft = _Latency(_TTFT[0], _TTFT[1], deque(maxlen=_TTFT[2]))
        self._gaps = _Latency(_GAPS[0], _GAPS[1], deque(maxlen=_GAPS[2]))
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

    def observe(self, arrived: float, ttft: float | None) -> None:
        """An interactive request that arrived at `arrived` (the same clock) ended now."""
        now = self._last_interactive = self._clock()
        if ttft is not None:
            self._sample(self._ttft, now, arrived, ttft)

    def observe_gap(self, gap: float) -> None:
        """A token message of an interactive request arrived now, `gap` seconds after its previous one."""
        now = self._last_interactive = self._clock()
        self._sample(self._gaps, now, now - gap, gap)

    def _sample(self, lat: _Latency, now: float, start: float, value: float) -> None:
        if self._lines == 0 and start >= self._idle_since:
            lat.add_clean(now, value)
        elif 0 < self.cap and self._lines <= self.cap and start >= self._cap_since:
            lat.loaded.append(value)
            ratio = lat.ratio()
            if len(lat.loaded) >= lat.window or (ratio is not None and ratio > 1 + 2 * self.budget):
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
        return self._gaps.fresh(now) or self._ttft.fresh(now)

    def _decide(self, now: float) -> None:
        ratio = self.last_ratio = max((r for lat in (self._ttft, self._gaps) if (r := lat.ratio()) is not None),
                                      default=1.0)
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
        self.cap, self._cap_since = cap, now
        self._ttft.loaded, self._gaps.loaded = [], []
