"""Drives a run: open-loop arrivals (a Poisson rate or a trace's timestamps, optionally capped in
concurrency) or a closed loop of C clients, with a progress bar on stderr; and rate sweeps that stop at
the first rate missing the SLO attainment target."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pdserve.planner.loadgen.client import RequestRecord, Target, first_model, send
from pdserve.planner.loadgen.metrics import SLO, Summary, summarize
from pdserve.planner.loadgen.workload import (
    RequestSpec,
    Workload,
    WorkloadConfig,
    poisson_arrivals,
    read_trace,
)

SWEEP_STEP_OFFSET = 1_000_000  # request indices of sweep step k start here x k: fresh prompts per rate
AUTO_SWEEP_MAX_STEPS = 10


@dataclass
class LoadConfig:
    """One `pdserve bench` invocation, minus output options."""

    target: Target
    workload: WorkloadConfig
    rate: float | None = None  # req/s (inf: all at once); None with a concurrency: closed loop
    concurrency: int | None = None
    trace: str | None = None
    max_requests: int | None = None
    duration: float | None = None
    timeout_s: float = 600.0
    slos: list[SLO] = field(default_factory=list)
    attainment_target: float = 0.9
    progress: bool = True


@dataclass
class RunResult:
    """One run at one offered load."""

    rate: float | None
    concurrency: int | None
    records: list[RequestRecord]
    summary: Summary


def _progress(enabled: bool, total: int | None, label: str) -> tuple[AbstractContextManager[object], Callable[[], None]]:
    """A rich progress bar on stderr (or nothing) and the function that advances it by one request."""
    if not enabled:
        return nullcontext(), lambda: None
    bar = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=False)
    task = bar.add_task(label, total=total)
    return bar, lambda: bar.advance(task)


def _http(cfg: LoadConfig) -> httpx.AsyncClient:
    # No pool cap: an open-loop client must never queue requests itself, or it hides server queueing.
    return httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=30.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))


async def _open_loop(http: httpx.AsyncClient, cfg: LoadConfig, schedule: list[tuple[float, RequestSpec]],
                     tick: Callable[[], None]) -> tuple[list[RequestRecord], float]:
    """Sends each spec at its arrival offset (capped at `cfg.concurrency` in flight when set); returns
    the records in send order and the duration: from the first send to the last completion, and at
    least `cfg.duration` (a quiet end of the window still belongs to the offered load)."""
    sem = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
    t0 = time.perf_counter()

    async def one(at: float, spec: RequestSpec) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        async with sem or nullcontext():
            rec = await send(http, cfg.target, spec, t0)
        tick()
        return rec

    records = await asyncio.gather(*(one(at, spec) for at, spec in schedule))
    return list(records), max(time.perf_counter() - t0, cfg.duration or 0.0)


async def _closed_loop(http: httpx.AsyncClient, cfg: LoadConfig, spec_of: Callable[[int], RequestSpec],
                       tick: Callable[[], None]) -> tuple[list[RequestRecord], float]:
    """`cfg.concurrency` clients, each sending its next request when the last one finishes, until
    `max_requests` were sent or `duration` passed; returns the records and the run's duration."""
    t0 = time.perf_counter()
    records: list[RequestRecord] = []
    counter = iter(range(cfg.max_requests if cfg.max_requests is not None else 2**62))

    async def client() -> None:
        for i in counter:  # a shared iterator: each index goes to exactly one client
            if cfg.duration is not None and time.perf_counter() - t0 >= cfg.duration:
                return
            records.append(await send(http, cfg.target, spec_of(i), t0))
            tick()

    await asyncio.gather(*(client() for _ in range(cfg.concurrency or 1)))
    records.sort(key=lambda r: r.start_s)
    return records, time.perf_counter() - t0


