"""`bench/batch_bench.py --smoke`: the batches-on-spare-capacity bench runs end to end in seconds on the
tiny model (so it cannot rot when the batch API or the frontend changes), names the CPU ISA and reports
every figure: interactive TTFT p90 / TPOT p99 alone and beside a batch, their ratios, and the idle batch's
throughput against the chat API's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from testing.procs import REPO_ROOT

pytestmark = [pytest.mark.timeout(300), pytest.mark.quick]


def test_smoke_run_reports_every_figure_and_the_isa(tiny_llama_dir: Path) -> None:
    run = subprocess.run([sys.executable, "bench/batch_bench.py", "--smoke"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    results = json.loads(out.strip().splitlines()[-1])
    assert f"CPU ISA {results['isa']}" in out, out
    assert results["smoke"] and results["batch_lines"] == 40, results
    for phase in ("alone", "with_batch"):
        fig = results[phase]
        assert fig["requests"] > 0 and fig["errors"] == 0, fig
        for key in ("ttft_ms_p90", "tpot_ms_p99"):
            assert math.isfinite(fig[key]) and fig[key] > 0, (phase, key, fig)
    assert results["with_batch"]["batch_status"] in ("cancelled", "completed"), results["with_batch"]
    assert results["with_batch"]["batch_lines_done"] > 0, results["with_batch"]
    for side in ("batch", "direct"):
        fig = results[side]
        assert fig["lines"] == 16 and fig["tokens"] == 16 * 16 and fig["lines_per_s"] > 0, (side, fig)
    for key in ("ttft_p90", "tpot_p99", "batch_lines_per_s", "batch_tokens_per_s"):
        assert math.isfinite(results["ratios"][key]) and results["ratios"][key] > 0, results["ratios"]
    for text in ("interactive alone", "with batch / alone", "(target <= 1.10x)", "batch / chat API", "lines/s"):
        assert text in out, (text, out)
