"""`pdserve up` as a real subprocess from the repository (etcd, one prefill and one decode node, the
frontend), the way the README runs it:

1. the examples it prints work: its `curl` command and its `openai` SDK snippet, run as printed;
2. `pdserve status` finds the cluster and shows each node's role, id, addresses, pid, load and KV use;
   with `--pin` every thread of each node runs on the node's own CPUs, as the banner says;
3. killing both node processes gets them reported and restarted, and serving continues;
4. nodes whose engine steps fail (the nodes' test-only fault hook, armed for the whole cluster) leave,
   exit with EXIT_UNHEALTHY and are restarted, and serving continues once the fault is gone;
5. Ctrl-C stops every process in order (frontend, decode, prefill, etcd), leaving no process and no
   registry key behind (checked by bringing etcd back up on the cluster's data).

The tests share one cluster and run in file order; the last one stops it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pdserve.deploy.launcher import registry_keys
from pdserve.node_common.ready import EXIT_UNHEALTHY
from pdserve.registry import EtcdServer
from testing.faults import Faults
from testing.up_cluster import REPO_ROOT, UpCluster

pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.skipif(importlib.util.find_spec("pdserve.frontend.main") is None,
                       reason="pdserve up serves through the frontend (frontend.main), which is missing"),
]


def step_faults(workdir: Path) -> Faults:
    """The fault hook every node of the cluster runs: its engine steps fail while `workdir/fault.fail` exists."""
    return Faults(step_trigger=str(workdir / "fault"))


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpCluster]:
    workdir = tmp_path_factory.mktemp("up")
    cluster = UpCluster.start(workdir, ["--model", "tiny", "--lease-ttl", "2", "--kv-memory", "64", "--pin"],
                              env=step_faults(workdir).env())
    try:
        yield cluster
    finally:
        cluster.close()


def ask(up: UpCluster, content: str = "Hello!") -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=f"{up.base_url}/v1", api_key="local", max_retries=0, timeout=60)
    model = up.state()["model"]
    return client.chat.completions.create(model=model, max_tokens=8, messages=[{"role": "user", "content": content}])


def banner_block(banner: str, label: str) -> str:
    """The lines of one banner entry: from the line starting with `label` to the next blank line."""
    lines = banner.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(label))
    end = next(i for i in range(start, len(lines)) if not lines[i].strip())
    return "\n".join(lines[start:end])


def test_printed_examples_work(up: UpCluster) -> None:
    banner = up.stdout()
    assert f"{up.base_url}/v1" in banner
    assert f"{up.cluster_dir}/logs/*.log" in banner
    assert f"{up.base_url}/metrics" in banner and "prefill-0" in banner and "decode-0" in banner
    assert list((up.cluster_dir / "logs").glob("*.log")), "the logs are where the banner says"

    curl = banner_block(banner, "curl").strip().removeprefix("curl").strip()
    result = subprocess.run(["bash", "-c", f"curl -sS --fail {curl}"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] > 0

    sdk = textwrap.dedent("\n".join(banner_block(banner, "openai SDK").splitlines()[1:]))
    result = subprocess.run([sys.executable, "-c", sdk], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "the SDK example prints the model's reply"

    completion = ask(up)
    assert completion.choices[0].finish_reason in ("length", "stop") and completion.usage is not None


def test_status_shows_the_registry(up: UpCluster) -> None:
    status = up.status_json()
    assert status["cluster"] == up.cluster and status["url"] == up.base_url
    nodes = {n["node_id"]: n for n in status["nodes"]}
    assert {nid: n["role"] for nid, n in nodes.items()} == {"prefill-0": "prefill", "decode-0": "decode"}
    processes = {p["name"]: p for p in up.state()["processes"]}
    for nid, node in nodes.items():
        assert node["pid"] == processes[nid]["pid"] and node["pid"] in up.processes()
        assert node["grpc_address"] == processes[nid]["grpc"] and node["metrics_address"] == processes[nid]["metrics"]
        assert node["kv_address"].startswith("127.0.0.1:") and node["kv_blocks_total"] > 0
        assert node["running"] is not None and 0.0 <= node["kv_usage"] <= 1.0
    table = up.status()
    assert table.returncode == 0 and "prefill-0" in table.stdout and "decode-0" in table.stdout


def thread_cpus(pid: int) -> set[frozenset[int]]:
    """The distinct CPU masks of the process's threads."""
    masks = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            masks.add(frozenset(os.sched_getaffinity(int(tid))))
    return masks


