"""`bench/spec_bench.py --quick`: the speculative-decoding bench runs end to end in seconds on the tiny
model (so it cannot rot): it names the CPU ISA, measures every workload at two concurrencies with
speculation on and off in one run, and finds the outputs token-identical."""

from __future__ import annotations

import subprocess
import sys

import pytest

from testing.procs import REPO_ROOT

pytestmark = [pytest.mark.timeout(300)]


def test_quick_run_reports_every_workload_and_identical_outputs() -> None:
    run = subprocess.run([sys.executable, "bench/spec_bench.py", "--quick"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "CPU ISA " in out, out
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] in (["code"], ["quote"], ["chat"])]
    assert sorted((r[0], r[1]) for r in rows) == sorted((w, c) for w in ("code", "quote", "chat") for c in ("1", "2"))
    for r in rows:
        assert float(r[2]) > 0 and float(r[3]) > 0 and r[4].endswith("x"), r
        assert r[8] == "yes", r  # speculation on and off gave the same tokens
