"""Priority classes: a request's `priority` (an integer, lower first, or "interactive"/"batch") and its
tenant's, the tenant limit on tokens in flight, the frontend keeping in-flight room for interactive
requests; and, through a real decode node and the frontend under overload, interactive requests
starting ahead of a queue of batch work (the scheduler's and the reservation queue's order are shown in
tests/test_scheduler.py). How far interactive TTFT stays within its SLO is measured by
bench/priority.py; this suite asserts it only loosely."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pdserve.frontend.config import ConfigError
from pdserve.frontend.errors import APIError
from pdserve.frontend.limits import TenantLimiter
from pdserve.frontend.protocol import effective_priority, parse_chat_request
from pdserve.frontend.tenants import Tenant, TenantLimits, TenantTable
from pdserve.registry.etcd_server import free_port
from testing.cluster import LocalCluster
from testing.procs import FrontendProc, start_frontend

pytestmark = pytest.mark.timeout(300)


def _chat(**fields: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_priority_field_and_tenant_floor() -> None:
    assert parse_chat_request(_chat()).sampling.priority is None
    assert parse_chat_request(_chat(priority=-5)).sampling.priority == -5
    assert parse_chat_request(_chat(priority="batch")).sampling.priority == 10
    assert parse_chat_request(_chat(priority="interactive")).sampling.priority == 0
    for bad, code in (("urgent", "invalid_value"), (1.5, "invalid_type"), (True, "invalid_type"),
                      (1 << 40, "invalid_value")):
        with pytest.raises(APIError) as info:
            parse_chat_request(_chat(priority=bad))
        assert (info.value.param, info.value.code) == ("priority", code)
    # a request may be less urgent than its tenant, never more
    assert effective_priority(None, 10) == 10 and effective_priority(-5, 10) == 10
    assert effective_priority(20, 10) == 20 and effective_priority(-5, 0) == 0 and effective_priority(-5, -10) == -5


def test_tenants_file_priority(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - {name: web, keys_sha256: ['" + "a" * 64 + "']}\n"
                    "  - {name: etl, keys_sha256: ['" + "b" * 64 + "'], priority: batch, max_tokens_in_flight: 500}\n")
    table = TenantTable.from_file(path)
    by_name = {t.name: t for t in table.tenants}
    assert by_name["web"].priority == 0 and by_name["etl"].priority == 10
    assert by_name["etl"].limits.max_tokens_in_flight == 500
    path.write_text("tenants:\n  - {name: x, keys_sha256: ['" + "a" * 64 + "'], priority: soon}\n")
    with pytest.raises(ConfigError, match="priority"):
        TenantTable.from_file(path)


def test_tokens_in_flight_limit() -> None:
    lim = TenantLimiter()
    t = Tenant("t", frozenset({"*"}), TenantLimits(max_tokens_in_flight=100))
    first = lim.grant(t, 40, 30)
    with pytest.raises(APIError) as info:
        lim.grant(t, 20, 20)  # 70 + 40 > 100
    assert (info.value.status, info.value.code, info.value.limit) == (429, "tokens_in_flight_limit_exceeded",
                                                                      "tokens_in_flight")
    with pytest.raises(APIError) as info:
        lim.grant(t, 90, 20)  # can never fit
    assert info.value.code == "request_too_large"
    first.release(30)
    second = lim.grant(t, 20, 20)  # room again once the first ended
    second.release(5)
    assert lim.state(t).tokens_in_flight == 0


# --- through a decode node under overload ---------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    # Two running sequences at most: everything else queues, so the order of the queue decides TTFT.
    args = ["--num-threads", "1", "--num-kv-blocks", "256", "--block-size", "16", "--max-num-seqs", "2",
            "--model-name", "tiny-llama"]
    with LocalCluster(tmp_path_factory.mktemp("priority"), tiny_llama_dir, node_args=args) as c:
        c.start_etcd()
        c.wait_ready([c.spawn_node("decode", "d0")])
        c.wait_registry(lambda m: "d0" in m, timeout_s=30, what="the decode node")
        yield c
        c.wait_clean()


@pytest.fixture(scope="module")
def frontend(cluster: LocalCluster, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontendProc]:
    fe = start_frontend("frontend", tmp_path_factory.mktemp("priority-fe"), cluster.etcd_endpoints, free_port(),
                        "--cluster", cluster.cluster, "--model", f"tiny-llama={tiny_llama_dir}",
                        "--log-level", "warning", "--request-log", "off", ready=False)
    try:
        yield fe
    finally:
        assert fe.stop() == 0, fe.proc.tail()
        assert "Traceback" not in fe.proc.log_text(), fe.proc.tail(80)


def _ttft(client: openai.OpenAI, priority: str, max_tokens: int) -> float:
    start = time.perf_counter()
    stream = client.completions.create(model="tiny-llama", prompt="the cat sat on", max_tokens=max_tokens,
                                       stream=True, extra_body={"priority": priority, "ignore_eos": True})
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - start
    assert first is not None
    return first


def test_interactive_requests_start_ahead_of_a_batch_queue(frontend: FrontendProc, cluster: LocalCluster) -> None:
    client = openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key="sk-test", max_retries=0, timeout=120)
    batch: list[float] = []
    lock = threading.Lock()

    def run_batch() -> None:
        value = _ttft(client, "batch", 48)
        with lock:
            batch.append(value)

    threads = [threading.Thread(target=run_batch) for _ in range(12)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while cluster.get_load("d0").waiting < 6:  # the batch queue has formed on the node
        assert time.monotonic() < deadline, cluster.get_load("d0")
        time.sleep(0.05)  # the poll interval
    interactive = [_ttft(client, "interactive", 4) for _ in range(4)]
    for t in threads:
        t.join()
    assert len(batch) == 12
    # Loose: each interactive request started ahead of the queue of batch work, so its TTFT is well below
    # what the batch requests waited (bench/priority.py measures the figures).
    assert max(interactive) < statistics.median(batch), (interactive, sorted(batch))
