"""`pdserve bench URL`: the options (defined in deploy/cli.py, so that building the `pdserve` parser
imports nothing of this package) -> a LoadConfig -> a run or a sweep,
then the report, the JSON result and the plots."""

from __future__ import annotations

import argparse
import math
import sys

from pdserve.planner.loadgen.client import Target, api_base
from pdserve.planner.loadgen.metrics import parse_slos
from pdserve.planner.loadgen.report import print_report, result_json, write_json, write_plots
from pdserve.planner.loadgen.runner import LoadConfig, RunResult, run, sweep
from pdserve.planner.loadgen.workload import WorkloadConfig, parse_dist

DEFAULT_SWEEP_DURATION_S = 30.0


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """Validates the options into a LoadConfig. Raises ValueError with what is wrong."""
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--concurrency must be >= 1")
    if args.max_requests is not None and args.max_requests < 1:
        raise ValueError("--max-requests must be >= 1")
    if args.duration is not None and args.duration <= 0:
        raise ValueError("--duration must be positive")
    if args.trace and (args.rate is not None or args.sweep):
        raise ValueError("--trace sets the arrivals itself; drop --rate / --sweep")
    if args.shared_prefix_groups < 0 or args.shared_prefix_tokens < 0:
        raise ValueError("--shared-prefix-groups and --shared-prefix-tokens must be >= 0")
    if not 0 < args.slo_attainment <= 1:
        raise ValueError("--slo-attainment must be in (0, 1]")
    rate = args.rate
    if rate is None and args.concurrency is None and args.trace is None:
        rate = math.inf
    workload = WorkloadConfig(parse_dist(args.prompt_tokens), parse_dist(args.output_tokens),
                              args.shared_prefix_groups, args.shared_prefix_tokens, args.seed, args.tokenizer)
    target = Target(api_base(args.url), args.model or "", args.api, args.api_key, args.ignore_eos, args.temperature)
    duration = args.duration
    if args.sweep and duration is None:
        duration = DEFAULT_SWEEP_DURATION_S
    return LoadConfig(target, workload, rate, args.concurrency, args.trace, args.max_requests, duration,
                      args.timeout, parse_slos(args.slo), args.slo_attainment, not args.no_progress)


def sweep_rates(text: str) -> list[float] | None:
    """`1,2,4` -> [1, 2, 4]; `auto` -> None. Raises ValueError."""
    if text.strip().lower() == "auto":
        return None
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"bad --sweep {text!r}: expected R1,R2,... or auto") from None
    if not rates or any(not 0 < r < math.inf for r in rates):
        raise ValueError(f"bad --sweep {text!r}: rates must be positive and finite")
    return rates


def main(args: argparse.Namespace) -> int:
    """Runs `pdserve bench`; prints the report; writes --json and --plot. Returns the exit code: 0, or 1
    when every request failed."""
    cfg = config_from_args(args)
    if args.sweep:
        start = cfg.rate if cfg.rate is not None and math.isfinite(cfg.rate) else 1.0
        results: list[RunResult] = sweep(cfg, sweep_rates(args.sweep), start)
    else:
        results = [run(cfg)]
    swept = bool(args.sweep)
    print_report(results, swept)
    if args.json:
        write_json(args.json, result_json(cfg, results, swept))
    if args.plot:
        for path in write_plots(args.plot, results, swept):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if any(r.summary.succeeded for r in results) else 1
