"""Exact routing and KV tiers through a disaggregated pool (1 prefill + 2 decode nodes, each with a tier):
a conversation's turns give the same greedy text through a frontend routing by exact cached prefix as
through one with `--no-kv-routing`, the exact frontend's later turns are served from cache, and every KV
block (pool and tier) is accounted for after."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.registry.etcd_server import free_port
from testing.cluster import LocalCluster
from testing.procs import FrontendProc, start_frontend

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("check_integrity_after_each_test")]

MODEL = "tiny"
NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "64", "--block-size", "16",
             "--model-name", MODEL]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("kv-routing-disagg")
    with LocalCluster(tmp / "cluster", model_dir, node_args=NODE_ARGS) as c:
        c.start_etcd()
        nodes = [c.spawn_node("prefill", "p0", ["--kv-tier-dir", str(tmp / "tier-p0")])]
        nodes += [c.spawn_node("decode", f"d{i}", ["--kv-tier-dir", str(tmp / f"tier-d{i}"),
                                                   "--local-prefill-threshold", "0"]) for i in range(2)]
        c.wait_ready(nodes)
        c.wait_registry(lambda m: {"p0", "d0", "d1"} <= m.keys(), timeout_s=30, what="every node")
        for node in ("d0", "d1"):  # each decode node learns of p0 through its registry watch
            deadline = time.monotonic() + 30
            while "p0" not in c.get_load(node).members and time.monotonic() < deadline:
                time.sleep(0.1)
        yield c
        c.wait_clean()


def frontend(cluster: LocalCluster, model_dir: Path, name: str, *args: str) -> FrontendProc:
    return start_frontend(name, cluster.workdir.parent, cluster.etcd_endpoints, free_port(), "--cluster",
                          cluster.cluster, "--model", f"{MODEL}={model_dir}", "--request-log", "off", "--log-level",
                          "warning", *args)


def chat(fe: FrontendProc, messages: list[dict[str, str]]) -> tuple[str, int]:
    r = httpx.post(f"{fe.base_url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_turns_give_the_same_text_with_exact_routing_on_and_off(cluster: LocalCluster, model_dir: Path) -> None:
    on, off = frontend(cluster, model_dir, "fe-on"), frontend(cluster, model_dir, "fe-off", "--no-kv-routing")
    try:
        for conv in range(3):
            history: list[dict[str, str]] = [{"role": "system", "content": f"Conversation {conv}. " + "words " * 60}]
            cached_later = []
            for t in range(4):
                history.append({"role": "user", "content": f"question {t} of {conv}: " + "more " * 20})
                text_on, cached = chat(on, history)
                text_off, _ = chat(off, history)
                assert text_on == text_off, (conv, t)
                history.append({"role": "assistant", "content": text_on})
                if t:
                    cached_later.append(cached)
                time.sleep(0.2)  # the nodes' events reach the index
            assert min(cached_later) > 0, cached_later  # later turns found their history
    finally:
        assert on.stop() == 0 and off.stop() == 0
