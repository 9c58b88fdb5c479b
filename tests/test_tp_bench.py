"""bench/tp_bench.py in its smoke mode (tiny model, a few steps): it runs and prints every figure."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_smoke_run_prints_the_isa_and_every_ratio() -> None:
    run = subprocess.run([sys.executable, "bench/tp_bench.py", "--smoke"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert re.search(r"^CPU ISA x86_64|^CPU ISA", out, re.M)
    assert re.search(r"scaling efficiency .* = \d+\.\d\d", out)
    assert re.search(r"all-reduce \d+\.\d% of it", out)
    assert re.search(r"TP 2 -> TP 1 [\d.]+ ms \([\d.]+x\); TP 1 -> TP 2 [\d.]+ ms \([\d.]+x\)", out)
