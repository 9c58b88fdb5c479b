"""The web console (frontend.console, frontend.console_routes, frontend/static/): its numbers, its access
rules, and its pages in a real browser (Debian's chromium driven by Playwright) against a real 1 prefill +
1 decode cluster of the tiny model.

- the cluster page lists both nodes; a node killed mid-test turns unhealthy or leaves the page within
  `STOP_BOUND_S`;
- a chat sent from the playground streams the API's greedy answer for the same request, and its
  waterfall's stages before the first token sum to its TTFT within 5%;
- a tenant key sees only its own requests (page and API); a wrong key gets the login prompt, no data;
- each page is screenshotted (desktop and phone size) into the artefacts folder;
- the history's quantiles are Prometheus' histogram_quantile of the interval, its memory a fixed ring.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from pdserve.frontend.config import FrontendConfig, ModelSpec
from pdserve.frontend.console import STALE_LOAD_S, bucket_quantile
from pdserve.frontend.pipeline import Frontend
from pdserve.frontend.tenants import hash_key
from pdserve.registry.etcd_server import free_port
from testing.browser import launch_browser, screenshot
from testing.cluster import LocalCluster
from testing.procs import FrontendProc, start_frontend
from testing.waits import wait_until

pytestmark = pytest.mark.timeout(600)
on_cluster = pytest.mark.usefixtures("check_integrity_after_each_test")  # every KV block accounted for after each test

MODEL = "tiny-llama"
NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "256", "--block-size", "16",
             "--model-name", MODEL]
KEYS = {"ops": "sk-ops-0123456789abcdef", "alpha": "sk-alpha-0123456789abcdef", "beta": "sk-beta-0123456789abcdef"}
# A killed node's load reports stop: the page shows it unhealthy once the last one is STALE_LOAD_S old
# (reports come every second, the page polls every second), and drops it when its 5 s lease expires.
STOP_BOUND_S = STALE_LOAD_S + 3.0
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


# --- the history's numbers (no cluster) ------------------------------------------------------------


def test_bucket_quantile_interpolates_like_prometheus() -> None:
    inf = math.inf
    # 10 observations: 4 in (0, 0.1], 4 in (0.1, 0.2], 2 in (0.2, +Inf)
    buckets = [(0.1, 4.0), (0.2, 8.0), (inf, 10.0)]
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.1 + 0.1 * (5 - 4) / 4)
    assert bucket_quantile(0.2, buckets) == pytest.approx(0.1 * 2 / 4)
    assert bucket_quantile(0.95, buckets) == 0.2  # in the +Inf bucket: its lower bound
    assert bucket_quantile(0.5, [(0.1, 0.0), (inf, 0.0)]) is None
    assert bucket_quantile(0.5, []) is None


@pytest.fixture(scope="module")
def offline_frontend(tiny_llama_dir: Path) -> Iterator[Frontend]:
    config = FrontendConfig(etcd_endpoints=("127.0.0.1:1",), models=(ModelSpec(MODEL, str(tiny_llama_dir)),),
                            request_log=None, prepare_workers=1)
    fe = Frontend(config)  # its registry view is never started: a cluster without nodes
    try:
        yield fe
    finally:
        fe.workers.close()


def test_history_takes_interval_quantiles_from_the_metrics_and_keeps_a_fixed_ring(offline_frontend: Frontend) -> None:
    from pdserve.frontend.console import ConsoleHistory

    fe = offline_frontend
    history = ConsoleHistory(fe, interval_s=2.0, history_s=20.0)
    assert history.capacity == 10
    model = fe.catalog.all_versions[0]
    ttft = fe.metrics.ttft.labels(*fe.metrics.labels(model))
    tokens = fe.metrics.tokens.labels(*fe.metrics.labels(model), "t", "completion")
    t = 1000.0
    history.sample(now=t)  # the baseline
    for i in range(25):
        for v in (0.003, 0.004, 0.2) if i % 2 else (0.03,):
            ttft.observe(v)
        tokens.inc(10)
        t += 2.0
        history.sample(now=t)
    ring = history.samples[model.pool]
    assert len(ring) == 10, "a fixed ring: the oldest samples drop out"
    last = ring[-1]  # i = 24: one observation of 0.03 s, in (0.025, 0.05]
    assert last.ttft_p50 == pytest.approx(0.025 + 0.025 * 0.5)
    before = ring[-2]  # i = 23: 0.003 and 0.004 in (0.0025, 0.005], 0.2 in (0.1, 0.25]
    assert before.ttft_p50 == pytest.approx(0.0025 + 0.0025 * 1.5 / 2)
    assert before.ttft_p95 == pytest.approx(0.1 + 0.15 * (2.85 - 2) / 1)
    assert last.tokens_per_s == pytest.approx(5.0)
    series = history.series(since=ring[-3].t)
    assert series["pools"][model.pool]["t"] == [ring[-2].t, ring[-1].t]
    assert series["history_s"] == 20.0


def test_recent_requests_are_bounded_in_count_and_bytes_and_filtered_by_tenant() -> None:
    from pdserve.frontend.console import RecentRequests
    from pdserve.frontend.tenants import Tenant, TenantLimits

    alpha, ops = Tenant("alpha", frozenset({"*"}), TenantLimits()), Tenant("ops", frozenset(), TenantLimits(), operator=True)
    recent = RecentRequests(capacity=5, max_bytes=4000)
    for i in range(8):
        recent.add({"request_id": f"r{i}", "tenant": ("alpha", "beta")[i % 2], "prompt": "x" * 10})
    assert len(recent) == 5 and [rid for rid, _ in recent.visible(ops)] == ["r7", "r6", "r5", "r4", "r3"]
    assert [rid for rid, _ in recent.visible(alpha)] == ["r6", "r4"]
    assert recent.find(alpha, "r5") is None and orjson.loads(recent.find(ops, "r5"))["tenant"] == "beta"
    recent.add({"request_id": "big", "tenant": "alpha", "prompt": "y" * 3500})  # a logged prompt
    assert recent.bytes <= 4000 and [rid for rid, _ in recent.visible(ops)][:2] == ["big", "r7"]
    assert sum(len(data) for _, data in recent.visible(ops)) == recent.bytes
    recent.add({"request_id": "huge", "tenant": "alpha", "prompt": "z" * 9000})  # alone over the bound: kept alone
    assert [rid for rid, _ in recent.visible(ops)] == ["huge"]


# --- a real cluster in a real browser --------------------------------------------------------------


@dataclass(eq=False)
class Env:
    cluster: LocalCluster
    frontend: FrontendProc
    tmp: Path

    @property
    def url(self) -> str:
        return self.frontend.base_url

    def client(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=120)

    def api(self, path: str, tenant: str | None) -> httpx.Response:
        headers = {"authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
        return httpx.get(f"{self.url}{path}", headers=headers, timeout=30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("console")
    with LocalCluster(tmp / "cluster", tiny_llama_dir, node_args=NODE_ARGS) as c:
        # Threshold 0: every prompt is prefilled on the prefill node, so each request crosses both pools.
        c.start(1, 1, decode_args=["--local-prefill-threshold", "0"])
        yield c
        c.wait_clean()  # every KV block on every node is accounted for


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with launch_browser() as b:
        yield b


@pytest.fixture(scope="module")
def env(cluster: LocalCluster, tiny_llama_dir: Path) -> Iterator[Env]:
    tmp = cluster.workdir.parent
    tenants = tmp / "tenants.yaml"
    tenants.write_bytes(orjson.dumps({"tenants": [
        {"name": "ops", "keys_sha256": [hash_key(KEYS["ops"])], "operator": True},
        {"name": "alpha", "keys_sha256": [hash_key(KEYS["alpha"])]},
        {"name": "beta", "keys_sha256": [hash_key(KEYS["beta"])]},
    ]}))
    fe = start_frontend("frontend", tmp, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                        "--model", f"{MODEL}={tiny_llama_dir}", "--tenants", str(tenants), "--request-log",
                        str(tmp / "requests.jsonl"), "--log-level", "warning")
    try:
        yield Env(cluster, fe, tmp)
    finally:
        assert fe.stop() == 0, fe.proc.tail()
        assert "Traceback" not in fe.proc.log_text(), fe.proc.tail(80)


def open_console(browser: Any, env: Env, tenant: str | None, hash_: str = "", viewport: dict[str, int] = DESKTOP) -> Any:
    """A new page on the console signed in with `tenant`'s key (None: signed out), at `#hash_`."""
    page = browser.new_context(viewport=viewport).new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.console_errors = errors
    page.goto(f"{env.url}/console#{hash_}")
    page.wait_for_selector("#login:not([hidden])")
    if tenant is not None:
        page.fill("#login-key", KEYS[tenant])
        page.press("#login-key", "Enter")
        page.wait_for_selector("#nav:not([hidden])")
    return page


