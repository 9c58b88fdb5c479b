"""The shape search behind `pdserve plan`: which P:D (or colocated C) shapes up to a budget meet the SLOs
for a traffic, at a target rate or at the highest rate each shape sustains; the recommendation and the
Kubernetes values file for it.

The budget counts ranks (cores, or GPUs): a node of TP width w runs w of them (`Shape.cores`), so at TP 1
it is the node count. With `tp_widths` (e.g. (1, 2)) every pool may take each width the profile measured.

A shape *fits* at a rate when its simulated run meets the SLO attainment target with every SLO passing
(`planner.loadgen.metrics.Summary.meets_target`, the definition `pdserve bench` judges a real run by). The
cheapest shape is the one with the fewest ranks that fits (at TP 1: the fewest nodes); among equals, the
one with the higher goodput.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdserve.planner.loadgen.metrics import SLO
from pdserve.planner.profile_model import Profile
from pdserve.planner.sim import NodeSettings, Overheads, Shape, SimRequest, SimResult, simulate
from pdserve.planner.traffic import Traffic

# How finely the sweep brackets a shape's highest rate: it stops when hi / lo is within this factor.
SWEEP_RESOLUTION = 1.05


@dataclass
class PlanConfig:
    """One `pdserve plan` question. Exactly one of `traffic` (synthetic) and `trace` (replayed requests,
    their arrivals rescaled to each simulated rate) is given."""

    profile: Profile
    slos: list[SLO]
    attainment: float = 0.9
    max_nodes: int = 8
    rate: float | None = None
    sweep: bool = False
    traffic: Traffic | None = None
    trace: list[SimRequest] | None = None
    requests: int = 400
    settings: NodeSettings | None = None
    overheads: Overheads | None = None  # costs beyond the profile's engine steps (none by default)
    tp_widths: tuple[int, ...] | None = None  # the TP widths a pool may take (None: the profile's own, `tp`)

    def __post_init__(self) -> None:
        if (self.traffic is None) == (self.trace is None):
            raise ValueError("give a workload or a trace, not both")
        if self.max_nodes < 1:
            raise ValueError("--max-nodes must be >= 1")
        self.tp_widths = tuple(sorted(set(self.tp_widths or (self.profile.tp,))))
        for w in self.tp_widths:
            self.profile.at_tp(w)  # ValueError naming the widths the profile has
        if not 0 < self.attainment <= 1:
            raise ValueError("--attainment must be in (0, 1]")
        if self.rate is not None and not 0 < self.rate < math.inf:
            raise ValueError("--rate must be positive and finite")
        if self.rate is None and not self.sweep and self.trace is None:
            raise ValueError("give --rate R (the traffic to plan for) or --sweep")
        if self.requests < 10:
            raise ValueError("--requests must be >= 10")
        if not self.slos:
            raise ValueError("give --slo (e.g. ttft_p90=1s,tpot_p99=50ms): a plan needs something to meet")

    @property
    def trace_rate(self) -> float | None:
        """A trace's own mean arrival rate (req/s)."""
        if not self.trace:
            return None
        span = self.trace[-1].arrival_s - self.trace[0].arrival_s
        return (len(self.trace) - 1) / span if span > 0 else math.inf

    @property
    def target_rate(self) -> float | None:
        """The rate to fit: --rate, else a trace's own rate; None for a pure sweep."""
        return self.rate if self.rate is not None else (None if self.sweep else self.trace_rate)


@dataclass
class ShapeResult:
    """One shape: its run at the target rate, and (sweeping) the highest rate it fits at."""

    shape: Shape
    at_rate: SimResult | None = None
    max_rate: float | None = None  # sweep: highest rate found that fits (None: not even the lowest)
    at_max: SimResult | None = None
    curve: list[SimResult] = field(default_factory=list)  # every run, by rate

    @property
    def fits(self) -> bool:
        if self.at_rate is not None:
            return self.at_rate.summary.meets_target
        return self.max_rate is not None

    @property
    def best(self) -> SimResult | None:
        """The run to report: at the target rate, else at the highest fitting rate."""
        return self.at_rate or self.at_max


