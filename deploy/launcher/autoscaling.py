"""`pdserve up --autoscale`: the planner's controller (planner/autoscale.py) acting on the launcher's own
node processes. It reads the frontend's /metrics, and starts nodes (new slots, supervised like the others)
or drains them (SIGTERM: the node leaves the registry, finishes or hands over its requests, exits; the
slot is then removed) within the node budget. Its own series are on /metrics at a port of its own, listed
in the Prometheus targets as pool `autoscaler`."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import start_http_server

from pdserve.planner.autoscale import AutoscaleConfig, Controller, ControllerMetrics
from pdserve.planner.check import ScrapeSource
from pdserve.planner.loadgen.metrics import parse_slos
from pdserve.planner.profile_model import load_profile_here
from pdserve.planner.sim import NodeSettings, Shape, load_overheads

if TYPE_CHECKING:
    from pdserve.deploy.launcher.supervisor import Launcher


@dataclass(frozen=True)
class AutoscaleOptions:
    """`pdserve up --autoscale`'s flags, checked before anything starts."""

    profile: Path
    slo: str
    node_budget: int
    attainment: float = 0.9
    interval_s: float = 5.0
    window_s: float = 60.0
    cooldown_s: float = 60.0
    band: float = 0.2
    allow_other_machine: bool = False
    overheads: Path | None = None  # --autoscale-overheads

    def controller_config(self, colocated: bool, prefill_tp: int = 1, decode_tp: int = 1) -> AutoscaleConfig:
        """The controller's configuration for pools of these TP widths (loads the profile and the overheads:
        ValueError / OSError)."""
        profile = load_profile_here(self.profile, self.allow_other_machine)
        return AutoscaleConfig(profile, parse_slos(self.slo), self.node_budget, colocated, self.attainment,
                               self.interval_s, self.window_s, self.cooldown_s, self.band,
                               settings=NodeSettings.of(profile), prefill_tp=1 if colocated else prefill_tp,
                               decode_tp=decode_tp,
                               overheads=load_overheads(self.overheads) if self.overheads else None)


class LauncherActuator:
    """The controller's hands on a Launcher: the shape is its node slots that are not draining; a change
    is handed to the launcher's supervising thread, which starts and drains the processes."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher

    def shape(self) -> Shape:
        with self.launcher.lock:
            live = [s for s in self.launcher.slots if s.pool in ("prefill", "decode") and not s.retiring]
            return Shape(sum(s.pool == "prefill" for s in live), sum(s.pool == "decode" for s in live))

    def busy(self) -> str | None:
        with self.launcher.lock:
            if self.launcher.wanted_shape is not None:
                return f"{self.launcher.wanted_shape.label} asked, not yet started"
            for s in self.launcher.slots:
                if s.pool in ("prefill", "decode") and s.retiring and s.proc is not None:
                    return f"{s.name} is draining"
                if s.pool in ("prefill", "decode") and not s.ready:
                    return f"{s.name} is starting"
        return None

    def apply(self, target: Shape) -> None:
        with self.launcher.lock:
            self.launcher.wanted_shape = target


class Autoscaler:
    """The controller's thread and metrics server inside `pdserve up`."""

    def __init__(self, launcher: Launcher, options: AutoscaleOptions, metrics_port: int) -> None:
        cfg = launcher.config
        self.config = options.controller_config(cfg.num_prefill == 0, cfg.prefill_tp, cfg.decode_tp)
        self.metrics = ControllerMetrics()
        self.source = ScrapeSource([f"{cfg.base_url}/metrics"], [], self.config.window_s,
                                   timeout_s=min(3.0, self.config.interval_s * 2))
        self.controller = Controller(self.config, self.source, LauncherActuator(launcher), self.metrics,
                                     say=lambda line: launcher.console.print(line, markup=False))
        self.metrics_port = metrics_port
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._server = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, host: str) -> None:
        self._server, _ = start_http_server(self.metrics_port, addr=host, registry=self.metrics.registry)
        self._thread = threading.Thread(target=self.controller.run, args=(self._stop,), daemon=True,
                                        name="autoscaler")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
