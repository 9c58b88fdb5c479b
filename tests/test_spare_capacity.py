"""The spare-capacity rule (frontend.spare_capacity) on a fake clock: idle and busy modes, the clean
baseline, additive increase / multiplicative decrease on the interactive medians, the back-off at cap 0,
and samples taken while more lines ran than the cap not counted."""

from __future__ import annotations

from pdserve.frontend.spare_capacity import _BASE_MAX_AGE_S, _PROBE_S, _WINDOW, SpareCapacity


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _request(sc: SpareCapacity, clock: Clock, ttft: float, tpot: float, lasts: float = 0.5) -> None:
    """One interactive request of `lasts` seconds ending now (it was in flight the whole time)."""
    arrived = clock.t
    sc.slots(1)
    clock.t += lasts
    sc.observe(arrived, ttft, tpot)


def _fill(sc: SpareCapacity, clock: Clock, lines: int) -> None:
    """Starts batch lines up to `lines` running."""
    while sc._lines < lines:
        sc.line_started()


def _baseline(sc: SpareCapacity, clock: Clock, n: int = 4) -> None:
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
    _baseline(sc, clock, 3)
    assert sc.slots(1) == 0
    _baseline(sc, clock, 1)
    assert sc.slots(1) == 1  # a fresh baseline: the first probe
    clock.t += _BASE_MAX_AGE_S + 1
    assert sc.slots(1) == 0  # the baseline went stale


def test_additive_increase_multiplicative_decrease() -> None:
    clock = Clock()
    sc = SpareCapacity(8, 0.05, clock=clock)
    _baseline(sc, clock)
    for cap in (1, 2, 3, 4):
        assert sc.slots(1) == cap
        _fill(sc, clock, cap)
        for _ in range(_WINDOW):
            _request(sc, clock, 0.306, 0.051)  # within half the 5 % budget: one more
        assert sc.last_ratio is not None and sc.last_ratio < 1.025
    _fill(sc, clock, 5)
    for _ in range(_WINDOW):
        _request(sc, clock, 0.312, 0.050)  # 4 % slower: held
    assert sc.slots(1) == 5
    _fill(sc, clock, 5)
    for _ in range(_WINDOW):
        _request(sc, clock, 0.300, 0.060)  # TPOT 20 % slower
    assert round(sc.last_ratio or 0, 2) == 1.2 and sc.slots(1) == 2
    for _ in range(_WINDOW):  # 5 lines still running: above the cap, not a sample of cap 2
        _request(sc, clock, 0.300, 0.060)
    assert sc.slots(1) == 2
    for _ in range(3):
        sc.line_ended()
    for _ in range(_WINDOW):
        _request(sc, clock, 0.330, 0.050)  # TTFT 10 % slower at cap 2
    assert sc.slots(1) == 1


def test_a_failed_first_line_backs_off_and_doubles() -> None:
    clock = Clock()
    sc = SpareCapacity(8, 0.05, clock=clock)
    _baseline(sc, clock)
    assert sc.slots(1) == 1
    _fill(sc, clock, 1)
    for _ in range(_WINDOW):
        _request(sc, clock, 0.400, 0.050)
    assert sc.slots(1) == 0
    sc.line_ended()
    _baseline(sc, clock, 2)  # clean again; the probe waits
    assert sc.slots(1) == 0
    clock.t += _PROBE_S
    assert sc.slots(1) == 1
    _fill(sc, clock, 1)
    start = clock.t
    for _ in range(_WINDOW):
        _request(sc, clock, 0.400, 0.050)
    sc.line_ended()
    clock.t = start + _WINDOW * 0.5 + 2 * _PROBE_S - 0.1
    assert sc.slots(1) == 0
    clock.t += 0.2
    assert sc.slots(1) == 1  # the back-off doubled
    _fill(sc, clock, 1)
    for _ in range(_WINDOW):
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
    _fill(sc, clock, 8)
    for _ in range(2 * _WINDOW):
        _request(sc, clock, 0.600, 0.100)
    assert sc.last_ratio is None and sc.cap == 1
    for _ in range(7):
        sc.line_ended()  # down to the cap: samples count from here
    for _ in range(_WINDOW):
        _request(sc, clock, 0.300, 0.050)
    assert sc.last_ratio == 1.0 and sc.slots(1) == 2