@dataclass
class Plan:
    """The answer: every shape evaluated, and the recommended one (None when none fits)."""

    config: PlanConfig
    results: list[ShapeResult]
    recommended: ShapeResult | None

    def to_dict(self) -> dict[str, Any]:
        def run(r: SimResult | None) -> dict[str, Any] | None:
            if r is None:
                return None
            s = r.summary
            return {"rate": r.rate, "attainment": s.attainment, "meets_target": s.meets_target,
                    "goodput_rate": s.goodput_rate, "goodput_token_rate": s.goodput_token_rate,
                    "request_rate": s.request_rate, "output_token_rate": s.output_token_rate,
                    "latency": {k: {"p50": v.p50, "p90": v.p90, "p99": v.p99} for k, v in s.latency.items()},
                    "slos": [{"name": x.name, "threshold_s": x.threshold_s, "observed_s": x.observed_s,
                              "passed": x.passed} for x in s.slos]}

        def shape(s: Shape) -> dict[str, Any]:
            return {"shape": s.label, "prefill": s.prefill, "decode": s.decode, "prefill_tp": s.prefill_tp,
                    "decode_tp": s.decode_tp}

        rows = [{**shape(r.shape), "nodes": r.shape.nodes, "cores": r.shape.cores, "fits": r.fits,
                 "max_rate": r.max_rate, "run": run(r.best)} for r in self.results]
        rec = self.recommended
        return {"target_rate": self.config.target_rate, "attainment_target": self.config.attainment,
                "tp_widths": list(self.config.tp_widths or ()),
                "slos": [{"name": s.name, "threshold_s": s.threshold_s} for s in self.config.slos],
                "recommended": None if rec is None else {**shape(rec.shape), "run": run(rec.best)},
                "shapes": rows}


