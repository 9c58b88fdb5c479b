"""Output of a run: the summary tables (stdout), the JSON result, the PNG plots."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pdserve.planner.loadgen.runner import LoadConfig, RunResult, best_rate


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{1000 * x:.1f}"


def summary_tables(result: RunResult) -> list[Table]:
    """Throughput, latency and SLO tables of one run."""
    s = result.summary
    head = Table(title="load", show_header=False)
    rows = [
        ("requests", f"{s.requests} sent, {s.succeeded} ok, {s.failed} failed"),
        ("duration", f"{s.duration_s:.2f} s"),
        ("request throughput", f"{s.request_rate:.2f} req/s"),
        ("output tokens", f"{s.output_tokens} ({s.output_token_rate:.1f} tok/s; {s.chunks} content chunks)"),
        ("prompt tokens", f"{s.prompt_tokens} ({s.prompt_token_rate:.1f} tok/s)"),
    ]
    rows += [(f"error {kind}", str(n)) for kind, n in s.errors.items()]
    if s.slos:
        rows += [("SLO attainment", f"{100 * s.attainment:.1f}% (target {100 * s.attainment_target:.0f}%): "
                                    f"{'met' if s.meets_target else 'MISSED'}"),
                 ("goodput", f"{s.goodput_rate:.2f} req/s, {s.goodput_token_rate:.1f} tok/s")]
    for k, v in rows:
        head.add_row(k, v)
    lat = Table(title="latency (ms)")
    for col in ("metric", "mean", "p50", "p90", "p99", "n"):
        lat.add_column(col, justify="left" if col == "metric" else "right")
    for name, st in s.latency.items():
        lat.add_row(name.upper(), _ms(st.mean), _ms(st.p50), _ms(st.p90), _ms(st.p99), str(st.count))
    tables = [head, lat]
    if s.slos:
        slo = Table(title="SLOs")
        for col in ("SLO", "threshold ms", "observed ms", "requests meeting it", "pass"):
            slo.add_column(col)
        for r in s.slos:
            slo.add_row(r.name, _ms(r.threshold_s), _ms(r.observed_s), f"{100 * r.met_fraction:.1f}%",
                        "yes" if r.passed else "NO")
        tables.append(slo)
    return tables


def sweep_table(results: list[RunResult]) -> Table:
    """One row per swept rate."""
    t = Table(title=f"sweep: highest rate meeting the target: {best_rate(results) or 'none'} req/s")
    for col in ("rate", "req/s", "out tok/s", "TTFT p90 ms", "TPOT p90 ms", "attainment", "goodput req/s",
                "goodput tok/s", "met"):
        t.add_column(col, justify="right")
    for r in results:
        s = r.summary
        t.add_row(f"{r.rate:g}", f"{s.request_rate:.2f}", f"{s.output_token_rate:.1f}",
                  _ms(s.latency["ttft"].p90), _ms(s.latency["tpot"].p90), f"{100 * s.attainment:.1f}%",
                  f"{s.goodput_rate:.2f}", f"{s.goodput_token_rate:.1f}", "yes" if s.meets_target else "NO")
    return t


def print_report(results: list[RunResult], swept: bool, console: Console | None = None) -> None:
    """Prints the tables of a run (or of each swept rate, then the sweep table) on stdout."""
    console = console or Console(width=120)
    for r in results:
        if swept:
            console.rule(f"rate {r.rate:g} req/s")
        for table in summary_tables(r):
            console.print(table)
    if swept:
        console.print(sweep_table(results))


def _nan_to_none(obj: Any) -> Any:
    # JSON has no NaN or infinity: null says "no samples", "inf" an unbounded rate.
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, float) and math.isinf(obj):
        return "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nan_to_none(v) for v in obj]
    return obj


def result_json(cfg: LoadConfig, results: list[RunResult], swept: bool) -> dict[str, Any]:
    """The JSON result: config, and the records and summary of the run (or of each swept rate)."""
    config = asdict(cfg)
    config["target"].pop("api_key", None)  # never write a credential to a result file
    config["slos"] = [{"name": s.name, "threshold_s": s.threshold_s} for s in cfg.slos]
    runs = [{"rate": r.rate, "concurrency": r.concurrency, "summary": r.summary.to_dict(),
             "records": [asdict(rec) for rec in r.records]} for r in results]
    out: dict[str, Any] = {"config": config}
    if swept:
        out.update(sweep=runs, best_rate=best_rate(results))
    else:
        out.update(runs[0])
    return _nan_to_none(out)


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    """Writes `data` to `path` (creating its directory)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")


def _cdf(ax: Any, values: list[float], label: str) -> None:
    xs = sorted(1000 * v for v in values)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def write_plots(directory: str | Path, results: list[RunResult], swept: bool) -> list[Path]:
    """Writes ttft_cdf.png, tpot_cdf.png, itl_cdf.png (one curve per run) and, for a sweep, sweep.png
    (attainment and goodput against rate) into `directory`; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    pick = {"ttft": lambda r: [r.ttft_s], "tpot": lambda r: [r.tpot_s], "itl": lambda r: r.itl_s}
    for metric, values_of in pick.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for res in results:
            values = [v for rec in res.records if rec.ok for v in values_of(rec) if v is not None]
            _cdf(ax, values, f"{res.rate:g} req/s" if res.rate is not None else f"concurrency {res.concurrency}")
        ax.set(xlabel=f"{metric.upper()} (ms)", ylabel="fraction of " + ("gaps" if metric == "itl" else "requests"),
               title=f"{metric.upper()} CDF", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        written.append(out_dir / f"{metric}_cdf.png")
        fig.savefig(written[-1], dpi=100, bbox_inches="tight")
        plt.close(fig)
    if swept:
        written.append(_sweep_plot(plt, out_dir, results))
    return written


def _sweep_plot(plt: Any, out_dir: Path, results: list[RunResult]) -> Path:
    rates = [r.rate or 0.0 for r in results]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot(rates, [100 * r.summary.attainment for r in results], "o-")
    a1.axhline(100 * results[0].summary.attainment_target, ls="--", color="grey", label="target")
    a1.set(xlabel="offered rate (req/s)", ylabel="SLO attainment (%)", title="attainment")
    a1.legend()
    a2.plot(rates, [r.summary.goodput_rate for r in results], "o-", label="goodput")
    a2.plot(rates, [r.summary.request_rate for r in results], "s--", label="throughput")
    a2.set(xlabel="offered rate (req/s)", ylabel="req/s", title="goodput")
    a2.legend()
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
    path = out_dir / "sweep.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