def close(page: Any) -> None:
    errors = page.console_errors
    page.context.close()
    assert not errors, f"errors in the page's scripts: {errors}"


def node_rows(page: Any) -> dict[str, str]:
    """node id -> health shown on the cluster page."""
    return page.eval_on_selector_all("#cluster-pools tr[data-node-id]",
                                     "rows => Object.fromEntries(rows.map(r => [r.dataset.nodeId, r.dataset.health]))")


@on_cluster
def test_the_cluster_page_lists_both_nodes_with_their_load(browser: Any, env: Env) -> None:
    page = open_console(browser, env, "ops", "cluster")
    wait_until(lambda: node_rows(page) == {"p0": "healthy", "d0": "healthy"}, timeout_s=15,
               what="both nodes healthy on the page", interval_s=0.1)
    row = page.locator('tr[data-node-id="d0"]')
    assert "decode" in row.inner_text() and "256" in row.inner_text()  # role and KV blocks
    assert page.locator('tr[data-node-id="p0"]').inner_text().split("\t")[1] == "prefill"
    screenshot(page, "cluster")
    close(page)
    page = open_console(browser, env, "ops", "cluster", viewport=PHONE)
    wait_until(lambda: len(node_rows(page)) == 2, timeout_s=15, what="the cluster page on a phone-sized screen",
               interval_s=0.1)
    width = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert width[0] <= width[1], f"the page scrolls sideways on a phone-sized screen: {width}"
    screenshot(page, "cluster-phone")
    close(page)