def schedule_for(cfg: LoadConfig, workload: Workload, rate: float | None, first_index: int = 0,
                 ) -> list[tuple[float, RequestSpec]] | None:
    """The open-loop schedule (arrival offset, request) of a trace or a rate; None for a closed loop."""
    if cfg.trace is not None:
        entries = read_trace(cfg.trace)
        pairs = [(e.arrival_s, workload.from_trace(i, e)) for i, e in enumerate(entries)]
        if cfg.duration is not None:
            pairs = [p for p in pairs if p[0] < cfg.duration]
        return pairs[: cfg.max_requests] if cfg.max_requests is not None else pairs
    if rate is None:
        return None
    n = cfg.max_requests if cfg.max_requests is not None or cfg.duration is not None else 100
    arrivals = poisson_arrivals(rate, random.Random(f"{cfg.workload.seed}-arrivals-{first_index}"), n,
                                cfg.duration)
    return [(at, workload.spec(first_index + i)) for i, at in enumerate(arrivals)]


async def run_async(cfg: LoadConfig, rate: float | None = None, first_index: int = 0,
                    specs: list[RequestSpec] | None = None) -> RunResult:
    """One run at `rate` (else the config's): sends, waits for every request, summarizes. `specs`
    replaces the synthetic workload (all sent at once, capped by the concurrency). Resolves the model
    from `/v1/models` when the target names none (sets `cfg.target.model`)."""
    rate = cfg.rate if rate is None else rate
    workload = Workload(cfg.workload)
    async with _http(cfg) as http:
        if not cfg.target.model:
            cfg.target.model = await first_model(http, cfg.target.base_url, cfg.target.api_key)
        if specs is not None:
            schedule: list[tuple[float, RequestSpec]] | None = [(0.0, s) for s in specs]
        else:
            schedule = schedule_for(cfg, workload, rate, first_index)
        total = len(schedule) if schedule is not None else cfg.max_requests
        label = f"{rate:g} req/s" if rate is not None else f"concurrency {cfg.concurrency}"
        bar, tick = _progress(cfg.progress, total, "trace" if cfg.trace else label)
        with bar:
            if schedule is not None:
                records, duration = await _open_loop(http, cfg, schedule, tick)
            else:
                records, duration = await _closed_loop(http, cfg, lambda i: workload.spec(first_index + i), tick)
    summary = summarize(records, duration, cfg.slos, cfg.attainment_target)
    return RunResult(rate, cfg.concurrency, records, summary)


def run(cfg: LoadConfig, specs: list[RequestSpec] | None = None) -> RunResult:
    """`run_async` from synchronous code."""
    return asyncio.run(run_async(cfg, specs=specs))


def next_auto_rate(history: list[tuple[float, bool]], start: float) -> float | None:
    """The next rate of an automatic sweep given (rate, met target) so far, or None to stop: double
    while the target is met, then bisect until the bracket is within 20%; halve while nothing meets it."""
    if not history:
        return start
    if len(history) >= AUTO_SWEEP_MAX_STEPS:
        return None
    good = [r for r, ok in history if ok]
    bad = [r for r, ok in history if not ok]
    if not bad:
        return max(good) * 2
    if not good:
        return min(bad) / 2 if len(history) < 4 else None
    lo, hi = max(good), min(bad)
    return None if hi <= lo * 1.2 else (lo + hi) / 2


def sweep(cfg: LoadConfig, rates: Iterable[float] | None, start: float = 1.0) -> list[RunResult]:
    """Runs each rate of `rates` in ascending order (or an automatic sweep from `start` when None),
    each for `cfg.duration` s, stopping after the first rate that misses the attainment target.
    Each step sends fresh prompts (no prefix-cache hits from the previous one)."""
    results: list[RunResult] = []
    history: list[tuple[float, bool]] = []
    fixed = sorted(rates) if rates is not None else None
    while True:
        if fixed is not None:
            if len(results) == len(fixed) or (results and not results[-1].summary.meets_target):
                return results
            rate: float | None = fixed[len(results)]
        else:
            rate = next_auto_rate(history, start)
            if rate is None:
                return sorted(results, key=lambda r: r.rate or 0.0)
        result = asyncio.run(run_async(cfg, rate=rate, first_index=SWEEP_STEP_OFFSET * (len(results) + 1)))
        results.append(result)
        history.append((rate, result.summary.meets_target))


def best_rate(results: list[RunResult]) -> float | None:
    """The highest swept rate that met the attainment target, or None."""
    good = [r.rate for r in results if r.summary.meets_target and r.rate is not None]
    return max(good) if good else None
