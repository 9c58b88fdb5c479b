"""`bench/autoscale_bench.py --smoke`: the autoscaler bench's smoke run (the tiny model, seconds-long phases,
the hand-made profile), so it cannot rot. The structure of its report: the three phases in every run,
the step delays of the autoscaled run, a fixed shape replayed, the best of them and
the ratio to it, every request sent answered with 200 (none lost or failed while nodes start and drain)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from testing.procs import REPO_ROOT

pytestmark = pytest.mark.timeout(420)


def test_smoke_run_reports_every_phase_and_loses_no_request(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "bench/autoscale_bench.py", "--smoke", "--out", str(out)], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert run.stdout.startswith("CPU ISA ") and result["isa"] in run.stdout
    assert [p["name"] for p in result["phases"]] == ["A", "B", "C"]
    assert result["phases"][1]["rate"] == 2 * result["phases"][0]["rate"]
    assert result["phases"][2]["prompt_tokens"] > result["phases"][0]["prompt_tokens"]
    auto, fixed = result["autoscaled"], result["fixed"]
    assert [r["label"] for r in fixed] == ["fixed 1P:1D"]  # the smoke run's one fixed shape
    for r in [auto, *fixed]:
        assert set(r["phases"]) == {"A", "B", "C"}, r["label"]
        assert r["sent"] == result["requests"] > 0 and r["answered"] == r["sent"] == r["ok"], r
        assert r["lost"] == 0 and r["failed"] == 0, r["errors"]
        assert 0 <= r["attainment"] <= 1 and math.isfinite(r["ttft_p90_s"]) and r["ttft_p90_s"] > 0
    assert set(auto["steps"]) == {"B", "C"}
    for step in auto["steps"].values():
        for key in ("decision_s", "serving_s"):
            assert step[key] is None or (math.isfinite(step[key]) and step[key] >= 0), step
    assert result["best_fixed"] in {r["label"] for r in fixed}
    assert math.isfinite(result["ratio_autoscaled_to_best_fixed"]) and result["ratio_autoscaled_to_best_fixed"] > 0
    table = run.stdout[run.stdout.index("== autoscale bench"):]
    for label in ("autoscaled", "fixed 1P:1D", "step to B", "step to C",
                  "autoscaled / best fixed"):
        assert label in table, table
