"""A real Prometheus (Debian's `prometheus` package) scraping a real local cluster (`pdserve up`: etcd, a
prefill and a decode node, the frontend with two tenants, one of them rate-limited, and the autoscaler with a
budget of two nodes, so that it only ever holds 1P:1D) under a little load:

1. Prometheus runs deploy/prometheus/prometheus.yml (pointed at this cluster's targets file, shorter
   intervals) with the recording rules of rules.yml, and scrapes every process the launcher started;
2. every PromQL expression of every panel of every dashboard in deploy/grafana returns data (at least one
   series with a finite value), with the dashboard variables set to "all";
3. deploy/metrics_render.py renders the dashboard from that Prometheus to a PNG with every panel drawn.

PDSERVE_DASHBOARD_PNG=docs/dashboard.png and PDSERVE_LIVE_LOAD_S=SECONDS make the same run produce the
README's picture over a longer load.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import openai
import pytest
import yaml

from pdserve.deploy.metrics_render import RenderConfig, expand, load_panels, query, render
from pdserve.frontend.tenants import hash_key
from pdserve.planner.profile_model import EngineFacts, Linear, Profile
from pdserve.registry.etcd_server import free_port
from testing.debian import require_package
from testing.up_cluster import REPO_ROOT, UpCluster
from testing.waits import wait_until

pytestmark = pytest.mark.timeout(600)

DASHBOARDS = sorted((REPO_ROOT / "deploy" / "grafana").glob("*.json"))
KEYS = {"alpha": "sk-alpha-live-0123456789", "beta": "sk-beta-live-0123456789"}
MODEL = "tiny"
LOAD_S = float(os.environ.get("PDSERVE_LIVE_LOAD_S", "25"))
VARIABLES = {"cluster": ".*", "model": ".*", "node": ".*"}


def prometheus_binary() -> str:
    """The prometheus binary; installs Debian's package when missing and root (idempotent), else skips."""
    return require_package("prometheus", lambda: shutil.which("prometheus"), "the `prometheus` binary")
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("needs Debian's `prometheus` package (apt-get install prometheus), and is not root to install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]
    if subprocess.run(install, env=env, capture_output=True, timeout=900).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=900)
        result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            pytest.skip(f"apt-get install prometheus failed: {result.stderr[-500:]}")
    found = shutil.which("prometheus")
    if found is None:
        pytest.skip("the prometheus package installed no `prometheus` binary on PATH")
    return found


@dataclass(eq=False)
class PrometheusServer:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_prometheus(workdir: Path, targets_file: Path) -> PrometheusServer:
    """Prometheus on a free loopback port, running the repository's scrape config and rules."""
    config = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="2s", scrape_timeout="2s", evaluation_interval="2s")
    config["rule_files"] = [str(REPO_ROOT / "deploy" / "prometheus" / "rules.yml")]
    (job,) = config["scrape_configs"]
    job["file_sd_configs"] = [{"files": [str(targets_file)], "refresh_interval": "2s"}]
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = workdir / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [prometheus_binary(), f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )
    server = PrometheusServer(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + 60
    while True:
        try:
            query(server.url, "up")
            return server
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"prometheus did not start:\n{log_path.read_text()[-3000:]}") from None
            time.sleep(0.2)  # the poll interval


def synthetic_profile(path: Path) -> Path:
    """A hand-made cost model for the autoscaler (it describes no machine, so it holds on any)."""
    Profile(Linear(0.005, 1e-5), Linear(0.01), Linear(0.0), EngineFacts(16, 100_000, 1000, 2048, 8, 64),
            machine={"synthetic": True}).save(path)
    return path


def tenants_file(path: Path) -> Path:
    tenants = [
        {"name": "alpha", "keys_sha256": [hash_key(KEYS["alpha"])], "models": ["*"]},
        # A tight request rate, so the rejection panels get their 429s.
        {"name": "beta", "keys_sha256": [hash_key(KEYS["beta"])], "models": ["*"], "requests_per_minute": 3},
    ]
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return path


def run_load(up: UpCluster, seconds: float) -> dict[str, int]:
    """Chat requests from both tenants for `seconds`: long prompts (prefilled on the prefill node, then
    shipped), repeated ones (prefix-cache hits), streamed and not. Returns outcome counts."""
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jovial "
             "knight in the misty valley near an old stone bridge").split()
    systems = [" ".join(random.Random(i).choices(words, k=90)) for i in range(3)]
    counts = {"ok": 0, "rate_limited": 0}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def worker(n: int) -> None:
        rng = random.Random(n)
        clients = {t: openai.OpenAI(base_url=f"{up.base_url}/v1", api_key=k, max_retries=0, timeout=60)
                   for t, k in KEYS.items()}
        while time.monotonic() < deadline:
            tenant = "beta" if rng.random() < 0.2 else "alpha"
            messages = [{"role": "system", "content": rng.choice(systems)},
                        {"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(5, 40)))}]
            try:
                if rng.random() < 0.5:
                    stream = clients[tenant].chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=rng.randint(8, 32), stream=True)
                    for _ in stream:
                        pass
                else:
                    clients[tenant].chat.completions.create(model=MODEL, messages=messages,
                                                            max_tokens=rng.randint(8, 32))
                outcome = "ok"
            except openai.RateLimitError:
                outcome = "rate_limited"
                time.sleep(0.2)  # a rate-limited client backs off (part of the load)
            with lock:
                counts[outcome] += 1

    # Offline work beside it, for the batch and embedding panels: an embeddings call and a 2-line batch.
    alpha = openai.OpenAI(base_url=f"{up.base_url}/v1", api_key=KEYS["alpha"], max_retries=0, timeout=60)
    alpha.embeddings.create(model=MODEL, input=["the quick brown fox", "a lazy dog"])
    lines = b"".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": MODEL, "max_tokens": 4,
                                          "messages": [{"role": "user", "content": f"line {i}"}]}}).encode() + b"\n"
                     for i in range(2))
    batch = alpha.batches.create(input_file_id=alpha.files.create(file=("in.jsonl", lines), purpose="batch").id,
                                 endpoint="/v1/chat/completions", completion_window="24h")
    with ThreadPoolExecutor(3) as pool:
        for f in [pool.submit(worker, n) for n in range(3)]:
            f.result()
    wait_until(lambda: alpha.batches.retrieve(batch.id).status == "completed", 60, "the batch completed")
    return counts


