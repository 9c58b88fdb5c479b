"""`pdserve plan`: the options (defined in planner/args.py, argparse only, so that building the `pdserve`
parser imports nothing else of this package) -> a PlanConfig -> the search, its tables, the values file, the plot, JSON."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pdserve.planner.loadgen.metrics import parse_slos
from pdserve.planner.plan import Plan, PlanConfig, Planner, ShapeResult, write_values
from pdserve.planner.profile_model import load_profile_here
from pdserve.planner.sim import NodeSettings, SimResult, load_overheads
from pdserve.planner.traffic import Traffic, trace_requests


def parse_workload(spec: str, seed: int = 0) -> Traffic:
    """`prompt=uniform:32:512,output=128[,prefix=N]` (lengths in `pdserve bench`'s syntax) -> Traffic.
    Raises ValueError."""
    keys: dict[str, str] = {"prompt": "256", "output": "128", "prefix": "0"}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in keys:
            raise ValueError(f"bad --workload item {item!r}: expected prompt=DIST, output=DIST or prefix=N")
        keys[key] = value
    try:
        prefix = int(keys["prefix"])
    except ValueError:
        raise ValueError(f"bad --workload prefix {keys['prefix']!r}: expected a token count") from None
    if prefix < 0:
        raise ValueError("--workload prefix must be >= 0")
    return Traffic.parse(keys["prompt"], keys["output"], prefix, seed)


def config_from_args(args: argparse.Namespace) -> PlanConfig:
    """Validates the options into a PlanConfig. Raises ValueError (or OSError reading a file)."""
    profile = load_profile_here(args.profile, args.allow_other_machine)
    if args.trace and args.workload:
        raise ValueError("give --workload or --trace, not both")
    traffic = None if args.trace else parse_workload(args.workload or "", args.seed)
    trace = trace_requests(args.trace, args.tokenizer) if args.trace else None
    settings = NodeSettings.of(profile, local_prefill_threshold=args.local_prefill_threshold,
                               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                               num_kv_blocks=args.num_kv_blocks)
    overheads = load_overheads(args.overheads) if args.overheads else None
    return PlanConfig(profile, parse_slos(args.slo), args.attainment, args.max_nodes, args.rate, args.sweep,
                      traffic, trace, args.requests, settings, overheads, getattr(args, "tp_widths", None))


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{1000 * x:.1f}"


def shapes_table(plan: Plan) -> Table:
    """One row per shape: fits, the rate it was judged at, predicted percentiles, goodput."""
    t = Table(title="shapes (simulated)")
    wide = any(r.shape.tp for r in plan.results)  # a "cores" column where a node may run several ranks
    for col in ("shape", "nodes", *(("cores",) if wide else ()), "fits", "rate", "max rate", "TTFT p90 ms", "TPOT p90 ms", "TPOT p99 ms",
                "ITL p99 ms", "attainment", "goodput req/s"):
        t.add_column(col, justify="left" if col == "shape" else "right", no_wrap=col == "shape")
    for r in plan.results:
        run = r.best
        s = run.summary if run else None
        mark = " *" if r is plan.recommended else ""
        t.add_row(r.shape.label + mark, str(r.shape.nodes), *((str(r.shape.cores),) if wide else ()),
                  "yes" if r.fits else "no",
                  "-" if run is None or run.rate is None else f"{run.rate:.3g}",
                  "-" if r.max_rate is None else f"{r.max_rate:.3g}",
                  *(("-",) * 6 if s is None else (
                      _ms(s.latency["ttft"].p90), _ms(s.latency["tpot"].p90), _ms(s.latency["tpot"].p99),
                      _ms(s.latency["itl"].p99), f"{100 * s.attainment:.1f}%", f"{s.goodput_rate:.2f}")))
    return t


def recommendation_text(plan: Plan) -> str:
    """What to run, in one paragraph."""
    rec, cfg = plan.recommended, plan.config
    slos = ", ".join(f"{s.name}<={_ms(s.threshold_s)}ms" for s in cfg.slos)
    if rec is None or rec.best is None:
        what = f"at {cfg.target_rate:.3g} req/s" if cfg.target_rate is not None else "at any rate tried"
        unit = "ranks" if any(w > 1 for w in cfg.tp_widths or ()) else "nodes"
        return (f"no shape of at most {cfg.max_nodes} {unit} meets {slos} for {100 * cfg.attainment:.0f}% of "
                f"requests {what}: raise --max-nodes, relax the SLOs, or lower the rate")
    s = rec.best.summary
    kind = "colocated (every node prefills and decodes)" if rec.shape.colocated else "disaggregated"
    lat = ", ".join(f"{k.upper()} p90 {_ms(v.p90)} ms / p99 {_ms(v.p99)} ms" for k, v in s.latency.items()
                    if k in ("ttft", "tpot"))
    at = f"{rec.best.rate:.3g} req/s" if rec.best.rate is not None else "the trace's rate"
    more = f"; sustains up to {rec.max_rate:.3g} req/s" if rec.max_rate is not None else ""
    sh = rec.shape
    nodes = (f"{sh.prefill} prefill + {sh.decode} decode nodes" if not sh.tp
             else f"{sh.decode} nodes of TP {sh.decode_tp}, {sh.cores} ranks" if sh.colocated
             else f"{sh.prefill} prefill nodes of TP {sh.prefill_tp} + {sh.decode} decode nodes of TP {sh.decode_tp}, "
                  f"{sh.cores} ranks")
    return (f"recommended: {sh.label} ({nodes}, "
            f"{kind}) at {at}: {lat}; SLO attainment {100 * s.attainment:.1f}% "
            f"(target {100 * cfg.attainment:.0f}%), goodput {s.goodput_rate:.2f} req/s{more}")


def _plot_shapes(plan: Plan) -> list[ShapeResult]:
    """The recommended shape and the best fitting colocated and disaggregated ones (at most 4)."""
    picks: list[ShapeResult] = []
    fitting = [r for r in plan.results if r.fits]
    for group in (fitting, [r for r in fitting if r.shape.colocated], [r for r in fitting if not r.shape.colocated]):
        if group:
            best = plan.recommended if plan.recommended in group else group[0]
            if best is not None and best not in picks:
                picks.append(best)
    return picks[:4] or plan.results[:2]


def write_plot(path: str | Path, plan: Plan, planner: Planner) -> Path | None:
    """Goodput against offered rate for a few shapes (more rates simulated where a shape has few). Returns
    the path, or None (and says why) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("pdserve plan: matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return None
    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res in _plot_shapes(plan):
        base = plan.config.target_rate or res.max_rate or 1.0
        runs: list[SimResult] = list(res.curve)
        if len(runs) < 4:
            runs += [planner.simulate(res.shape, base * k) for k in (0.25, 0.5, 0.75, 1.25, 1.5, 2.0)]
        runs.sort(key=lambda r: r.rate or 0.0)
        ax.plot([r.rate for r in runs], [r.summary.goodput_rate for r in runs], "o-", label=res.shape.label)
    if plan.config.target_rate is not None:
        ax.axvline(plan.config.target_rate, ls="--", color="grey", label="target rate")
    ax.set(xlabel="offered rate (req/s)", ylabel="goodput (req/s meeting every SLO)",
           title="simulated goodput against rate")
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(path)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out


def main(args: argparse.Namespace) -> int:
    """Runs `pdserve plan` (or `--check`); prints the recommendation and the table (or JSON with --json);
    writes --values-out and --plot. Returns 0 when a shape fits, 1 when none does."""
    if args.check:
        from pdserve.planner.check import main as check_main

        return check_main(args)
    cfg = config_from_args(args)
    console = Console(stderr=True)
    with Progress(TextColumn("simulating {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, disable=args.json or not console.is_terminal) as bar:
        task = bar.add_task("shapes", total=None)
        planner = Planner(cfg, lambda done, total, label: bar.update(task, completed=done, total=total,
                                                                       description=label))
        plan = planner.run()
    return report(plan, planner, args)


def report(plan: Plan, planner: Planner, args: argparse.Namespace) -> int:
    """Prints the plan, writes the values file and the plot."""
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
    else:
        out = Console()
        if not out.is_terminal:  # a pipe or a file: wide enough for the table, never wrapped mid-row
            out = Console(width=160)
        out.print(shapes_table(plan))
        out.print(recommendation_text(plan))
    rec = plan.recommended
    if args.values_out and rec is not None:
        path = write_values(args.values_out, rec.shape, "pdserve plan: " + recommendation_text(plan))
        print(f"wrote {path} (deploy/k8s/render.py -f {path})", file=sys.stderr)
    elif args.values_out:
        print("pdserve plan: no shape fits: no values file written", file=sys.stderr)
    if args.plot:
        path = write_plot(args.plot, plan, planner)
        if path is not None:
            print(f"wrote {path}", file=sys.stderr)
    return 0 if rec is not None else 1
