"""Renders a Grafana dashboard's panels to one PNG from a real Prometheus, with matplotlib.

For places without Grafana (and for the README's picture): every timeseries panel of the dashboard JSON
becomes one plot; each of its PromQL targets is run as a range query against Prometheus, with the
dashboard variables replaced (`--var model=...`; `cluster`, `model` and `node` default to `.*`;
`$__rate_interval` = `--rate-interval`), and every returned series is drawn with the panel's legend
format. Nothing is made up: a panel whose queries return nothing says "no data".

    python -m pdserve.deploy.metrics_render --prometheus http://127.0.0.1:9090 \\
        --dashboard deploy/grafana/pdserve.json --minutes 10 --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

# Grafana units -> (axis label, factor applied to the values)
_UNITS: dict[str, tuple[str, float]] = {
    "s": ("ms", 1000.0), "percentunit": ("%", 100.0), "Bps": ("MiB/s", 1.0 / 2**20), "reqps": ("req/s", 1.0),
    "short": ("", 1.0),
}


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str  # Grafana legend format: "{{label}}" placeholders


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    stacked: bool
    targets: tuple[Target, ...]
    row: str  # title of the row the panel sits in
    y_min: float | None = None  # the panel's axis bounds, in its unit
    y_max: float | None = None


@dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    times: list[float]  # unix seconds
    values: list[float]


@dataclass(frozen=True)
class RenderConfig:
    """One rendering; validated once."""

    prometheus: str  # base URL, e.g. http://127.0.0.1:9090
    dashboard: Path
    out: Path
    minutes: float = 15.0  # the time range, ending now (or at `end`)
    end: float | None = None  # unix seconds; None: now
    variables: Mapping[str, str] = field(default_factory=lambda: {"cluster": ".*", "model": ".*", "node": ".*"})
    rate_interval: str = "1m"
    columns: int = 2
    dpi: int = 72
    points: int = 240  # samples per series across the range

    def __post_init__(self) -> None:
        if not self.prometheus.startswith(("http://", "https://")):
            raise ValueError(f"--prometheus must be an http(s) URL, got {self.prometheus!r}")
        if not self.dashboard.is_file():
            raise ValueError(f"dashboard {self.dashboard} does not exist")
        if self.minutes <= 0 or self.columns < 1 or self.dpi < 20 or self.points < 2:
            raise ValueError("minutes must be > 0, columns >= 1, dpi >= 20, points >= 2")


@dataclass(frozen=True)
class RenderResult:
    out: Path
    panels: int
    empty: list[str]  # titles of panels whose queries returned no series


def load_panels(dashboard: Path) -> list[Panel]:
    """The dashboard's timeseries panels in layout order (rows flattened, collapsed ones included)."""
    data = json.loads(dashboard.read_text(encoding="utf-8"))
    panels: list[Panel] = []
    row = ""

    def add(p: dict[str, Any]) -> None:
        defaults = p.get("fieldConfig", {}).get("defaults", {})
        stacking = defaults.get("custom", {}).get("stacking", {}).get("mode", "none")
        targets = tuple(Target(t["expr"], t.get("legendFormat", "")) for t in p.get("targets", []) if t.get("expr"))
        panels.append(Panel(p.get("title", ""), defaults.get("unit", "short"), stacking == "normal", targets, row,
                            defaults.get("min"), defaults.get("max")))

    for p in data.get("panels", []):
        if p.get("type") == "row":
            row = p.get("title", "")
            for inner in p.get("panels", []):
                add(inner)
        else:
            add(p)
    return panels


def expand(expr: str, variables: Mapping[str, str], rate_interval: str) -> str:
    """Replaces Grafana's variables in a PromQL expression, the way Grafana would for these values."""
    out = expr.replace("$__rate_interval", rate_interval).replace("${__rate_interval}", rate_interval)
    for name in sorted(variables, key=len, reverse=True):
        out = out.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    return out


def legend(fmt: str, labels: Mapping[str, str]) -> str:
    if not fmt:
        return "{" + ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def _api(prometheus: str, path: str, params: Mapping[str, str | float]) -> Any:
    url = f"{prometheus.rstrip('/')}{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            body = json.loads(resp.read().decode())
    except urllib.error.HTTPError as err:
        try:
            body = json.loads(err.read().decode(errors="replace") or "{}")
        except json.JSONDecodeError:
            # not the API's JSON (a starting Prometheus answers 503 "Service Unavailable" in plain text):
            # the HTTP error itself, an OSError like a refused connection, which callers may retry
            raise err from None
    if body.get("status") != "success":
        raise ValueError(f"Prometheus refused {params.get('query')!r}: {body.get('error', body)}")
    return body["data"]


