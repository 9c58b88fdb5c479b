"""`bench/frontend_bench.py --quick`: the frontend overhead bench runs end to end in seconds (so it cannot
break unnoticed when the protocol or the frontend changes), reports every figure and names the CPU ISA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testing.procs import REPO_ROOT

pytestmark = [pytest.mark.timeout(300), pytest.mark.quick]


def test_quick_run_reports_every_figure_and_the_isa(tmp_path: Path, tiny_llama_dir: Path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "bench/frontend_bench.py", "--quick", "--json", str(out)], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())
    fe = results["pdserve frontend"]
    assert fe["errors"] == 0, fe
    for key in ("ttft_ms_p50", "ttft_ms_p99", "upstream_ttft_ms_p50", "chunks_per_s", "requests_per_s"):
        assert fe[key] > 0, (key, fe)
    assert fe["ttft_ms_p99"] >= fe["ttft_ms_p50"], fe
    for key in ("ttft_ms_p50", "chunks_per_s", "requests_per_s"):  # the console on against --no-console
        figure = results["console"][key]
        assert figure["on"] > 0 and figure["off"] > 0 and figure["ratio"] > 0, (key, figure)
    assert "console on (nobody watching) against --no-console" in run.stdout, run.stdout
    assert results["isa"].split(":")[0], results
    assert f"CPU ISA {results['isa']}" in run.stdout, run.stdout


def test_isa_summary_lists_the_known_flags_in_order() -> None:
    from bench.cpu_isa import isa_summary

    line = isa_summary({"amx_bf16", "avx2", "sse4_2", "avx512f"})
    assert line.split(": ", 1)[1] == "avx2 avx512f amx_bf16", line
    assert "none of avx2" in isa_summary(set())