def chat_in_playground(page: Any, text: str, max_tokens: int) -> dict[str, Any]:
    page.wait_for_selector(f'#chat-model option[value="{MODEL}"]', state="attached")
    page.fill("#chat-max-tokens", str(max_tokens))
    page.fill("#chat-temperature", "0")
    page.fill("#chat-input", text)
    page.press("#chat-input", "Enter")
    done = page.wait_for_selector('.msg.assistant[data-state="done"], .msg.assistant[data-state="error"]', timeout=60000)
    assert done.get_attribute("data-state") == "done", done.inner_text()
    return {"text": done.query_selector(".text").text_content(), "request_id": done.get_attribute("data-request-id"),
            "ttft_ms": float(done.get_attribute("data-ttft-ms"))}


@on_cluster
def test_a_chat_from_the_playground_streams_the_greedy_answer_and_its_waterfall_sums_to_its_ttft(
        browser: Any, env: Env) -> None:
    question = "Write three short sentences about the sea and the mountains, please."
    page = open_console(browser, env, "alpha", "chat")
    shown = chat_in_playground(page, question, 24)
    expected = env.client("alpha").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=24)
    assert shown["text"] == expected.choices[0].message.content
    assert shown["request_id"].startswith("chatcmpl-")
    screenshot(page, "chat")
    page.click(".msg.assistant a.waterfall-link")
    page.wait_for_selector(".waterfall .wf-sum")
    stages = page.eval_on_selector_all(".waterfall .wf-row", "rows => rows.map(r => [r.dataset.stage, "
                                       "Number(r.dataset.ms), r.dataset.inTtft === '1'])")
    ttft = float(page.get_attribute(".waterfall", "data-ttft-ms"))
    before = {name: ms for name, ms, in_ttft in stages if in_ttft}
    assert set(before) >= {"admission", "routing", "dispatch", "reservation_wait", "prefill_queue", "prefill", "network"}
    assert {"transfer", "decode"} <= {name for name, _, in_ttft in stages if not in_ttft}
    assert sum(before.values()) == pytest.approx(ttft, rel=0.05), stages
    # What no stage names (gRPC hops, the first token's way back) is the residual: never negative, never all
    # of it. Its size depends on the machine's load, so no timing bound is asserted here.
    assert 0 <= before["network"] < ttft, stages
    # The browser's own TTFT (request sent to first delta shown) contains the server's.
    assert shown["ttft_ms"] >= 0.9 * ttft
    record = env.api(f"/console/api/requests/{shown['request_id']}", "alpha").json()
    assert record["routes"][0]["path"] == "disaggregated"
    assert record["routes"][0]["served_by"] == {"prefill": "p0", "decode": "d0"}
    screenshot(page, "request")
    close(page)


