"""Core pinning of a node process (`--cpus`): the whole process, every thread it has and every thread it
will start, runs on the given CPUs. Used to compare serving shapes fairly on one machine (a prefill and a
decode node on one core each against one colocated node on both) and to keep co-located nodes off each
other's cores."""

from __future__ import annotations

import os


def parse_cpus(spec: str) -> tuple[int, ...]:
    """`"0,2-3"` -> (0, 2, 3). Raises ValueError on a malformed list."""
    cpus: set[int] = set()
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        lo, sep, hi = part.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"empty CPU list {spec!r}")
    return tuple(sorted(cpus))


def format_cpus(cpus: tuple[int, ...]) -> str:
    return ",".join(str(c) for c in cpus)


def pin_process(cpus: tuple[int, ...]) -> None:
    """Pins every thread of this process to `cpus` (threads started later inherit the calling thread's
    mask). Linux applies sched_setaffinity per thread, so each existing thread is set by its tid: a thread
    started at import time would otherwise stay free and compete for the other nodes' cores."""
    usable = os.sched_getaffinity(0)
    if not set(cpus) <= usable:
        raise ValueError(f"--cpus {format_cpus(cpus)} is not within this process's CPUs {sorted(usable)}")
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


def split_cpus(available: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    """`n` disjoint, contiguous CPU sets covering `available` as evenly as possible (the later sets get
    the remainder), or, with fewer CPUs than `n`, one CPU each taken round-robin (nodes then share)."""
    assert n >= 1 and available
    if n > len(available):
        return [(available[i % len(available)],) for i in range(n)]
    base, extra = divmod(len(available), n)
    out, start = [], 0
    for i in range(n):
        size = base + (1 if i >= n - extra else 0)
        out.append(tuple(available[start:start + size]))
        start += size
    return out
