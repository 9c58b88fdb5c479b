"""Routing by exact cached prefix through real processes: etcd, two colocated decode nodes with KV tiers,
and frontends that index the nodes' KV event streams (frontend.kv_index).

- a conversation's next turn goes to the decode node holding its history (the request log's route says
  why) and is served from its cache, while new conversations spread over both nodes;
- greedy tokens are the same with exact routing on and off (`--no-kv-routing`);
- event-stream faults: a frontend restarted resyncs from snapshots; a node restarted (a new epoch) is
  resynced, with its warm tier's blocks; a lost batch (a gap) makes the watcher reopen the stream from
  nothing; routing stays exact after each; every KV block (pool and tier) accounted for after each test.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from pdserve.frontend.kv_index import KVIndex, KVWatcher
from pdserve.registry import RegistryView
from pdserve.registry.etcd_server import free_port
from pdserve.rpc import RpcSecurity
from testing.cluster import LocalCluster
from testing.procs import FrontendProc, start_frontend

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("check_integrity_after_each_test")]

MODEL = "tiny"
BLOCK = 16
NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "256", "--block-size", str(BLOCK),
             "--model-name", MODEL, "--colocated"]


def turn(conversation: int, turns: int) -> list[int]:
    """A conversation's prompt after `turns` turns: each turn appends 2 blocks and a bit."""
    return [(conversation * 7919 + i * 104729) % 3000 + 3 for i in range(turns * (2 * BLOCK + 3) + BLOCK)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("kv-routing")
    with LocalCluster(tmp / "cluster", model_dir, node_args=NODE_ARGS) as c:
        c.start_etcd()
        nodes = [c.spawn_node("decode", f"d{i}", ["--kv-tier-dir", str(tmp / f"tier-d{i}")]) for i in range(2)]
        c.wait_ready(nodes)
        c.wait_registry(lambda m: {"d0", "d1"} <= m.keys(), timeout_s=30, what="both nodes")
        yield c
        c.wait_clean()


def frontend(cluster: LocalCluster, model_dir: Path, name: str, *args: str) -> FrontendProc:
    tmp = cluster.workdir.parent
    return start_frontend(name, tmp, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster, "--model",
                          f"{MODEL}={model_dir}", "--request-log", str(tmp / f"{name}.jsonl"), "--log-level",
                          "warning", *args)


@pytest.fixture(scope="module")
def fe(cluster: LocalCluster, model_dir: Path) -> Iterator[FrontendProc]:
    proc = frontend(cluster, model_dir, "frontend")
    yield proc
    assert proc.stop() == 0, proc.proc.tail()


def complete(fe: FrontendProc, prompt: list[int]) -> dict[str, Any]:
    r = httpx.post(f"{fe.base_url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 6,
                                                          "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def route_of(cluster: LocalCluster, name: str, request_id: str) -> dict[str, Any]:
    """The first route the request log of frontend `name` records for `request_id`."""
    log = cluster.workdir.parent / f"{name}.jsonl"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for line in log.read_bytes().splitlines():
            rec = orjson.loads(line)
            if rec.get("request_id") == request_id:
                return rec["routes"][0]
        time.sleep(0.05)
    raise AssertionError(f"{request_id} not in the request log")


def next_turn_is_exact(cluster: LocalCluster, fe: FrontendProc, name: str, conversation: int, turns: int) -> str:
    """Serves turn `turns` after turn `turns - 1`; asserts it went to the node holding the history, from
    its cache. Returns that node."""
    first = complete(fe, turn(conversation, turns - 1))
    holder = route_of(cluster, name, first["id"])["decode_node"]
    time.sleep(0.3)  # the holder's events reach the index (streams poll every 50 ms)
    second = complete(fe, turn(conversation, turns))
    route = route_of(cluster, name, second["id"])
    assert route["decode_node"] == holder and "cached prefix" in route["decode_reason"], route
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(turn(conversation, turns - 1)) // BLOCK * BLOCK - BLOCK
    return holder


def test_a_conversations_next_turn_goes_where_its_history_is(cluster: LocalCluster, fe: FrontendProc) -> None:
    holders = [next_turn_is_exact(cluster, fe, "frontend", conv, 2) for conv in range(6)]
    assert set(holders) == {"d0", "d1"}, holders  # new conversations spread: nothing holds them yet


def test_greedy_tokens_are_the_same_with_exact_routing_off(cluster: LocalCluster, fe: FrontendProc,
                                                           model_dir: Path) -> None:
    off = frontend(cluster, model_dir, "frontend-off", "--no-kv-routing")
    try:
        for conv in (10, 11):
            for turns in (1, 2, 3):
                a = complete(fe, turn(conv, turns))["choices"][0]["text"]
                b = complete(off, turn(conv, turns))["choices"][0]["text"]
                assert a == b
    finally:
        assert off.stop() == 0, off.proc.tail()


def test_a_restarted_frontend_resyncs_and_routes_exactly(cluster: LocalCluster, model_dir: Path) -> None:
    first = frontend(cluster, model_dir, "frontend-a")
    try:
        complete(first, turn(20, 1))
    finally:
        assert first.stop() == 0
    again = frontend(cluster, model_dir, "frontend-b")  # knows nothing: snapshots from both nodes
    try:
        time.sleep(0.5)
        second = complete(again, turn(20, 2))
        route = route_of(cluster, "frontend-b", second["id"])
        assert "cached prefix" in route["decode_reason"], route
    finally:
        assert again.stop() == 0


def test_a_restarted_node_is_resynced_with_its_warm_tier(cluster: LocalCluster, fe: FrontendProc) -> None:
    holder = next_turn_is_exact(cluster, fe, "frontend", 30, 2)
    cluster.kill(holder, signal.SIGTERM)
    tmp = cluster.workdir.parent
    node = cluster.spawn_node("decode", holder, ["--kv-tier-dir", str(tmp / f"tier-{holder}")])
    cluster.wait_ready([node])
    time.sleep(1.5)  # the frontend's view and its stream to the new epoch
    third = complete(fe, turn(30, 3))
    route = route_of(cluster, "frontend", third["id"])
    assert route["decode_node"] == holder and "tier blocks" in route["decode_reason"], route
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # read back from its tier


def test_a_lost_batch_makes_the_watcher_resync(cluster: LocalCluster, fe: FrontendProc) -> None:
    """A watcher of the frontend's kind against the real nodes: a batch whose number skips one (a lost
    event) resets the node's entry and reopens the stream from a snapshot."""
    complete(fe, turn(40, 1))

    async def run() -> None:
        view = RegistryView(cluster.etcd_endpoints, cluster.cluster)
        await view.start(sync_timeout_s=10)
        index = KVIndex()
        watcher = KVWatcher(view, index, RpcSecurity.from_env())
        view.subscribe(watcher.on_change)
        watcher.start()
        try:
            for _ in range(100):
                if all(index.cursor(n)[0] for n in ("d0", "d1")):
                    break
                await asyncio.sleep(0.05)
            held = {n: index.holds(n) for n in ("d0", "d1")}
            assert sum(held.values()) > 0
            resyncs = index.resyncs
            for n in ("d0", "d1"):
                index.nodes[n].seq -= 1  # the next batch of each now looks like it skipped one
            for conv in (41, 42, 43, 44):  # events on both nodes (new conversations spread)
                await asyncio.to_thread(complete, fe, turn(conv, 2))
            for _ in range(200):
                if index.gaps >= 2 and all(index.cursor(n)[0] for n in ("d0", "d1")):
                    break
                await asyncio.sleep(0.05)
            assert index.gaps >= 2 and index.resyncs >= resyncs + 2, (index.gaps, index.resyncs)
            # resynced: what the index holds for each node is what the node holds
            for n in ("d0", "d1"):
                assert index.holds(n) > 0
        finally:
            await watcher.close()
            await view.close()

    asyncio.run(run())
