"""The autoscaling controller behind `pdserve autoscale` and `pdserve up --autoscale`.

Every `interval_s` it reads the live traffic (the inputs of `pdserve plan --check`: the frontends'
request and token counters over a sliding `window_s`, or Prometheus), asks the planner's simulator which
shape of at most `node_budget` nodes meets the SLOs at that rate, and hands the chosen shape to an
`Actuator`: `pdserve up` starts and drains local node processes (deploy/launcher/autoscaling.py); for
Kubernetes the shape is exported as `pdserve_autoscale_desired_replicas{pool}` for KEDA or an HPA to act on.

Decisions are damped (`damp`, a pure function):
- scale up (or reshape) only when the current shape does not meet the SLOs at the observed rate;
- scale down only when the smaller shape meets them at the rate raised by the hysteresis `band`, and one
  node at a time;
- at most one change per `cooldown_s`, and none while the last one is still starting or draining;
- with no metrics (the source unreachable, its counters unreadable) the shape is kept and the controller
  says so (log, `pdserve_autoscale_metrics_up` 0).
The shape keeps its kind: colocated nodes (prefill 0) stay colocated, a disaggregated shape keeps at least
one prefill node (changing kind restarts every decode node, which the controller does not do). It keeps
its pools' TP widths too (`prefill_tp`, `decode_tp`: what the nodes were started with; only the node
counts change), and the budget counts ranks (`Shape.cores`: a TP-w node takes w; at TP 1, nodes).
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.planner.check import Observed, PrometheusSource, ScrapeSource
from pdserve.planner.loadgen.metrics import SLO
from pdserve.planner.plan import shapes
from pdserve.planner.profile_model import Profile
from pdserve.planner.sim import NodeSettings, Overheads, Shape, load_overheads, simulate
from pdserve.planner.traffic import Traffic

log = logging.getLogger("pdserve.autoscale")

ACTIONS = ("scale_up", "scale_down", "reshape", "hold")
POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class AutoscaleConfig:
    """What the controller aims at and how it is damped."""

    profile: Profile
    slos: list[SLO]
    node_budget: int
    colocated: bool = False  # the shape's kind, kept (see the module docstring)
    attainment: float = 0.9
    interval_s: float = 5.0  # between observations
    window_s: float = 60.0  # traffic averaged over this much of the past
    cooldown_s: float = 60.0  # at least this long between two changes
    band: float = 0.2  # scale down only when the smaller shape fits at rate * (1 + band)
    requests: int = 200  # simulated requests per candidate shape
    settings: NodeSettings | None = None
    seed: int = 0
    prefill_tp: int = 1  # the pools' TP widths, kept (see the module docstring)
    decode_tp: int = 1
    # costs beyond the profile's engine steps (`pdserve plan --overheads`): without them a small machine's
    # frontend and node CPU are left out and the model's rates can be several times what the cluster serves
    overheads: Overheads | None = None

    def __post_init__(self) -> None:
        smallest = (Shape(0, 1) if self.colocated else Shape(1, 1)).with_tp(self.prefill_tp, self.decode_tp)
        checks = [
            (self.node_budget >= smallest.cores,
             f"--node-budget must be >= {smallest.cores} (the smallest shape of this kind, {smallest.label}, "
             f"in ranks)"),
            (0 < self.attainment <= 1, "--attainment must be in (0, 1]"),
            (self.interval_s > 0, "--interval must be > 0"),
            (self.window_s >= self.interval_s, "--window must be >= --interval"),
            (self.cooldown_s >= 0, "--cooldown must be >= 0"),
            (0 <= self.band < 10, "--band must be in [0, 10)"),
            (self.requests >= 10, "--requests must be >= 10"),
            (bool(self.slos), "give --slo: the controller needs something to meet"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"autoscale: {msg}")

    @property
    def minimum(self) -> Shape:
        return self.widths(Shape(0, 1) if self.colocated else Shape(1, 1))

    def widths(self, shape: Shape) -> Shape:
        """`shape`'s node counts at the pools' TP widths (a shape counted from the nodes has no widths)."""
        return shape.with_tp(self.prefill_tp, self.decode_tp)

    def candidates(self) -> list[Shape]:
        """The shapes of this kind within the budget (in ranks), fewest ranks first."""
        out = [self.widths(s) for s in shapes(self.node_budget) if (s.prefill == 0) == self.colocated]
        return sorted((s for s in out if s.cores <= self.node_budget), key=lambda s: (s.cores, s.nodes, s.prefill))


@dataclass(frozen=True)
class Proposal:
    """What the planner says about one observation."""

    rate: float
    current_fits: bool
    current_attainment: float
    target: Shape  # the cheapest fitting shape; when none fits, the one with the best attainment
    target_fits: bool
    target_attainment: float
    margin_fits: bool  # the target also fits at rate * (1 + band) (checked when it is smaller than current)
    idle: bool = False  # no request finished in the window


@dataclass(frozen=True)
class Decision:
    action: str  # one of ACTIONS
    target: Shape  # the shape to run (the current one for a hold)
    reason: str

    def __post_init__(self) -> None:
        assert self.action in ACTIONS, self.action


def step_down(current: Shape, target: Shape) -> Shape:
    """One node fewer than `current`, toward `target` (the pool furthest above its target first)."""
    dp, dd = current.prefill - target.prefill, current.decode - target.decode
    assert dp > 0 or dd > 0, (current, target)
    return Shape(current.prefill - 1, current.decode) if dp > dd else Shape(current.prefill, current.decode - 1)


def damp(current: Shape, proposal: Proposal, now: float, last_change: float, cooldown_s: float,
         busy: str | None = None) -> Decision:
    """The damped decision for one proposal (see the module docstring): `last_change` is when the last
    change was made (or the controller started), `busy` what is still starting or draining."""
    p = proposal
    at = f"{p.rate:.3g} req/s"
    if busy:
        return Decision("hold", current, f"{busy}: waiting before another change")
    if p.current_fits and (p.target.cores >= current.cores or p.target == current):
        return Decision("hold", current, f"{current.label} meets the SLOs at {at} "
                                         f"(attainment {100 * p.current_attainment:.0f}% predicted)")
    if p.target == current:
        return Decision("hold", current, f"{current.label} misses the SLOs at {at} "
                                         f"(attainment {100 * p.current_attainment:.0f}%) but no shape within "
                                         f"the budget does better")
    wait = last_change + cooldown_s - now
    if p.target.cores < current.cores:
        if not p.margin_fits:
            return Decision("hold", current, f"{p.target.label} would meet the SLOs at {at} but not with the "
                                             f"hysteresis margin: keeping {current.label}")
        nxt = step_down(current, p.target)
        why = ("no request finished in the window" if p.idle
               else f"{p.target.label} meets the SLOs at {at} with the margin "
                    f"(attainment {100 * p.target_attainment:.0f}% predicted)")
        if wait > 0:
            return Decision("hold", current, f"{why}; cooldown: {wait:.0f} s before scaling down to {nxt.label}")
        return Decision("scale_down", nxt, why)
    grow = p.target.cores > current.cores
    action = "scale_up" if grow else "reshape"
    fit = (f"meets them (attainment {100 * p.target_attainment:.0f}% predicted)" if p.target_fits
           else f"comes closest (attainment {100 * p.target_attainment:.0f}% predicted; none within the budget fits)")
    why = (f"{current.label} misses the SLOs at {at} (attainment {100 * p.current_attainment:.0f}% predicted); "
           f"{p.target.label} {fit}")
    if wait > 0:
        return Decision("hold", current, f"{why}; cooldown: {wait:.0f} s before the change")
    return Decision(action, p.target, why)


def propose(cfg: AutoscaleConfig, obs: Observed, current: Shape) -> Proposal:
    """Simulates the candidate shapes (and the current one) at the observed traffic."""
    if obs.requests < 1 or obs.rate <= 0:
        return Proposal(0.0, True, 1.0, cfg.minimum, True, 1.0, True, idle=True)
    traffic = Traffic.parse(str(max(1, round(obs.mean_prompt))), str(max(1, round(obs.mean_output))), 0, cfg.seed)
    reqs = traffic.requests(obs.rate, cfg.requests)

    def run(shape: Shape, rate: float) -> tuple[bool, float]:
        sample = reqs if rate == obs.rate else traffic.requests(rate, cfg.requests)
        s = simulate(cfg.profile, shape, sample, cfg.slos, cfg.attainment, cfg.settings, rate, cfg.overheads).summary
        return s.meets_target, s.attainment

    results: dict[Shape, tuple[bool, float]] = {}
    fitting_cores: int | None = None  # ranks: at TP 1, nodes
    for shape in cfg.candidates():
        if fitting_cores is not None and shape.cores > fitting_cores:
            break  # the cheapest fitting count is found; its equals were simulated too
        results[shape] = run(shape, obs.rate)
        if results[shape][0] and fitting_cores is None:
            fitting_cores = shape.cores
    cur = results.get(current) or run(current, obs.rate)
    fitting = [s for s, (ok, _) in results.items() if ok]
    if fitting:  # the fewest nodes; among equals the best attainment, then the current shape
        target = min(fitting, key=lambda s: (s.cores, -results[s][1], s != current))
    else:
        target = max(results, key=lambda s: (results[s][1], -s.cores, s == current))
    ok, att = results[target]
    margin = ok
    if target.cores < current.cores and ok:
        margin = run(target, obs.rate * (1 + cfg.band))[0]
    return Proposal(obs.rate, cur[0], cur[1], target, ok, att, margin)


class MetricsSource(Protocol):
    """The live traffic (and, where it knows it, the current shape). `observe` raises OSError or
    ValueError when the source cannot be read."""

    def observe(self) -> Observed: ...


class Actuator(Protocol):
    """What runs the shape: `shape()` the nodes serving or starting, `busy()` a change still under way
    (None when none), `apply(target)` starts and drains nodes toward `target`."""

    def shape(self) -> Shape | None: ...

    def busy(self) -> str | None: ...

    def apply(self, target: Shape) -> None: ...


class ExportActuator:
    """Kubernetes: the controller's decisions are only exported (`pdserve_autoscale_desired_replicas`);
    KEDA or an HPA scales the Deployments, and the current shape is what the metrics source shows."""

    def __init__(self) -> None:
        self.observed: Shape | None = None
        self.desired: Shape | None = None

    def shape(self) -> Shape | None:
        return self.desired or self.observed

    def busy(self) -> str | None:
        if self.desired is not None and self.observed is not None and self.observed != self.desired:
            return f"the cluster runs {self.observed.label}, {self.desired.label} asked"
        return None

    def apply(self, target: Shape) -> None:
        self.desired = target


@dataclass
class ControllerMetrics:
    """The controller's own series (deploy/prometheus/README.md's catalogue)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.desired = Gauge("pdserve_autoscale_desired_replicas", "Nodes per pool the autoscaler wants",
                             ["pool"], registry=r)
        self.current = Gauge("pdserve_autoscale_current_replicas", "Nodes per pool the autoscaler sees running "
                             "or starting", ["pool"], registry=r)
        self.decisions = Counter("pdserve_autoscale_decisions", "Autoscaler decisions by action", ["action"],
                                 registry=r)
        self.metrics_up = Gauge("pdserve_autoscale_metrics_up", "1 while the autoscaler reads its metrics "
                                "source, 0 while it cannot (it then keeps the shape)", registry=r)
        self.rate = Gauge("pdserve_autoscale_observed_request_rate", "Finished requests per second over the "
                          "autoscaler's window", registry=r)
        for a in ACTIONS:
            self.decisions.labels(action=a)


