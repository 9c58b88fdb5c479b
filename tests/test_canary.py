"""Canary and rollback: two versions of one served model, each its own pool, behind one name, with routing
weights in the models file.

The version choice on its own (`ModelCatalog.rank`): requests without a session key split exactly by
weight; sessions stick to a version and a weight change moves only the sessions it must. Then through a
real cluster (etcd, one decode node per version, the frontend process, the openai SDK): 90/10 over 200
requests, keyed and not, lands within 5% of the split; rewriting the file with a weight of 0 moves all
new traffic without a restart; the frontend's and the nodes' metrics are labelled by version and pool.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.frontend.config import ConfigError, FrontendConfig, ModelSpec
from pdserve.frontend.models import ModelCatalog
from pdserve.registry.etcd_server import free_port
from testing.cluster import LocalCluster
from testing.procs import FrontendProc, start_frontend

pytestmark = pytest.mark.timeout(300)

NAME = "tiny-canary"


def _versions(model_dir: Path, w1: float, w2: float) -> tuple[ModelSpec, ...]:
    return (ModelSpec(name=NAME, path=str(model_dir), pool="tiny-v1", version="v1", weight=w1),
            ModelSpec(name=NAME, path=str(model_dir), pool="tiny-v2", version="v2", weight=w2))


def _models_yaml(model_dir: Path, w1: float, w2: float) -> str:
    return "models:\n" + "".join(
        f"  - {{name: {NAME}, version: {v}, pool: tiny-{v}, path: '{model_dir}', weight: {w}}}\n"
        for v, w in (("v1", w1), ("v2", w2)))


# --- the version choice ---------------------------------------------------------------------------


def test_without_a_session_key_the_split_is_exactly_the_weights(tiny_llama_dir: Path) -> None:
    catalog = ModelCatalog(_versions(tiny_llama_dir, 90, 10))
    model = catalog.resolve(NAME)
    firsts = [catalog.rank(model, None)[0].version for _ in range(200)]
    assert Counter(firsts) == {"v1": 180, "v2": 20}
    assert "v2" in firsts[:10]  # interleaved, not 180 then 20
    catalog.set_weights({(NAME, "v1"): 0.0})
    assert [v.version for v in catalog.rank(model, None)] == ["v2"]
    assert [v.version for v in catalog.rank(model, "user-1")] == ["v2"]
    catalog.set_weights({(NAME, "v2"): 0.0})
    assert catalog.rank(model, None) == []


def test_sessions_stick_and_a_weight_change_moves_only_the_sessions_it_must(tiny_llama_dir: Path) -> None:
    catalog = ModelCatalog(_versions(tiny_llama_dir, 90, 10))
    model = catalog.resolve(NAME)
    keys = [f"session-{i}" for i in range(2000)]
    before = {k: catalog.rank(model, k)[0].version for k in keys}
    assert all(catalog.rank(model, k)[0].version == before[k] for k in keys[:100])  # sticky
    assert abs(Counter(before.values())["v2"] / len(keys) - 0.10) < 0.03
    catalog.set_weights({(NAME, "v2"): 50.0})  # the canary grows: sessions only move v1 -> v2
    after = {k: catalog.rank(model, k)[0].version for k in keys}
    assert all(after[k] == "v2" for k in keys if before[k] == "v2")
    assert abs(Counter(after.values())["v2"] / len(keys) - 50 / 140) < 0.03


def test_versions_need_distinct_versions_and_pools(tiny_llama_dir: Path) -> None:
    a, b = _versions(tiny_llama_dir, 1, 1)
    with pytest.raises(ConfigError, match="used twice"):
        FrontendConfig(etcd_endpoints=("h:1",), models=(a, ModelSpec(name=NAME, path=a.path, pool="x")))
    with pytest.raises(ConfigError, match="own pool"):
        FrontendConfig(etcd_endpoints=("h:1",), models=(a, ModelSpec(name=NAME, path=a.path, pool=a.pool,
                                                                    version="v3")))
    with pytest.raises(ConfigError, match="aliases"):
        FrontendConfig(etcd_endpoints=("h:1",), models=(a, ModelSpec(name=NAME, path=b.path, pool=b.pool,
                                                                    version="v2", aliases=("other",))))
    with pytest.raises(ConfigError, match="weight"):
        ModelSpec(name=NAME, path=a.path, weight=-1)


# --- through a cluster ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    args = ["--num-threads", "1", "--num-kv-blocks", "128", "--block-size", "16"]
    with LocalCluster(tmp_path_factory.mktemp("canary"), tiny_llama_dir, node_args=args) as c:
        c.start_etcd()
        # v1's node is colocated (ready without prefill nodes); v2's is a plain decode node (not ready
        # without them, though it would prefill locally as a fallback).
        nodes = [c.spawn_node("decode", f"d-{v}", ["--model-name", f"tiny-{v}", *extra])
                 for v, extra in (("v1", ["--colocated"]), ("v2", []))]
        c.wait_ready(nodes)
        c.wait_registry(lambda m: {"d-v1", "d-v2"} <= m.keys(), timeout_s=30, what="both versions' nodes")
        yield c
        c.wait_clean()


@pytest.fixture(scope="module")
def models_file(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("canary-models") / "models.yaml"
    path.write_text(_models_yaml(tiny_llama_dir, 90, 10))
    return path


@pytest.fixture(scope="module")
def frontend(cluster: LocalCluster, models_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontendProc]:
    fe = start_frontend("frontend", tmp_path_factory.mktemp("canary-fe"), cluster.etcd_endpoints, free_port(),
                        "--cluster", cluster.cluster, "--models", str(models_file), "--log-level", "info",
                        "--request-log", "off")  # ready: v1's node is colocated
    try:
        yield fe
    finally:
        assert fe.stop() == 0, fe.proc.tail()
        assert "Traceback" not in fe.proc.log_text(), fe.proc.tail(80)


def test_a_colocated_pool_is_ready_without_prefill_nodes(frontend: FrontendProc) -> None:
    versions = httpx.get(f"{frontend.base_url}/ready", timeout=10).json()["models"][NAME]["versions"]
    assert versions["v1"]["ready"] is True and versions["v1"]["prefill"] == 0
    assert versions["v2"]["ready"] is False  # a plain decode node needs a prefill pool to count as ready


def _requests_by_version(fe: FrontendProc) -> Counter[str]:
    text = httpx.get(f"{fe.base_url}/metrics", timeout=10).text
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name == "pdserve_frontend_requests":
            for s in family.samples:
                if s.name.endswith("_total") and s.labels["model"] == NAME:
                    out[s.labels["version"]] += int(s.value)
    return out


def _weights(fe: FrontendProc) -> dict[str, float]:
    text = httpx.get(f"{fe.base_url}/metrics", timeout=10).text
    return {s.labels["version"]: s.value for family in text_string_to_metric_families(text)
            if family.name == "pdserve_frontend_model_weight" for s in family.samples}


def _send(fe: FrontendProc, count: int, keyed: bool) -> Counter[str]:
    """Sends `count` requests (each with its own session key when `keyed`); the versions that served them."""
    client = openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key="sk-test", max_retries=0)
    before = _requests_by_version(fe)

    def one(i: int) -> None:
        r = client.completions.create(model=NAME, prompt="hello", max_tokens=1, user=f"user-{i}" if keyed else None)
        assert r.model == NAME and r.choices[0].finish_reason in ("stop", "length")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(count)))
    return _requests_by_version(fe) - before


@pytest.mark.parametrize("keyed", [False, True], ids=["no-session", "sessions"])
def test_ninety_ten_over_two_hundred_requests(frontend: FrontendProc, cluster: LocalCluster, keyed: bool) -> None:
    served = _send(frontend, 200, keyed)
    assert sum(served.values()) == 200
    assert abs(served["v2"] / 200 - 0.10) <= 0.05, served
    if not keyed:
        assert served == {"v1": 180, "v2": 20}
    # both versions' nodes generated their share (one token per request), under their own pool label
    for v in ("v1", "v2"):
        assert cluster.metric(f"d-{v}", "pdserve_decode_tokens_total", model=f"tiny-{v}") >= served[v]


def test_weight_zero_moves_all_new_traffic_without_a_restart(
        frontend: FrontendProc, models_file: Path, tiny_llama_dir: Path) -> None:
    pid = frontend.proc.popen.pid
    models_file.write_text(_models_yaml(tiny_llama_dir, 90, 0))  # roll the canary back
    deadline = time.monotonic() + 15
    while _weights(frontend).get("v2") != 0.0:
        assert time.monotonic() < deadline, _weights(frontend)
        time.sleep(0.1)  # the poll interval
    assert _send(frontend, 30, keyed=False) == {"v1": 30}
    assert _send(frontend, 30, keyed=True) == {"v1": 30}
    models_file.write_text(_models_yaml(tiny_llama_dir, 0, 100))  # promote it
    while _weights(frontend).get("v1") != 0.0:
        assert time.monotonic() < deadline + 15, _weights(frontend)
        time.sleep(0.1)  # the poll interval
    assert _send(frontend, 30, keyed=True) == {"v2": 30}
    ready = httpx.get(f"{frontend.base_url}/ready", timeout=10).json()["models"][NAME]
    assert ready["versions"]["v1"]["weight"] == 0 and ready["versions"]["v2"]["weight"] == 100
    models = httpx.get(f"{frontend.base_url}/v1/models", headers={"authorization": "Bearer sk-test"},
                       timeout=10).json()["data"]
    assert [(v["version"], v["pool"], v["weight"]) for v in models[0]["versions"]] == [
        ("v1", "tiny-v1", 0.0), ("v2", "tiny-v2", 100.0)]
    assert frontend.proc.popen.pid == pid and frontend.proc.popen.poll() is None
