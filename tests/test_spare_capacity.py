"""The spare-capacity rule (frontend.spare_capacity) on a fake clock: idle and busy modes, the clean
baseline, additive increase / multiplicative decrease on the interactive medians (TTFT per request, the
gaps between token messages), the quick back-off and the probe back-off at cap 0, and samples taken while
more lines ran than the cap not counted."""

from __future__ import annotations

from pdserve.frontend.spare_capacity import _BASE_MAX_AGE_S, _GAPS, _PROBE_S, _TTFT, SpareCapacity

GAPS = 6  # token gaps per request below: 4 requests make a gap window (24)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _request(sc: SpareCapacity, clock: Clock, ttft: float, gap: float, gaps: int = GAPS) -> None:
    """One interactive request in flight from now: its first token after `ttft`, then `gaps` token gaps."""
    arrived = clock.t
    sc.slots(1)
    clock.t += ttft
    for _ in range(gaps):
        clock.t += gap
        sc.observe_gap(gap)
    sc.observe(arrived, ttft)


def _fill(sc: SpareCapacity, lines: int) -> None:
    while sc._lines < lines:
        sc.line_started()


def _baseline(sc: SpareCapacity, clock: Clock, n: int = 6) -> None:
    for _ in range(n):
        _request(sc, clock, 0.300, 0.050)


def test_idle_gets_every_slot_busy_none_without_a_baseline() -> None:
    clock = Clock()
    sc = SpareCapacity(8, 0.05, idle_s=2.0, clock=clock)
    assert sc.slots(0) == 8  # nothing interactive ever: idle
    assert sc.slots(1) == 0  # interactive, no baseline yet
    clock.t += 1.0
    assert sc.slots(0) == 0  # interactive ended under idle_s ago: still busy mode
    clock.t += 2.0
    assert sc.slots(0) == 8
    _request(sc, clock, 0.3, 0.05, gaps=_GAPS[1] - 1)
    assert sc.slots(1) == 0  # one request: neither baseline is fresh yet
    _request(sc, clock, 0.3, 0.05, gaps=1)
    assert sc.slots(1) == 1  # 32 clean gaps: the first probe
    clock.t += _BASE_MAX_AGE_S + 1
    assert sc.slots(1) == 0  # the baseline went stale
    _request(sc, clock, 0.3, 0.05, gaps=0)  # requests without gaps (one token each): their TTFTs suffice
    _request(sc, clock, 0.3, 0.05, gaps=0)
    _request(sc, clock, 0.3, 0.05, gaps=0)
    assert sc.slots(1) == 0
    _request(sc, clock, 0.3, 0.05, gaps=0)
    assert sc.cap == 1 and sc.slots(1) == 1


def test_additive_increase_multiplicative_decrease() -> None:
    clock = Clock()
    sc = SpareCapacity(8, 0.05, clock=clock)
    _baseline(sc, clock)
    for cap in (1, 2, 3, 4):
        assert sc.slots(1) == cap
        _fill(sc, cap)
        for _ in range(4):
            _request(sc, clock, 0.303, 0.051)  # within half the 5 % budget: one more
        assert sc.last_ratio is not None and sc.last_ratio < 1.025
    _fill(sc, 5)
    for _ in range(4):
        _request(sc, clock, 0.300, 0.052)  # 4 % slower: held
    assert sc.slots(1) == 5
    for _ in range(4):
        _request(sc, clock, 0.300, 0.0535)  # 7 % slower: halved
    assert round(sc.last_ratio or 0, 2) == 1.07 and sc.slots(1) == 2
    for _ in range(4):  # 5 lines still running: above the cap, not a sample of cap 2
        _request(sc, clock, 0.300, 0.060)
    assert sc.slots(1) == 2
    for _ in range(3):
        sc.line_ended()
    for _ in range(_TTFT[0]):
        _request(sc, clock, 0.321, 0.050, gaps=0)  # TTFT 7 % slower at cap 2 (no gaps)
    assert sc.slots(1) == 1


def test_backing_off_is_quick_and_the_probe_waits_longer_each_time() -> None:
    clock = Clock()
    sc = SpareCapacity(8, 0.05, clock=clock)
    _baseline(sc, clock)
    assert sc.slots(1) == 1
    _fill(sc, 1)
    sc.slots(1)
    for _ in range(_GAPS[0] // 3 - 1):
        clock.t += 0.08
        sc.observe_gap(0.08)  # 60 % slower
    assert sc.cap == 1
    clock.t += 0.08
    sc.observe_gap(0.08)
    assert sc.cap == 0 and round(sc.last_ratio or 0, 2) == 1.6  # a third of a window, not a whole one
    cut = clock.t
    sc.line_ended()
    _baseline(sc, clock, 1)  # clean again; the probe waits
    assert sc.slots(1) == 0
    clock.t = cut + _PROBE_S
    assert sc.slots(1) == 1
    _fill(sc, 1)
    for _ in range(4):
        _request(sc, clock, 0.300, 0.0535)  # 7 %: a whole window, then halved to 0
    assert sc.cap == 0
    cut = clock.t
    sc.line_ended()
    clock.t = cut + 2 * _PROBE_S - 0.1
    assert sc.slots(1) == 0
    clock.t += 0.2
    assert sc.slots(1) == 1  # the back-off doubled
    _fill(sc, 1)
    for _ in range(4):
        _request(sc, clock, 0.300, 0.050)
    assert sc.slots(1) == 2


def test_samples_from_before_the_cap_do_not_count() -> None:
    """Lines started in idle mode run on when interactive traffic returns: requests that overlapped them
    are neither clean nor samples of the cap."""
    clock = Clock()
    sc = SpareCapacity(8, 0.05, clock=clock)
    _baseline(sc, clock)
    clock.t += 5.0
    assert sc.slots(0) == 8
    _fill(sc, 8)
    for _ in range(8):
        _request(sc, clock, 0.600, 0.100)
    assert sc.last_ratio is None and sc.cap == 1
    for _ in range(7):
        sc.line_ended()  # down to the cap: samples count from here
    for _ in range(4):
        _request(sc, clock, 0.300, 0.050)
    assert sc.last_ratio == 1.0 and sc.slots(1) == 2
