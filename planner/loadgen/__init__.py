"""A load generator for any OpenAI-compatible endpoint (`pdserve bench URL`).

Torch-free: it needs httpx, rich, orjson, and optionally tokenizers (exact prompt lengths) and
matplotlib (plots).

    workload.py   length distributions, synthetic prompts, shared prefixes, traces, arrival schedules
    client.py     one streamed request, timed at the client -> RequestRecord
    runner.py     arrivals (Poisson, fixed concurrency, trace replay), progress bar, rate sweeps
    metrics.py    percentiles, throughput, SLOs, attainment and goodput -> Summary
    report.py     the summary table, the JSON result, the plots
    cli.py        the `pdserve bench` options -> a run
"""

from __future__ import annotations

from pdserve.planner.loadgen.client import RequestRecord
from pdserve.planner.loadgen.metrics import SLO, Summary, parse_slos, percentile, summarize
from pdserve.planner.loadgen.workload import (
    LengthDist,
    MixtureDist,
    RequestSpec,
    parse_dist,
    poisson_arrivals,
    read_trace,
)

__all__ = [
    "SLO",
    "LengthDist",
    "MixtureDist",
    "RequestRecord",
    "RequestSpec",
    "Summary",
    "parse_dist",
    "parse_slos",
    "percentile",
    "poisson_arrivals",
    "read_trace",
    "summarize",
]