@on_cluster
def test_a_tenant_key_sees_only_its_own_requests(browser: Any, env: Env) -> None:
    ids = {}
    for tenant in ("alpha", "beta"):
        out = env.client(tenant).completions.create(model=MODEL, prompt=f"Hello from {tenant}", max_tokens=4,
                                                    temperature=0)
        ids[tenant] = out.id
    alpha = env.api("/console/api/requests", "alpha").json()["data"]
    assert {r["tenant"] for r in alpha} == {"alpha"} and ids["alpha"] in {r["request_id"] for r in alpha}
    assert env.api(f"/console/api/requests/{ids['beta']}", "alpha").status_code == 404
    ops = env.api("/console/api/requests", "ops").json()["data"]
    assert {ids["alpha"], ids["beta"]} <= {r["request_id"] for r in ops}
    forbidden = env.api("/console/api/cluster", "alpha")
    assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "operator_only"
    assert env.api("/console/api/series", "beta").status_code == 403

    page = open_console(browser, env, "alpha", "requests")
    page.wait_for_selector(f'tr[data-request-id="{ids["alpha"]}"]')
    tenants = page.eval_on_selector_all("#requests-table tr[data-tenant]", "rows => rows.map(r => r.dataset.tenant)")
    assert set(tenants) == {"alpha"}, tenants
    # Each row shows its request log record's cost_usd (this cluster's models have no prices: 0).
    cost = next(r["cost_usd"] for r in alpha if r["request_id"] == ids["alpha"])
    assert page.inner_text(f'tr[data-request-id="{ids["alpha"]}"] td.cost') == f"{cost:.6f}" == "0.000000"
    assert page.locator(f'tr[data-request-id="{ids["beta"]}"]').count() == 0
    assert page.locator('#nav a[data-page="cluster"]').is_hidden()  # operator pages are not offered
    screenshot(page, "requests")
    close(page)


