"""`bench/engine_bench.py --smoke`: the engine bench runs end to end in seconds on the tiny model at Q8_0
(so it cannot rot), names the CPU ISA and sets the steady decode against its roofline."""

from __future__ import annotations

import subprocess
import sys

import pytest

from testing.procs import REPO_ROOT

pytestmark = [pytest.mark.timeout(300)]


def test_smoke_run_reports_the_roofline_and_the_isa(tiny_llama_dir) -> None:
    run = subprocess.run([sys.executable, "bench/engine_bench.py", "--smoke"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "CPU ISA " in out and "quant kernels " in out, out
    assert "Q8_0 kernels" in out and "copy bandwidth" in out, out
    line = next(ln for ln in out.splitlines() if ln.startswith("steady decode"))
    assert "of its roofline" in line and "bound by " in line, line
    assert "one fused call" in out, out
