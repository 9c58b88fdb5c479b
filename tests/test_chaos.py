"""The quick chaos run (about a minute of faults): 16 streaming openai-SDK clients on a 2 prefill + 2
decode cluster while a decode node and a prefill node are SIGKILLed and restarted, one node is SIGSTOPped
past its lease and etcd is restarted (`testing.chaos`; `bench/chaos.py` is the ten-minute version). Every
request completes with its reference's exact greedy text: none failed, no token lost or duplicated, and
every node ends with zero used KV blocks and a clean integrity check."""

from __future__ import annotations

from pathlib import Path

import pytest

from testing.chaos import ChaosConfig, run_chaos

pytestmark = pytest.mark.timeout(600)


def test_no_request_lost_under_chaos(tmp_path: Path) -> None:
    report = run_chaos(ChaosConfig(workdir=tmp_path, duration_s=50.0, clients=16, seed=1))
    print("\n".join(report.lines()))
    assert report.faults.keys() == {"kill_decode", "kill_prefill", "sigstop", "etcd_restart"}, report.faults
    assert report.completed >= 50, "the load kept flowing"
    assert report.problems() == []
