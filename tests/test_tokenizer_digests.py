"""Tokenizer and chat template digests: the same files give the same digests in every process, a changed
tokenizer or template changes its own digest; nodes publish them, and the frontend keeps a node whose
digests differ from its own out of the pool (real etcd, and a real cluster of tiny-model nodes)."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.deploy.status import StatusConfig, collect
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.version import NO_CHAT_TEMPLATE, chat_template_digest, tokenizer_digest
from pdserve.frontend.config import ModelSpec
from pdserve.frontend.metrics import FrontendMetrics
from pdserve.frontend.models import ModelCatalog
from pdserve.frontend.pool_members import Digests, PoolMembers, mismatches
from pdserve.registry import EtcdServer, NodeCapacity, NodeRecord, NodeRegistration, RegistryView
from pdserve.registry.etcd_server import free_port
from pdserve.registry.records import SCHEMA_VERSION
from testing.cluster import LocalCluster
from testing.procs import FrontendProc, start_frontend
from testing.waits import wait_until, wait_until_async

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-llama"
NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "256", "--block-size", "16",
             "--model-name", MODEL]

pytestmark = pytest.mark.timeout(300)


def model_variant(src: Path, dst: Path, *, drop_merges: int = 0, template: str | None = None) -> Path:
    """A copy of the model directory `src` at `dst` (weights linked, not copied) whose tokenizer lacks its
    last `drop_merges` BPE merges, and whose chat template is `template` when given."""
    dst.mkdir(parents=True)
    for item in src.iterdir():
        if item.name == "model.safetensors":
            (dst / item.name).symlink_to(item.resolve())
        else:
            shutil.copy(item, dst / item.name)
    if drop_merges:
        tok = json.loads((dst / "tokenizer.json").read_text())
        tok["model"]["merges"] = tok["model"]["merges"][:-drop_merges]
        (dst / "tokenizer.json").write_text(json.dumps(tok))
    if template is not None:
        (dst / "chat_template.jinja").write_text(template)
    return dst


OTHER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


def digests_of(path: Path) -> tuple[str, str]:
    tok = Tokenizer(path)
    return tokenizer_digest(tok), chat_template_digest(tok.chat_template)


# --- the digests ----------------------------------------------------------------------------------------


def test_digests_are_the_same_in_another_process_and_in_the_frontends_catalog(tiny_llama_dir: Path) -> None:
    code = ("import sys; from pdserve.engine.tokenizer import Tokenizer\n"
            "from pdserve.engine.version import chat_template_digest, tokenizer_digest\n"
            "t = Tokenizer(sys.argv[1]); print(tokenizer_digest(t), chat_template_digest(t.chat_template))")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_llama_dir)], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True)
    here = digests_of(tiny_llama_dir)
    assert tuple(out.stdout.split()) == here
    assert all(len(d) == 16 and int(d, 16) >= 0 for d in here)
    served = ModelCatalog((ModelSpec(MODEL, str(tiny_llama_dir)),)).models[0]
    assert (served.tokenizer_digest, served.chat_template_digest) == here


def test_a_changed_tokenizer_or_template_changes_its_own_digest(tiny_llama_dir: Path, tmp_path: Path) -> None:
    tok, template = digests_of(tiny_llama_dir)
    merges = digests_of(model_variant(tiny_llama_dir, tmp_path / "merges", drop_merges=1))
    assert merges[0] != tok and merges[1] == template
    other = digests_of(model_variant(tiny_llama_dir, tmp_path / "template", template=OTHER_TEMPLATE))
    assert other[0] == tok and other[1] != template
    eos = model_variant(tiny_llama_dir, tmp_path / "eos")  # another stop token: generation differs
    gen = json.loads((eos / "generation_config.json").read_text())
    (eos / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": 2}))
    assert digests_of(eos)[0] != tok
    assert chat_template_digest(None) == NO_CHAT_TEMPLATE != chat_template_digest("none")


# --- records and the frontend's check, on a real etcd ---------------------------------------------------


def record(node_id: str, tok: str = "", template: str = "", role: str = "prefill") -> NodeRecord:
    return NodeRecord(role=role, node_id=node_id, cluster="c-digests", grpc_address="127.0.0.1:1",  # type: ignore[arg-type]
                      kv_address="127.0.0.1:2", model=MODEL, model_fingerprint="fp", dtype="float32", block_size=16,
                      prefix_hash_seed=0, capacity=NodeCapacity(128, 8, 512), tokenizer_digest=tok,
                      chat_template_digest=template)


def test_records_carry_the_digests_and_older_records_read_as_unknown() -> None:
    rec = record("p0", "a" * 16, "b" * 16)
    assert NodeRecord.from_json(rec.to_json()) == rec
    older = {k: v for k, v in json.loads(rec.to_json()).items() if not k.endswith("_digest")}
    assert older["schema"] == SCHEMA_VERSION
    read = NodeRecord.from_json(json.dumps(older))
    assert (read.tokenizer_digest, read.chat_template_digest) == ("", "")
    expected = Digests("a" * 16, "b" * 16)
    assert mismatches(read, expected) == []  # unknown is not a mismatch
    assert mismatches(record("p1", "c" * 16, "d" * 16), expected) == [
        ("tokenizer", "c" * 16, "a" * 16), ("chat_template", "d" * 16, "b" * 16)]


def excluded_gauge(metrics: FrontendMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("pdserve_frontend_nodes_excluded", {
        "pool": "frontend", "node": "fe", "model_pool": MODEL, "reason": reason})
    assert value is not None
    return value


def test_pool_members_exclude_a_mismatched_node_until_it_matches(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    good = Digests("1" * 16, "2" * 16)

    async def scenario(endpoints: list[str]) -> None:
        view = RegistryView(endpoints, "c-digests")
        metrics = FrontendMetrics("fe")
        members = PoolMembers(view, {MODEL: good}, metrics)
        view.subscribe(members.on_change)
        await view.start()
        regs = [NodeRegistration(endpoints, rec, ttl_s=2) for rec in (
            record("p-good", good.tokenizer, good.chat_template), record("p-old"),
            record("p-odd", "f" * 16, good.chat_template), record("d-odd", good.tokenizer, "e" * 16, "decode"))]
        for reg in regs:
            await reg.start()
        try:
            await wait_until_async(lambda: len(view.members()) == 4, 10, "four members")
            assert [m.node_id for m in members.members("prefill", MODEL)] == ["p-good", "p-old"]
            assert members.members("decode", MODEL) == []
            assert members.excluded() == {"p-odd": "tokenizer", "d-odd": "chat_template"}
            assert (excluded_gauge(metrics, "tokenizer"), excluded_gauge(metrics, "chat_template")) == (1, 1)
            await regs[2].close()  # p-odd comes back with the frontend's tokenizer
            fixed = NodeRegistration(endpoints, record("p-odd", good.tokenizer, good.chat_template), ttl_s=2)
            await fixed.start()
            regs[2] = fixed
            await wait_until_async(lambda: "p-odd" not in members.excluded() and view.get("p-odd") is not None, 10,
                                   "p-odd back in the pool")
            assert [m.node_id for m in members.members(None, MODEL)] == ["p-good", "p-odd", "p-old"]
            await wait_until_async(lambda: excluded_gauge(metrics, "tokenizer") == 0, 10, "gauge back to 0")
            assert excluded_gauge(metrics, "chat_template") == 1
        finally:
            for reg in regs:
                await reg.close()
            await view.close()

    caplog.set_level(logging.INFO, logger="pdserve.frontend.pool_members")
    with EtcdServer(tmp_path / "etcd") as etcd:
        asyncio.run(scenario(etcd.endpoints))
    lines = [r.getMessage() for r in caplog.records]
    odd = [line for line in lines if "p-odd" in line and "excluded" in line]
    assert odd == [f"prefill node p-odd of model pool {MODEL!r} excluded (not routed to): its tokenizer digest "
                   f"{'f' * 8} differs from the frontend's {'1' * 8}; restart it with the frontend's tokenizer and "
                   "chat template to bring it back"]
    assert any("d-odd" in line and f"chat template digest {'e' * 8} differs" in line for line in lines)
    assert any("p-old" in line and "publishes no tokenizer or chat template digest" in line for line in lines)
    assert any("p-odd" in line and "back in the pool:" in line for line in lines)


# --- a real cluster -------------------------------------------------------------------------------------


def frontend_metric(fe: FrontendProc, name: str, **labels: str) -> float:
    text = httpx.get(f"{fe.base_url}/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def excluded(fe: FrontendProc, reason: str) -> float:
    return frontend_metric(fe, "pdserve_frontend_nodes_excluded", model_pool=MODEL, reason=reason)


def serve_a_mix(base_url: str, tag: str) -> None:
    """Chat, completions, responses and embeddings requests, each with its own prompt."""
    with httpx.Client(base_url=base_url, timeout=120, headers={"authorization": "Bearer sk-any"}) as client:
        calls = [("/v1/chat/completions", {"messages": [{"role": "user", "content": f"{tag} chat {i}"}]})
                 for i in range(4)]
        calls += [("/v1/completions", {"prompt": f"{tag} completion {i}"}) for i in range(2)]
        calls += [("/v1/responses", {"input": f"{tag} response", "max_output_tokens": 3}),
                  ("/v1/embeddings", {"input": [f"{tag} embedding"]})]
        for path, body in calls:
            extra = {} if path in ("/v1/responses", "/v1/embeddings") else {"max_tokens": 3}
            resp = client.post(path, json={"model": MODEL, **body, **extra})
            assert resp.status_code == 200, (path, resp.text)


@pytest.fixture(scope="module")
def odd_models(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("odd-models")
    return {"merges": model_variant(tiny_llama_dir, tmp / "merges", drop_merges=1),
            "template": model_variant(tiny_llama_dir, tmp / "template", template=OTHER_TEMPLATE)}


@pytest.fixture
def cluster(tmp_path: Path, tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path / "cluster", tiny_llama_dir, node_args=NODE_ARGS) as c:
        yield c


def test_a_node_with_another_tokenizer_or_template_is_never_routed_to(
    cluster: LocalCluster, odd_models: dict[str, Path], tmp_path: Path, tiny_llama_dir: Path,
) -> None:
    frontend_digests = digests_of(tiny_llama_dir)
    cluster.start_etcd()
    # Every prompt is prefilled remotely, so each request picks a prefill node as well as a decode node.
    decode_args = ["--local-prefill-threshold", "0"]
    nodes = [cluster.spawn_node("prefill", "p0"), cluster.spawn_node("decode", "d0", decode_args),
             cluster.spawn_node("prefill", "p-odd", ["--model", str(odd_models["template"])]),
             cluster.spawn_node("decode", "d-odd", ["--model", str(odd_models["merges"]), *decode_args])]
    cluster.wait_ready(nodes)
    fe = start_frontend("frontend", tmp_path, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                        "--model", f"{MODEL}={tiny_llama_dir}")
    try:
        wait_until(lambda: excluded(fe, "tokenizer") == 1 and excluded(fe, "chat_template") == 1, 30,
                   "both odd nodes excluded", interval_s=0.2)
        ready = httpx.get(f"{fe.base_url}/ready").json()["models"][MODEL]
        assert (ready["prefill"], ready["decode"]) == (1, 1)
        # `pdserve status` (the registry's view) marks the two nodes whose digests differ from the others'.
        status = collect(StatusConfig(cluster=cluster.cluster, etcd_endpoints=tuple(cluster.etcd_endpoints)))
        assert {n.node_id for n in status.nodes if n.digests_differ} == {"p-odd", "d-odd"}
        assert {n.tokenizer_digest for n in status.nodes if n.node_id in ("p0", "d0", "p-odd")} == {
            frontend_digests[0]}
        serve_a_mix(fe.base_url, "first")
        assert cluster.metric("p-odd", "pdserve_prefill_tokens_total") == 0
        assert cluster.metric("p-odd", "pdserve_embedding_requests_total") == 0
        assert cluster.metric("d-odd", "pdserve_decode_tokens_total") == 0
        assert cluster.metric("p0", "pdserve_prefill_tokens_total") > 0
        assert cluster.metric("p0", "pdserve_embedding_requests_total") == 1
        assert cluster.metric("d0", "pdserve_decode_tokens_total") > 0
        log = fe.proc.log_text()
        assert f"decode node d-odd of model pool {MODEL!r} excluded (not routed to): its tokenizer digest" in log
        assert f"prefill node p-odd of model pool {MODEL!r} excluded (not routed to): its chat template digest" in log

        # Restarted with the frontend's tokenizer, d-odd joins the pool and takes work again.
        cluster.kill("d-odd", signal.SIGTERM)
        cluster.wait_ready([cluster.spawn_node("decode", "d-odd", decode_args)])
        wait_until(lambda: excluded(fe, "tokenizer") == 0, 30, "d-odd back in the pool", interval_s=0.2)
        assert "decode node d-odd of model pool 'tiny-llama' back in the pool" in fe.proc.log_text()
        assert excluded(fe, "chat_template") == 1
        deadline = time.monotonic() + 60
        while cluster.metric("d-odd", "pdserve_decode_tokens_total") == 0:
            assert time.monotonic() < deadline, "the restarted d-odd got no request"
            serve_a_mix(fe.base_url, "again")
        assert cluster.metric("p-odd", "pdserve_prefill_tokens_total") == 0
        cluster.wait_clean()
        assert fe.stop() == 0 and "Traceback" not in fe.proc.log_text(), fe.proc.tail(80)
    finally:
        fe.stop()
