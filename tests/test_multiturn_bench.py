"""`bench/multiturn_bench.py --quick`: the multi-turn bench (KV tier and exact routing against neither, each
on a fresh 2-node cluster) runs end to end on the tiny model, so it cannot rot: both configurations serve
every turn, the report names the ISA and every figure, and the greedy answers agree."""

from __future__ import annotations

import subprocess
import sys

import pytest

from testing.procs import REPO_ROOT

pytestmark = [pytest.mark.timeout(300), pytest.mark.quick]


def test_quick_run_serves_both_configurations_and_reports_every_figure() -> None:
    run = subprocess.run([sys.executable, "bench/multiturn_bench.py", "--quick"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "CPU ISA " in out, out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.split()[:1] in (["baseline"], ["tier+exact"])}
    assert set(rows) == {"baseline", "tier+exact"}, out
    for r in rows.values():
        assert r[1].endswith("ms") and int(r[3]) > 0, r
    assert int(rows["tier+exact"][3]) < int(rows["baseline"][3]), out  # fewer prompt tokens computed
    assert "greedy answers identical 12/12" in out, out