@on_cluster
def test_a_wrong_key_gets_the_login_prompt_not_data(browser: Any, env: Env) -> None:
    for path in ("/console/api/session", "/console/api/cluster", "/console/api/requests", "/console/api/series"):
        for headers in ({}, {"authorization": "Bearer sk-wrong"}):
            r = httpx.get(f"{env.url}{path}", headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
    page = open_console(browser, env, None, "cluster")
    page.fill("#login-key", "sk-not-a-key-of-this-cluster")
    page.press("#login-key", "Enter")
    wait_until(lambda: page.inner_text("#login-error"), timeout_s=10, what="the login error", interval_s=0.1)
    assert "Incorrect API key" in page.inner_text("#login-error")
    assert page.locator("#page-cluster").is_hidden() and page.locator("#nav").is_hidden()
    assert page.locator("#cluster-pools tr").count() == 0
    screenshot(page, "login")
    close(page)


@on_cluster
def test_the_console_is_usable_from_the_keyboard(browser: Any, env: Env) -> None:
    page = open_console(browser, env, None, "")
    page.focus("#login-key")
    page.keyboard.type(KEYS["ops"])
    page.keyboard.press("Enter")
    page.wait_for_selector("#nav:not([hidden])")
    for _ in range(10):  # Tab to the Requests link
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.dataset.page") == "requests":
            break
    page.keyboard.press("Enter")
    page.wait_for_selector("#page-requests:not([hidden])")
    assert page.evaluate("location.hash") == "#requests"
    close(page)


@on_cluster
def test_the_charts_page_draws_each_pool_chart_from_the_history(browser: Any, env: Env) -> None:
    client = env.client("beta")
    for i in range(3):
        client.completions.create(model=MODEL, prompt=f"chart sample {i}", max_tokens=8, temperature=0)
    series = {}

    def sampled() -> bool:
        series.update(env.api("/console/api/series", "ops").json()["pools"][MODEL])
        return any(v is not None for v in series["ttft_p50"]) and max(series["nodes_decode"]) == 1

    wait_until(sampled, timeout_s=15, what="a history sample with a TTFT", interval_s=0.5)
    assert max(series["tokens_per_s"]) > 0 and max(series["kv_use_decode"]) is not None
    page = open_console(browser, env, "ops", "charts")
    wait_until(lambda: page.locator(f'[data-pool="{MODEL}"] .chart canvas').count() >= 6, timeout_s=15,
               what="six charts of the pool", interval_s=0.1)
    screenshot(page, "charts")
    close(page)


@on_cluster
def test_a_killed_node_turns_unhealthy_or_leaves_the_page_within_the_bound(browser: Any, env: Env) -> None:
    cluster = env.cluster
    extra = cluster.spawn_node("prefill", "p1")
    cluster.wait_ready([extra])
    page = open_console(browser, env, "ops", "cluster")
    wait_until(lambda: node_rows(page).get("p1") == "healthy", timeout_s=20, what="p1 healthy on the page", interval_s=0.1)
    cluster.kill("p1", signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: node_rows(page).get("p1", "gone") != "healthy", timeout_s=STOP_BOUND_S,
               what=f"p1 unhealthy or gone within {STOP_BOUND_S:g} s", interval_s=0.1)
    shown = time.monotonic() - killed
    screenshot(page, "cluster-node-killed")
    wait_until(lambda: "p1" not in node_rows(page), timeout_s=10, what="p1 gone once its lease expired", interval_s=0.1)
    assert node_rows(page) == {"p0": "healthy", "d0": "healthy"}
    assert shown <= STOP_BOUND_S
    close(page)


@on_cluster
def test_without_the_console_its_paths_are_404(env: Env, tiny_llama_dir: Path) -> None:
    fe = start_frontend("frontend-off", env.tmp, env.cluster.etcd_endpoints, free_port(), "--cluster",
                        env.cluster.cluster, "--model", f"{MODEL}={tiny_llama_dir}", "--no-console",
                        "--request-log", "off", "--log-level", "warning")
    try:
        for path in ("/", "/console", "/console/static/console.js", "/console/api/session"):
            r = httpx.get(f"{fe.base_url}{path}", timeout=10)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", (path, r.text)
    finally:
        assert fe.stop() == 0, fe.proc.tail()


@on_cluster
def test_the_pages_come_from_this_origin_only(env: Env) -> None:
    r = httpx.get(f"{env.url}/", timeout=10)
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert "http" not in r.text.replace('"/console/static/', "")  # nothing fetched from elsewhere
    for name in ("console.js", "console.css", "vendor/uPlot.iife.min.js", "vendor/uPlot.LICENSE.txt"):
        assert httpx.get(f"{env.url}/console/static/{name}", timeout=10).status_code == 200, name
    assert httpx.get(f"{env.url}/console/static/../app.py", timeout=10).status_code == 404
