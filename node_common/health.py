"""Health from progress, not liveness: a node whose engine keeps failing its steps, or whose step has run
for too long (hung), is no use to anyone however well its gRPC server answers. `HealthWatch` reads the
engine's progress (`AsyncEngine.progress`) a few times a second; once `--max-step-failures` steps have
failed in a row or one step has run for `--step-stall-timeout` seconds (or STALL_FACTOR times the longest a
full step was seen to need, when that is longer), `node_common.runtime` turns the node's
service NOT_SERVING, revokes its lease (routers stop sending work; peers drop what they share with it),
hands its requests over (a decode node's streams end with finish reason HAND_OVER, which the frontend
resumes on another node; a prefill node's calls end, which decode nodes answer by prefilling elsewhere)
and exits with `EXIT_UNHEALTHY` for the launcher or Kubernetes to restart it. It does not wait for a hung
engine thread: the process exit is what frees it.

Series: `pdserve_node_step_failures_total`, `pdserve_node_step_running_seconds` (the running step's age,
0 between steps), `pdserve_node_healthy` (1, or 0 once judged unhealthy).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.engine.async_engine import AsyncEngine
from pdserve.node_common.metrics import LABEL_NAMES, MetricLabels

_POLL_S = 0.2
# A step is hung only past this many times the longest a full step of the node was seen to need: the
# fixed timeout suits a small model, while an 8B model's 2,048-token prefill step takes minutes on 2 cores.
STALL_FACTOR = 4


class HealthWatch:
    """Judges a node's engine by its progress (reads only; `healthy` turns False once, for good)."""

    def __init__(self, engine: AsyncEngine, max_step_failures: int, stall_timeout_s: float) -> None:
        assert max_step_failures >= 1 and stall_timeout_s > 0
        self.engine = engine
        self.max_step_failures = max_step_failures
        self.stall_timeout_s = stall_timeout_s
        self.healthy = True

    def verdict(self) -> str | None:
        """Why the node can no longer serve, or None while it can."""
        p = self.engine.progress()
        if p.lost is not None:
            return p.lost
        if p.consecutive_failures >= self.max_step_failures:
            return f"{p.consecutive_failures} engine steps failed in a row"
        limit = max(self.stall_timeout_s, STALL_FACTOR * p.full_step_s)
        if p.step_running_s >= limit:
            return (f"an engine step has run for {p.step_running_s:.1f}s (stall timeout {limit:g}s: "
                    f"--step-stall-timeout {self.stall_timeout_s:g}s, or {STALL_FACTOR}x the {p.full_step_s:.1f}s "
                    "a full step was seen to need)")
        return None

    async def wait_unhealthy(self) -> str:
        """Returns the verdict once there is one (and marks the node unhealthy)."""
        while (why := self.verdict()) is None:
            await asyncio.sleep(_POLL_S)
        self.healthy = False
        return why


class HealthCollector(Collector):
    """The health series, read from the engine at each scrape."""

    def __init__(self, labels: MetricLabels, watch: HealthWatch) -> None:
        self._labels, self._watch = labels, watch

    def collect(self) -> Iterator[Metric]:
        names, values = list(LABEL_NAMES), list(self._labels.values().values())
        progress = self._watch.engine.progress()
        failures = CounterMetricFamily("pdserve_node_step_failures", "Engine steps that raised", labels=names)
        failures.add_metric(values, progress.step_failures)
        running = GaugeMetricFamily("pdserve_node_step_running_seconds",
                                    "Age of the engine step in progress (0 between steps)", labels=names)
        running.add_metric(values, progress.step_running_s)
        healthy = GaugeMetricFamily("pdserve_node_healthy",
                                    "1 while the engine makes progress, 0 once the node is judged unhealthy",
                                    labels=names)
        healthy.add_metric(values, 1.0 if self._watch.healthy else 0.0)
        yield from (failures, running, healthy)