def query(prometheus: str, expr: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
    """An instant query: (labels, value) per series. Raises ValueError if Prometheus rejects it."""
    params: dict[str, str | float] = {"query": expr}
    if at is not None:
        params["time"] = at
    data = _api(prometheus, "/api/v1/query", params)
    if data["resultType"] == "scalar":
        return [({}, float(data["result"][1]))]
    return [(dict(r["metric"]), float(r["value"][1])) for r in data["result"]]


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[Series]:
    data = _api(prometheus, "/api/v1/query_range", {"query": expr, "start": start, "end": end, "step": step})
    return [Series(dict(r["metric"]), [float(t) for t, _ in r["values"]], [float(v) for _, v in r["values"]])
            for r in data["result"]]


def render(config: RenderConfig) -> RenderResult:
    """Queries every panel over the range and writes the PNG (matplotlib's Agg canvas, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.dates import DateFormatter
    from matplotlib.figure import Figure

    panels = [p for p in load_panels(config.dashboard) if p.targets]
    end = config.end if config.end is not None else time.time()
    start = end - 60 * config.minutes
    step = max(1.0, (end - start) / config.points)
    rows = math.ceil(len(panels) / config.columns)
    fig = Figure(figsize=(8 * config.columns, 3.1 * rows + 0.8), dpi=config.dpi)
    FigureCanvasAgg(fig)
    title = json.loads(config.dashboard.read_text(encoding="utf-8")).get("title", config.dashboard.stem)
    fig.suptitle(
        f"{title}: {datetime.fromtimestamp(start):%Y-%m-%d %H:%M:%S} to {datetime.fromtimestamp(end):%H:%M:%S}, "
        f"rendered from Prometheus ({', '.join(f'{k}={v}' for k, v in config.variables.items())})",
        fontsize=13,
    )
    empty: list[str] = []
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(rows, config.columns, i + 1)
        axis_label, factor = _UNITS.get(panel.unit, (panel.unit, 1.0))
        drawn = _draw(ax, panel, config, start, end, step, factor)
        ax.set_title(panel.title, fontsize=11, loc="left")
        ax.set_ylabel(axis_label, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_formatter(DateFormatter("%H:%M:%S" if config.minutes <= 15 else "%H:%M"))
        ax.set_xlim(datetime.fromtimestamp(start), datetime.fromtimestamp(end))
        if panel.y_min is not None:
            ax.set_ylim(bottom=panel.y_min * factor)
        if panel.y_max is not None:
            # A little headroom, so a series at the bound (100 %, up = 1) stays visible.
            ax.set_ylim(top=panel.y_max * factor * 1.05)
        if drawn:
            ax.legend(fontsize=7, loc="upper left", ncol=2 if drawn > 6 else 1, framealpha=0.6)
        else:
            empty.append(panel.title)
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / (3.1 * rows + 0.8)))
    config.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(config.out, format="png", dpi=config.dpi)
    return RenderResult(config.out, len(panels), empty)


def _draw(ax: Any, panel: Panel, config: RenderConfig, start: float, end: float, step: float, factor: float) -> int:
    """Plots every series of the panel's targets; returns how many were drawn."""
    curves: list[tuple[str, list[datetime], list[float]]] = []
    for target in panel.targets:
        expr = expand(target.expr, config.variables, config.rate_interval)
        for s in query_range(config.prometheus, expr, start, end, step):
            values = [v * factor if math.isfinite(v) else math.nan for v in s.values]
            curves.append((legend(target.legend, s.labels), [datetime.fromtimestamp(t) for t in s.times], values))
    if panel.stacked and curves:
        # A stack needs one time grid: Prometheus steps are aligned, so missing points are gaps (0 here).
        grid = sorted({t for _, times, _ in curves for t in times})
        index = {t: i for i, t in enumerate(grid)}
        stacks = []
        for _, times, values in curves:
            row = [0.0] * len(grid)
            for t, v in zip(times, values, strict=True):
                row[index[t]] = 0.0 if math.isnan(v) else v
            stacks.append(row)
        ax.stackplot(grid, stacks, labels=[name for name, _, _ in curves], alpha=0.8)
    else:
        for name, times, values in curves:
            ax.plot(times, values, label=name, linewidth=1.2)
    return len(curves)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.deploy.metrics_render", description=__doc__.splitlines()[0])
    p.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    p.add_argument("--dashboard", default=str(Path(__file__).parent / "grafana" / "pdserve.json"))
    p.add_argument("--out", default="dashboard.png")
    p.add_argument("--minutes", type=float, default=15.0, help="time range ending now")
    p.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                   help="dashboard variable (default: cluster=.* model=.* node=.*)")
    p.add_argument("--rate-interval", default="1m", help="what $__rate_interval stands for")
    p.add_argument("--columns", type=int, default=2)
    p.add_argument("--dpi", type=int, default=72)
    args = p.parse_args(argv)
    variables = {"cluster": ".*", "model": ".*", "node": ".*"}
    for item in args.var:
        name, sep, val = item.partition("=")
        if not sep or not name:
            p.error(f"--var wants NAME=VALUE, got {item!r}")
        variables[name] = val
    try:
        config = RenderConfig(args.prometheus, Path(args.dashboard), Path(args.out), minutes=args.minutes,
                              variables=variables, rate_interval=args.rate_interval, columns=args.columns,
                              dpi=args.dpi)
        result = render(config)
    except (ValueError, OSError) as err:
        print(f"metrics_render: {err}", file=sys.stderr)
        return 1
    print(f"{result.out}: {result.panels} panels" + (f"; no data: {', '.join(result.empty)}" if result.empty else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
