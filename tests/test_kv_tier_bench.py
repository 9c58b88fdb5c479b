"""`bench/kv_tier_bench.py --quick`: the KV-tier restart bench runs end to end in seconds on the tiny model
(so it cannot rot): it names the CPU ISA, reads each history back from the tier after a restart, and the
warm and cold restarts' outputs are token-identical."""

from __future__ import annotations

import subprocess
import sys

import pytest

from testing.procs import REPO_ROOT

pytestmark = [pytest.mark.timeout(300), pytest.mark.quick]


def test_quick_run_reads_each_history_back_with_identical_outputs() -> None:
    run = subprocess.run([sys.executable, "bench/kv_tier_bench.py", "--quick"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "CPU ISA " in out, out
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] in (["2"], ["4"])]
    assert len(rows) == 2, out
    for r in rows:
        assert r[5].endswith("x") and int(r[6]) > 0 and r[-1] == "yes", r
