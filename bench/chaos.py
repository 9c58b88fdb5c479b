"""Chaos benchmark: 16 streaming openai-SDK clients on a 2 prefill + 2 decode cluster (tiny model,
greedy, every request checked against its reference) while nodes are SIGKILLed and restarted at random,
one is SIGSTOPped past its lease, and etcd is restarted. Reports requests completed and failed, text
mismatches with tokens lost or duplicated, the recoveries (retried, re-prefilled, migrated), KV blocks
used on every node at the end, the integrity check and, with --memory, every process's RSS growth.
Targets: 0 failed, 0 duplicated, 0 lost, 0 leaked; RSS growth under 5% (long version).

    .venv/bin/python bench/chaos.py [--duration 600] [--clients 16] [--seed 0] [--memory] [--fault-interval 3,6]

The suite runs a one-minute version (tests/test_chaos.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from testing.chaos import ChaosConfig, run_chaos  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load and faults")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory", action="store_true", help="sample RSS and report growth (long runs)")
    parser.add_argument("--fault-interval", default="3,6", metavar="MIN,MAX",
                        help="seconds between two faults, drawn uniformly (default 3,6)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--workdir", type=Path, help="logs and etcd data (default: a temporary directory)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdserve-chaos-") as tmp:
        workdir = args.workdir or Path(tmp)
        started = time.monotonic()
        low, high = (float(x) for x in args.fault_interval.split(","))
        report = run_chaos(ChaosConfig(workdir=workdir, duration_s=args.duration, clients=args.clients,
                                       seed=args.seed, sample_memory=args.memory, fault_interval_s=(low, high)),
                           log=lambda line: print(f"[{time.monotonic() - started:7.1f}s] {line}", flush=True))
    print()
    for line in report.lines():
        print(line)
    problems = report.problems()
    if args.memory:
        grown = {n: g for n, g in report.memory_growth.items() if g >= 0.05}
        if grown:
            problems.append(f"RSS grew 5% or more: {grown}")
    print(f"{'result':<38}" + ("PASS" if not problems else "FAIL: " + "; ".join(problems)))
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