def last_scrape_after(url: str, since: float) -> float:
    """The latest scrape time (epoch s) of the targets once every one was scraped after `since`, else 0."""
    times = [v for _, v in query(url, "timestamp(up)")]
    return max(times) if times and min(times) > since else 0.0


def rules_evaluated_after(url: str, since: float) -> bool:
    """Whether every rule group was last evaluated after `since` (epoch s)."""
    with urllib.request.urlopen(f"{url}/api/v1/rules", timeout=10) as resp:
        groups = json.loads(resp.read())["data"]["groups"]
    evaluated = [datetime.fromisoformat(g["lastEvaluation"]).timestamp() for g in groups]
    return bool(evaluated) and min(evaluated) > since


@dataclass(eq=False)
class LiveEnv:
    up: UpCluster
    prometheus: PrometheusServer
    load: dict[str, int]
    load_started: float
    load_ended: float


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveEnv]:
    prometheus_binary()
    workdir = tmp_path_factory.mktemp("live")
    up = UpCluster.start(workdir, [
        "--model", "tiny", "--model-name", MODEL, "--kv-memory", "64", "--lease-ttl", "2",
        # The tiny model's random weights rarely repeat a bigram: drafts from single-token repeats, so that
        # the speculative decoding panels have data.
        "--speculative", "ngram", "--node-arg=--speculative-min-match=1",
        f"--frontend-arg=--tenants={tenants_file(workdir / 'tenants.yaml')}",
        # The autoscaler's panels: a budget of two nodes leaves 1P:1D the only shape, so it holds.
        "--autoscale", "--node-budget", "2", "--autoscale-profile", str(synthetic_profile(workdir / "profile.json")),
        "--autoscale-slo", "ttft_p90=3s", "--autoscale-interval", "1", "--autoscale-window", "4",
    ])
    prometheus: PrometheusServer | None = None
    try:
        prometheus = start_prometheus(workdir, up.cluster_dir / "prometheus_targets.json")
        started = time.time()
        load = run_load(up, LOAD_S)
        ended = time.time()
        # A last scrape of every target, then a rule evaluation after it.
        url = prometheus.url
        scraped = wait_until(lambda: last_scrape_after(url, ended), 30, "every target scraped after the load")
        wait_until(lambda: rules_evaluated_after(url, scraped), 30, "the rules evaluated after that")
        yield LiveEnv(up, prometheus, load, started, ended)
    finally:
        if prometheus is not None:
            prometheus.stop()
        up.close()


def test_prometheus_scrapes_every_process(live: LiveEnv) -> None:
    assert live.load["ok"] > 10 and live.load["rate_limited"] > 0, live.load
    up = {(labels["pool"], labels["node"]): v for labels, v in query(live.prometheus.url, "up")}
    assert up == {("etcd", "etcd"): 1, ("prefill", "prefill-0"): 1, ("decode", "decode-0"): 1,
                  ("frontend", "frontend-0"): 1, ("autoscaler", "autoscaler"): 1}, up
    # Every process labels its own series: pool/node/model win over the target labels (honor_labels).
    pools = {labels["pool"] for labels, _ in query(live.prometheus.url, '{__name__=~"pdserve_.+"}')}
    # (the autoscaler's series without a pool of their own keep the target's)
    assert pools == {"frontend", "prefill", "decode", "autoscaler"}


@pytest.mark.parametrize("dashboard", DASHBOARDS, ids=[d.stem for d in DASHBOARDS])
def test_every_dashboard_query_returns_data(live: LiveEnv, dashboard: Path) -> None:
    panels = load_panels(dashboard)
    assert panels and all(p.targets for p in panels)
    missing = []
    for panel in panels:
        for target in panel.targets:
            expr = expand(target.expr, VARIABLES, "1m")
            assert "$" not in expr, f"{panel.title}: unexpanded variable in {expr}"
            values = [v for _, v in query(live.prometheus.url, expr)]
            if not any(math.isfinite(v) for v in values):
                missing.append(f"{panel.title}: {expr} -> {values}")
    assert not missing, "queries without data:\n" + "\n".join(missing)


def test_dashboard_renders_to_png(live: LiveEnv, tmp_path: Path) -> None:
    out = Path(os.environ.get("PDSERVE_DASHBOARD_PNG", tmp_path / "dashboard.png"))
    if not out.is_absolute():
        out = REPO_ROOT / out
    minutes = (time.time() - live.load_started) / 60 + 0.25
    result = render(RenderConfig(live.prometheus.url, DASHBOARDS[0], out, minutes=minutes))
    assert result.empty == [], f"panels drawn without data: {result.empty}"
    assert result.panels == len(load_panels(DASHBOARDS[0]))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and 20_000 < out.stat().st_size < 1_000_000
