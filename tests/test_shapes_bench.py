"""`bench/shapes.py --predict-only`: the shapes bench's smoke run (no cluster: the planner's predictions on a
given profile), so it cannot rot. Every workload's SLOs, stated relative to the profile, resolve to
thresholds some shape meets; SLOs no shape meets are loosened step by step, and the run says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.planner.profile_model import EngineFacts, Linear, Profile
from testing.procs import REPO_ROOT

pytestmark = [pytest.mark.timeout(120), pytest.mark.quick]


def _run(tmp_path: Path, *extra: str) -> tuple[str, dict]:
    prof = tmp_path / "profile.json"
    Profile(Linear(0.01, 1e-4, 1e-8), Linear(0.01, 2e-4, 1e-7), Linear(0.002, 1e-9),
            EngineFacts(16, 4000, 1000, 2048, 128, 64), machine={"synthetic": True}).save(prof)
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "bench/shapes.py", "--model", "tiny", "--profile", str(prof), "--predict-only",
                          "--sim-requests", "60", "--out", str(out), *extra], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=110)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout, json.loads((out / "result.json").read_text())


def test_predict_only_resolves_relative_slos_and_recommends_for_every_workload(tmp_path: Path) -> None:
    out, result = _run(tmp_path)
    rows = {r["workload"]: r for r in result["validation"]}
    assert set(rows) == {"prompt-heavy", "output-heavy", "mixed"}, out
    for name, row in rows.items():
        assert row["feasible"] and row["loosened"] == 1, row
        assert "x" in row["slo_stated"] and row["slo"].endswith("ms"), row  # relative, resolved to thresholds
        rec = [s for s in row["shapes"] if s["recommended"]]
        assert len(rec) == 1 and rec[0]["fits"], row
        assert f"== {name}:" in out and "predicted ttft_p90" in out
    assert "measured" not in json.dumps(result["validation"])  # nothing was measured


def test_slos_no_shape_meets_are_loosened_and_said_so(tmp_path: Path) -> None:
    out, result = _run(tmp_path, "--validate", "prompt-heavy", "--slo", "ttft_p90=0.05x,tpot_p99=0.05x")
    row = result["validation"][0]
    assert row["feasible"] and row["loosened"] > 1, row
    assert "no shape meets" in out and "loosening every threshold" in out and "loosened x" in out, out


def test_cpu_use_tells_the_launchers_nodes_from_the_host(tmp_path: Path) -> None:
    """bench/shapes.py's CPU accounting (the serving overheads) recognises the node processes by the
    command lines `pdserve up` really starts; the frontend and etcd count as the host."""
    from bench.shapes import process_kind
    from pdserve.deploy.launcher.config import LauncherConfig
    from pdserve.deploy.launcher.process import Slot, command
    from pdserve.engine.tiny import default_model_dir

    cfg = LauncherConfig(model=str(default_model_dir("llama")), model_name="m", runs_dir=tmp_path)
    kinds = {pool: process_kind(" ".join(command(cfg, Slot(f"{pool}-0", pool, tmp_path / "log"), ["127.0.0.1:2379"],
                                                 tmp_path)))
             for pool in ("prefill", "decode", "frontend", "etcd")}
    assert kinds == {"prefill": "prefill", "decode": "decode", "frontend": "host", "etcd": "host"}