def shapes(max_nodes: int, tp_widths: tuple[int, ...] = (1,)) -> list[Shape]:
    """Every colocated C and disaggregated P:D shape of at most `max_nodes` ranks (`Shape.cores`: at TP 1
    the nodes), each pool at each of `tp_widths`; fewest ranks first, then fewest nodes."""
    widths = sorted(set(tp_widths))
    out = [Shape(0, n, 1, w) for w in widths for n in range(1, max_nodes // w + 1)]
    out += [Shape(p, d, pw, dw) for pw in widths for dw in widths
            for p in range(1, max_nodes // pw + 1) for d in range(1, (max_nodes - p * pw) // dw + 1)]
    return sorted(out, key=lambda s: (s.cores, s.nodes, s.prefill, s.prefill_tp, s.decode_tp))


class Planner:
    """Runs the simulations of one PlanConfig; `progress(done, total, label)` is told after each shape."""

    def __init__(self, cfg: PlanConfig, progress: Callable[[int, int, str], None] | None = None) -> None:
        self.cfg = cfg
        self.progress = progress or (lambda done, total, label: None)

    def requests_at(self, rate: float) -> list[SimRequest]:
        """The traffic at `rate` req/s: synthetic draws, or the trace with its arrivals rescaled."""
        cfg = self.cfg
        if cfg.traffic is not None:
            return cfg.traffic.requests(rate, cfg.requests)
        assert cfg.trace is not None and cfg.trace_rate is not None
        k = cfg.trace_rate / rate if math.isfinite(cfg.trace_rate) else 1.0
        t0 = cfg.trace[0].arrival_s
        return [SimRequest(r.index, (r.arrival_s - t0) * k, r.prompt_tokens, r.output_tokens) for r in cfg.trace]

    def simulate(self, shape: Shape, rate: float) -> SimResult:
        cfg = self.cfg
        return simulate(cfg.profile, shape, self.requests_at(rate), cfg.slos, cfg.attainment, cfg.settings, rate,
                        cfg.overheads)

    def run(self) -> Plan:
        """Every shape at the target rate (and swept, with --sweep); the recommendation."""
        cfg, all_shapes = self.cfg, shapes(self.cfg.max_nodes, self.cfg.tp_widths or (1,))
        results = []
        for i, shape in enumerate(all_shapes):
            res = ShapeResult(shape)
            target = cfg.target_rate
            if target is not None:
                res.at_rate = self.simulate(shape, target)
                res.curve.append(res.at_rate)
            if cfg.sweep:
                self._sweep(res)
            res.curve.sort(key=lambda r: r.rate or 0.0)
            results.append(res)
            self.progress(i + 1, len(all_shapes), shape.label)
        return Plan(cfg, results, self.recommend(results))

    def recommend(self, results: list[ShapeResult]) -> ShapeResult | None:
        """Fewest ranks (at TP 1: nodes) that fit the target rate (ties: higher goodput, then fewer nodes);
        sweeping without a target rate, the highest fitting rate per rank."""
        fitting = [r for r in results if r.fits]
        if not fitting:
            return None
        if self.cfg.target_rate is None:
            return max(fitting, key=lambda r: ((r.max_rate or 0.0) / r.shape.cores, -r.shape.cores, -r.shape.nodes))
        return min(fitting, key=lambda r: (r.shape.cores, -(r.best.summary.goodput_rate if r.best else 0.0),
                                           r.shape.nodes))

    def _sweep(self, res: ShapeResult) -> None:
        """Brackets the shape's highest fitting rate: doubling from a start rate, then bisection."""
        start = self.cfg.target_rate or self._start_rate()
        fits: dict[float, bool] = {}

        def probe(rate: float) -> bool:
            run = self.simulate(res.shape, rate)
            res.curve.append(run)
            fits[rate] = run.summary.meets_target
            if fits[rate] and (res.max_rate is None or rate > res.max_rate):
                res.max_rate, res.at_max = rate, run
            return fits[rate]

        lo, hi = None, None
        rate = start
        for _ in range(12):
            if probe(rate):
                lo, rate = rate, rate * 2
            else:
                hi, rate = rate, rate / 2
            if lo is not None and hi is not None:
                break
        if lo is None or hi is None:
            return
        while hi / lo > SWEEP_RESOLUTION:
            mid = math.sqrt(lo * hi)
            if probe(mid):
                lo = mid
            else:
                hi = mid

    def _start_rate(self) -> float:
        """A first guess at one node's capacity: a batch of decodes at the profile's cost, per request."""
        prof = self.cfg.profile
        sample = self.requests_at(1.0)
        out = sum(r.output_tokens for r in sample) / len(sample)
        prompt = sum(r.prompt_tokens for r in sample) / len(sample)
        batch = min(prof.engine.max_num_seqs, 32)
        step = prof.step_s(batch, int(batch * (prompt + out / 2)), 0, 0.0)
        per_request = out * step / batch + prof.prefill_s(int(prompt))
        return max(1.0 / max(per_request, 1e-6), 1e-3)


def values_document(shape: Shape, header: str) -> str:
    """A deploy/k8s values file that sets the pools' replica counts (prefill 0: colocated decode nodes) and,
    for a shape wider than TP 1, each pool's `tp`."""
    values: dict[str, dict[str, int]] = {"prefill": {"replicas": shape.prefill}, "decode": {"replicas": shape.decode}}
    if shape.tp:
        values["prefill"]["tp"], values["decode"]["tp"] = shape.prefill_tp, shape.decode_tp
    body = yaml.safe_dump(values, sort_keys=False)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + body


def write_values(path: str | Path, shape: Shape, header: str) -> Path:
    """Writes `values_document` to `path`; returns it."""
    out = Path(path)
    out.write_text(values_document(shape, header), encoding="utf-8")
    return out