def test_pinned_nodes_run_on_their_own_cpus(up: UpCluster) -> None:
    usable = sorted(os.sched_getaffinity(0))
    processes = {p["name"]: p["pid"] for p in up.state()["processes"]}
    expected = ({"prefill-0": {usable[0]}, "decode-0": {usable[1]}} if len(usable) >= 2
                else {"prefill-0": {usable[0]}, "decode-0": {usable[0]}})
    for name, cpus in expected.items():
        assert thread_cpus(processes[name]) == {frozenset(cpus)}, f"{name}: every thread on {cpus}"
    assert len(ask(up).choices) == 1  # the pinned nodes serve (their torch threads were started pinned)
    for name, cpus in expected.items():
        assert thread_cpus(processes[name]) == {frozenset(cpus)}
    banner = banner_block(up.stdout(), "cores")
    for name, cpus in expected.items():
        assert f"{name} cpus {','.join(map(str, sorted(cpus)))} x{len(cpus) if len(usable) >= 2 else 1} thread(s)" in banner


def test_killed_nodes_restart_and_serving_continues(up: UpCluster) -> None:
    before = {n["node_id"]: n for n in up.status_json()["nodes"]}
    targets_before = {t["labels"]["node"]: t["targets"] for t in up.targets()}
    for node in before.values():
        os.kill(node["pid"], signal.SIGKILL)
    for name in before:
        up.wait_for(f"{name} (pid {before[name]['pid']}) exited with code -9", 30)
        up.wait_for(f"{name} is back", 180)

    deadline = time.monotonic() + 30
    while True:  # the registry shows the new processes once their records replaced the dead ones'
        after = {n["node_id"]: n for n in up.status_json()["nodes"]}
        if set(after) == set(before) and all(after[n]["pid"] != before[n]["pid"] for n in after):
            break
        assert time.monotonic() < deadline, f"registry still shows {after}"
        time.sleep(0.5)  # the poll interval
    assert all(after[n]["pid"] in up.processes() for n in after)
    assert ask(up, "Still there?").usage.completion_tokens > 0
    # Restarted nodes keep their /metrics port, so Prometheus keeps scraping the same targets.
    assert {t["labels"]["node"]: t["targets"] for t in up.targets()} == targets_before


def test_unhealthy_nodes_exit_and_are_restarted(up: UpCluster) -> None:
    fault = step_faults(up.runs_dir.parent)
    before = {n["node_id"]: n["pid"] for n in up.status_json()["nodes"]}
    for pid in before.values():  # `pdserve up` handed its environment, the hook's variables, to every node
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert all(f"{name}={value}".encode() in environ for name, value in fault.env().items()), pid

    def exited(name: str) -> bool:
        return f"{name} (pid {before[name]}) exited with code {EXIT_UNHEALTHY}" in up.stderr()

    fault.step_fail_file.touch()  # every node's engine steps fail from now on
    try:
        # Each request, long enough to be prefilled remotely, fails a step on each node (the prefill
        # node's, then the decode node's local re-prefill); three in a row (the default bound) and a
        # node leaves.
        for _ in range(10):
            if all(exited(name) for name in before):
                break
            with contextlib.suppress(openai.APIError):
                ask(up, "Anyone there? " * 100)
        for name, pid in before.items():
            up.wait_for(f"{name} (pid {pid}) exited with code {EXIT_UNHEALTHY}", 60)
    finally:
        fault.step_fail_file.unlink()
    for name in before:
        up.wait_for(f"{name} is back", 180, count=2)  # the second time: the kill test brought it back once
    assert ask(up, "Back?").usage.completion_tokens > 0


def test_ctrl_c_stops_everything_in_order(up: UpCluster) -> None:
    started = up.processes()
    assert len(started) >= 6, started  # launcher, etcd wrapper, etcd, prefill, decode, frontend
    assert up.interrupt() == 0, up.stderr()[-3000:]
    log = up.stderr()
    order = [log.index(f"stopped {name}") for name in ("frontend-0", "decode-0", "prefill-0", "etcd")]
    assert order == sorted(order), log[-2000:]
    for name in ("frontend-0", "decode-0", "prefill-0", "etcd"):
        assert re.search(rf"stopped {name}\s+\(exit 0\)", log), log[-2000:]  # each drained and exited cleanly
    assert "registry: no key left" in log and "every process exited" in log
    assert up.processes() == {}, "no process of the cluster is left"
    assert up.targets() == [] and not (up.cluster_dir / "cluster.json").exists()

    # Independently of the launcher's own check: etcd, back on the cluster's data, holds no key of it.
    with EtcdServer(up.cluster_dir / "etcd", log_level="warn") as etcd:
        assert registry_keys(etcd.endpoints, up.cluster) == []