class Controller:
    """One control loop: `tick()` observes, decides and acts once; `run(stop)` ticks every interval."""

    def __init__(self, cfg: AutoscaleConfig, source: MetricsSource, actuator: Actuator,
                 metrics: ControllerMetrics | None = None, say: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.source, self.actuator = cfg, source, actuator
        self.metrics = metrics or ControllerMetrics()
        self.say = say or log.warning
        self.clock = clock
        self.last_change = clock()  # no change in the first cooldown after start
        self.metrics_up: bool | None = None
        self.last_reason = ""
        self.decisions: list[Decision] = []

    def _publish(self, current: Shape | None, desired: Shape | None) -> None:
        for pool in POOLS:
            if current is not None:
                self.metrics.current.labels(pool=pool).set(getattr(current, pool))
            if desired is not None:
                self.metrics.desired.labels(pool=pool).set(getattr(desired, pool))

    def tick(self) -> Decision | None:
        """One observation and decision; None while the first window is still filling."""
        try:
            obs = self.source.observe()
        except (OSError, ValueError) as err:
            return self._lost(err)
        if self.metrics_up is False:
            self.say("autoscale: metrics source back: deciding again")
        self.metrics_up = True
        self.metrics.metrics_up.set(1)
        self.metrics.rate.set(obs.rate)
        observed = None if obs.shape is None else self.cfg.widths(obs.shape)
        if isinstance(self.actuator, ExportActuator):
            self.actuator.observed = observed
        current = self.actuator.shape()
        if current is None:
            current = observed
        if current is None:
            return self._hold_reason(None, "current shape unknown (give each node's /metrics)")
        current = self.cfg.widths(current)  # the actuator counts nodes; the pools' widths are fixed
        if not getattr(self.source, "warm", True):
            self._publish(current, current)
            return None
        proposal = propose(self.cfg, obs, current)
        decision = damp(current, proposal, self.clock(), self.last_change, self.cfg.cooldown_s,
                        self.actuator.busy())
        return self._act(current, decision)

    def _lost(self, err: Exception) -> Decision:
        current = self.actuator.shape()
        label = current.label if current is not None else "the current shape"
        self.metrics.metrics_up.set(0)
        if self.metrics_up is not False:
            self.say(f"autoscale: metrics source lost ({type(err).__name__}: {err}): keeping {label}")
        self.metrics_up = False
        d = Decision("hold", current or self.cfg.minimum, f"metrics source lost: keeping {label}")
        self.metrics.decisions.labels(action="hold").inc()
        self.decisions.append(d)
        return d

    def _hold_reason(self, current: Shape | None, reason: str) -> Decision:
        return self._act(current, Decision("hold", current or self.cfg.minimum, reason))

    def _say_hold(self, reason: str) -> None:
        """A hold is logged when its reason changes (not when only its figures do: each tick has new ones)."""
        key = re.sub(r"[0-9.]+", "#", reason)
        if key != re.sub(r"[0-9.]+", "#", self.last_reason):
            self.say(f"autoscale: hold: {reason}")
        self.last_reason = reason

    def _act(self, current: Shape | None, d: Decision) -> Decision:
        self.metrics.decisions.labels(action=d.action).inc()
        self.decisions.append(d)
        if d.action == "hold":
            self._publish(current, self.actuator.shape() or current)
            self._say_hold(d.reason)
            return d
        assert current is not None
        self.say(f"autoscale: {d.action}: {current.label} -> {d.target.label}: {d.reason}")
        self.last_reason = d.reason
        self.last_change = self.clock()
        self.actuator.apply(d.target)
        self._publish(self.actuator.shape() or d.target, d.target)
        return d

    def run(self, stop: threading.Event) -> None:
        """Ticks every `interval_s` until `stop` is set; a failing tick is logged, never fatal."""
        while not stop.is_set():
            started = self.clock()
            try:
                self.tick()
            except Exception as err:  # one bad tick (a simulation error) must not stop the loop
                log.exception("autoscale: tick failed")
                self.say(f"autoscale: tick failed: {type(err).__name__}: {err}")
            stop.wait(max(0.0, self.cfg.interval_s - (self.clock() - started)))


def main(args: argparse.Namespace) -> int:
    """`pdserve autoscale`: the controller with an ExportActuator, its series on --metrics-port, until
    SIGINT/SIGTERM (or one decision with --once)."""
    from prometheus_client import start_http_server

    from pdserve.planner.loadgen.metrics import parse_slos
    from pdserve.planner.profile_model import load_profile_here

    if bool(args.metrics_url) == bool(args.prometheus):
        raise ValueError("give each frontend's --metrics-url, or --prometheus URL (one of them)")
    if args.metrics_url and not args.node_metrics_url:
        raise ValueError("give each node's --node-metrics-url too: the controller needs the current shape")
    profile = load_profile_here(args.profile, args.allow_other_machine)
    cfg = AutoscaleConfig(profile, parse_slos(args.slo), args.node_budget, args.colocated, args.attainment,
                          args.interval, args.window, args.cooldown, args.band, settings=NodeSettings.of(profile),
                          prefill_tp=getattr(args, "prefill_tp", 1), decode_tp=getattr(args, "decode_tp", 1),
                          overheads=load_overheads(args.overheads) if getattr(args, "overheads", None) else None)
    source: MetricsSource = (PrometheusSource(args.prometheus, cfg.window_s) if args.prometheus
                             else ScrapeSource(args.metrics_url, args.node_metrics_url, cfg.window_s))
    metrics = ControllerMetrics()
    controller = Controller(cfg, source, ExportActuator(), metrics, say=lambda line: print(line, flush=True))
    if args.metrics_port:
        server, _ = start_http_server(args.metrics_port, addr=args.metrics_host, registry=metrics.registry)
        print(f"autoscale: metrics on http://{args.metrics_host}:{server.server_port}/metrics", flush=True)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if args.once:
            while not stop.is_set():
                decision = controller.tick()
                if decision is not None:
                    print(f"{decision.action}: {decision.target.label}: {decision.reason}")
                    return 0
                stop.wait(cfg.interval_s)
            return 130
        controller.run(stop)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
