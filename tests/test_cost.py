"""Cost in money: the models file's price tables, `pdserve_frontend_cost_total` and the request log's
`cost_usd`.

The pure parts first: price validation (a negative price, a batch discount outside [0, 1) or an unknown
key is a ConfigError naming the model and the field, and a start-up error of the frontend process) and
`frontend.job.cost`. Then a real cluster (etcd, two pools of one colocated decode node each running the
tiny model, the frontend process with a models file and a tenants file, the openai SDK) serves a mixed
run: three tenants, two models with different prices, streamed and not, a repeated long prompt served
partly from the prefix cache, an embedding, a stream cancelled mid-way and a batch line. The cost metric
per tenant and model equals the usage the responses returned times the price table, and the sum of
`cost_usd` over the request log. Rewriting the models file with a negative price keeps the old prices
(a reload error); a good file's new prices apply to the next requests, without a restart.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.frontend.config import ConfigError, ModelSpec, load_models_file
from pdserve.frontend.main import main as frontend_main
from pdserve.frontend.models import ModelCatalog
from pdserve.frontend.pricing import Prices, cost_usd
from pdserve.frontend.tenants import hash_key
from pdserve.registry.etcd_server import free_port
from testing.cluster import LocalCluster
from testing.procs import FrontendProc, start_frontend

pytestmark = pytest.mark.timeout(300)

KEYS = {"alpha": "sk-alpha-cost-0123456789", "beta": "sk-beta-cost-0123456789", "gamma": "sk-gamma-cost-012345678"}
# USD per million tokens; large, so that the tiny model's short requests cost whole cents.
CHEAP = Prices(input=2000.0, cached_input=500.0, output=8000.0, batch_discount=0.5)
DEAR = Prices(input=30000.0, cached_input=7500.0, output=120000.0)
POOLS = {"cheap": "tiny-a", "dear": "tiny-b"}


def _models_yaml(model_dir: Path, prices: dict[str, str]) -> str:
    return "models:\n" + "".join(
        f"  - {{name: {name}, pool: {pool}, path: '{model_dir}', prices: {prices[name]}}}\n"
        for name, pool in POOLS.items())


def _table(p: Prices) -> str:
    return (f"{{input: {p.input}, cached_input: {p.cached_input}, output: {p.output}, "
            f"batch_discount: {p.batch_discount}}}")


GOOD = {"cheap": _table(CHEAP), "dear": _table(DEAR)}


# --- price tables in the models file ---------------------------------------------------------------


@pytest.mark.parametrize(("prices", "message"), [
    ("{input: -0.5}", "model 'm': prices: input must be a finite number >= 0 (USD per million tokens), got -0.5"),
    ("{output: .inf}", "model 'm': prices: output must be a finite number >= 0 (USD per million tokens), got inf"),
    ("{cached_input: '1'}", "model 'm': prices: cached_input must be a finite number >= 0"),
    ("{batch_discount: 1}", "model 'm': prices: batch_discount must be a number in [0, 1)"),
    ("{batch_discount: -0.1}", "model 'm': prices: batch_discount must be a number in [0, 1)"),
    ("{input: 1, inptu: 2}", "model 'm': prices: unknown field(s) ['inptu']; allowed: "
                             "['batch_discount', 'cached_input', 'input', 'output']"),
    ("[1, 2]", "model 'm': prices: each prices table must be a mapping"),
])
def test_a_bad_price_table_is_refused_naming_the_model_and_the_field(
        tmp_path: Path, tiny_llama_dir: Path, prices: str, message: str) -> None:
    models = tmp_path / "models.yaml"
    models.write_text(f"models:\n  - {{name: m, path: '{tiny_llama_dir}', prices: {prices}}}\n")
    with pytest.raises(ConfigError) as info:
        load_models_file(models)
    assert str(info.value).startswith(f"{models}: models[0]: {message}"), str(info.value)


def test_prices_read_from_yaml_and_toml_and_default_to_free(tmp_path: Path, tiny_llama_dir: Path) -> None:
    yml = tmp_path / "models.yaml"
    yml.write_text(f"models:\n  - name: m\n    path: '{tiny_llama_dir}'\n    prices: {{input: 1, output: 2.5}}\n"
                   f"  - name: n\n    path: '{tiny_llama_dir}'\n")
    specs = load_models_file(yml)
    assert specs[0].prices == Prices(input=1.0, output=2.5) and specs[1].prices is None
    toml = tmp_path / "models.toml"
    toml.write_text(f"[[models]]\nname = 'm'\npath = '{tiny_llama_dir}'\n"
                    "[models.prices]\ninput = 0.15\ncached_input = 0.075\noutput = 0.6\nbatch_discount = 0.5\n")
    assert load_models_file(toml)[0].prices == Prices(0.15, 0.075, 0.6, 0.5)
    catalog = ModelCatalog(tuple(specs))
    assert catalog.resolve("m").prices == Prices(input=1.0, output=2.5) and catalog.resolve("n").prices is None


def test_a_bad_price_table_is_a_start_up_error(tmp_path: Path, tiny_llama_dir: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    models = tmp_path / "models.yaml"
    models.write_text(f"models:\n  - {{name: m, path: '{tiny_llama_dir}', prices: {{output: -3}}}}\n")
    assert frontend_main(["--etcd=127.0.0.1:1", "--models", str(models)]) == 2
    err = capsys.readouterr().err
    assert f"frontend: error: {models}: models[0]: model 'm': prices: output must be a finite number >= 0" in err


def test_catalog_prices_change_in_place(tiny_llama_dir: Path) -> None:
    catalog = ModelCatalog((ModelSpec("m", str(tiny_llama_dir), prices=CHEAP),))
    model = catalog.resolve("m")
    assert catalog.set_prices({("m", ""): CHEAP, ("other", ""): DEAR}) == []  # unchanged; unknown ignored
    [line] = catalog.set_prices({("m", ""): DEAR})
    assert line.startswith("m@-: prices input 2000, cached_input 500, output 8000 USD/1M tokens, batch_discount 0.5 -> ")
    assert model.prices is DEAR
    assert catalog.set_prices({("m", ""): None}) and model.prices is None


def test_cost_usd_bills_cached_tokens_and_the_batch_discount() -> None:
    assert cost_usd(CHEAP, 1000, 200, 100) == pytest.approx((800 * 2000 + 200 * 500 + 100 * 8000) / 1e6)
    assert cost_usd(CHEAP, 1000, 200, 100, batch=True) == pytest.approx(cost_usd(CHEAP, 1000, 200, 100) / 2)
    assert cost_usd(None, 1000, 0, 100) == 0.0


# --- through a cluster ------------------------------------------------------------------------------


@dataclass(eq=False)
class Env:
    cluster: LocalCluster
    frontend: FrontendProc
    models_file: Path
    request_log: Path
    model_dir: Path

    def client(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.frontend.base_url}/v1", api_key=KEYS[tenant], max_retries=0,
                             timeout=120)

    def records(self) -> list[dict[str, Any]]:
        data = self.request_log.read_bytes()
        return [orjson.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]

    def record(self, request_id: str) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            found = [r for r in self.records() if r.get("request_id") == request_id]
            if found:
                return found[0]
            time.sleep(0.05)  # the poll interval
        raise AssertionError(f"{request_id} not in the request log")

    def metrics(self) -> str:
        return httpx.get(f"{self.frontend.base_url}/metrics", timeout=10).text

    def cost_metric(self) -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = defaultdict(float)
        for family in text_string_to_metric_families(self.metrics()):
            for s in family.samples:
                if s.name == "pdserve_frontend_cost_total":
                    out[(s.labels["tenant"], s.labels["model"])] += s.value
        return dict(out)

    def reloads(self, outcome: str) -> float:
        return sum(s.value for family in text_string_to_metric_families(self.metrics()) for s in family.samples
                   if s.name == "pdserve_frontend_config_reloads_total" and s.labels["file"] == "models"
                   and s.labels["outcome"] == outcome)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("cost")
    tenants = tmp / "tenants.yaml"
    tenants.write_bytes(orjson.dumps({"tenants": [{"name": n, "keys_sha256": [hash_key(k)]} for n, k in KEYS.items()]}))
    models = tmp / "models.yaml"
    models.write_text(_models_yaml(tiny_llama_dir, GOOD))
    args = ["--num-threads", "1", "--num-kv-blocks", "256", "--block-size", "16", "--colocated"]
    with LocalCluster(tmp / "cluster", tiny_llama_dir, node_args=args) as cluster:
        cluster.start_etcd()
        nodes = [cluster.spawn_node("decode", f"d-{pool}", ["--model-name", pool]) for pool in POOLS.values()]
        cluster.wait_ready(nodes)
        request_log = tmp / "requests.jsonl"
        fe = start_frontend("frontend", tmp, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                            "--models", str(models), "--tenants", str(tenants), "--request-log", str(request_log),
                            "--log-level", "info")
        try:
            yield Env(cluster, fe, models, request_log, tiny_llama_dir)
            cluster.wait_clean()
        finally:
            assert fe.stop() == 0, fe.proc.tail()
            assert "Traceback" not in fe.proc.log_text(), fe.proc.tail(80)


def _charge(prices: Prices, usage: Any, batch: bool = False) -> float:
    """What a usage object (SDK or JSON) costs at `prices`."""
    get = (lambda o, k: o[k]) if isinstance(usage, dict) else getattr
    cached = get(get(usage, "prompt_tokens_details"), "cached_tokens") if get(usage, "prompt_tokens_details") else 0
    return cost_usd(prices, get(usage, "prompt_tokens"), cached or 0, get(usage, "completion_tokens"), batch)


def _wait_batch(client: openai.OpenAI, batch_id: str) -> Any:
    deadline = time.monotonic() + 120
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)  # the poll interval


def test_mixed_run_costs_usage_times_prices_in_the_metric_and_the_request_log(env: Env) -> None:
    prices = {"cheap": CHEAP, "dear": DEAR}
    expected: dict[tuple[str, str], float] = defaultdict(float)
    alpha, beta, gamma = env.client("alpha"), env.client("beta"), env.client("gamma")
    # alpha: a chat completion and a streamed completion on the cheap model
    r = alpha.chat.completions.create(model="cheap", messages=[{"role": "user", "content": "hello there"}],
                                      max_tokens=8)
    assert r.usage is not None and r.usage.completion_tokens > 0
    expected[("alpha", "cheap")] += _charge(CHEAP, r.usage)
    assert env.record(r.id)["cost_usd"] == pytest.approx(_charge(CHEAP, r.usage), rel=1e-12)
    chunks = list(alpha.completions.create(model="cheap", prompt="once upon a time", max_tokens=12, stream=True,
                                           stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens > 0
    expected[("alpha", "cheap")] += _charge(CHEAP, usage)
    # beta: one long prompt twice on the dear model; the second is partly served from the prefix cache
    long_prompt = "the quick brown fox jumps over the lazy dog. " * 12
    cached_seen = 0
    for _ in range(2):
        r = beta.chat.completions.create(model="dear", messages=[{"role": "user", "content": long_prompt}],
                                         max_tokens=6)
        assert r.usage is not None
        expected[("beta", "dear")] += _charge(DEAR, r.usage)
        details = r.usage.prompt_tokens_details
        cached_seen = details.cached_tokens or 0 if details is not None else 0
    assert cached_seen >= 16, "the repeated prompt's full blocks come from the prefix cache"
    rec = env.record(r.id)
    assert rec["cost_usd"] < cost_usd(DEAR, rec["prompt_tokens"], 0, rec["completion_tokens"])  # cached is cheaper
    # gamma: an embedding (input price only) and a stream it walks away from mid-way
    e = gamma.embeddings.create(model="cheap", input=["a sentence to embed", "another one"])
    expected[("gamma", "cheap")] += cost_usd(CHEAP, e.usage.prompt_tokens, 0, 0)
    stream = gamma.chat.completions.create(model="dear", messages=[{"role": "user", "content": "tell me a story"}],
                                           max_tokens=3000, stream=True, extra_body={"ignore_eos": True})
    cancelled_id = ""
    for i, chunk in enumerate(stream):
        cancelled_id = chunk.id
        if i == 3:
            break
    stream.close()
    rec = env.record(cancelled_id)
    assert rec["status"] == 499 and 0 < rec["completion_tokens"] < 3000, rec
    used = cost_usd(DEAR, rec["prompt_tokens"], max(rec["cached_tokens"]), rec["completion_tokens"])
    assert rec["cost_usd"] == pytest.approx(used, rel=1e-12)  # what was used, not what was asked for
    expected[("gamma", "dear")] += used
    # alpha: a batch line on the cheap model, at its batch discount
    line = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "cheap", "messages": [{"role": "user", "content": "batch me"}], "max_tokens": 5}}
    upload = alpha.files.create(file=("in.jsonl", orjson.dumps(line) + b"\n"), purpose="batch")
    batch = _wait_batch(alpha, alpha.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h").id)
    assert batch.status == "completed" and batch.output_file_id, batch
    out = orjson.loads(alpha.files.content(batch.output_file_id).content.splitlines()[0])
    body = out["response"]["body"]
    expected[("alpha", "cheap")] += _charge(CHEAP, body["usage"], batch=True)
    rec = env.record(body["id"])
    assert rec["batch"] is True
    assert rec["cost_usd"] == pytest.approx(_charge(CHEAP, body["usage"], batch=True), rel=1e-12)
    assert rec["cost_usd"] == pytest.approx(_charge(CHEAP, body["usage"]) / 2, rel=1e-12)

    metric = env.cost_metric()
    logged: dict[tuple[str, str], float] = defaultdict(float)
    for r_ in env.records():
        assert "cost_usd" in r_, r_
        if r_.get("model"):
            logged[(r_["tenant"], r_["model"])] += r_["cost_usd"]
    assert set(expected) <= set(metric)
    for key, usd in expected.items():
        assert round(metric[key], 2) == round(usd, 2) and math.isclose(metric[key], usd, rel_tol=1e-9), (key, metric)
        assert math.isclose(metric[key], logged[key], rel_tol=1e-9), (key, metric, logged)
    print("cost per (tenant, model), USD: " + ", ".join(f"{t}/{m} {metric[(t, m)]:.6f}" for t, m in sorted(expected)))
    assert sum(expected.values()) > 1.0  # whole dollars: the comparison to the cent means something
    assert all(v > 0 for v in metric.values())
    assert {m for _, m in expected} == set(prices)  # both price tables were used


def test_a_reload_with_a_bad_price_table_keeps_the_prices_in_force(env: Env) -> None:
    client = env.client("beta")
    errors, oks = env.reloads("error"), env.reloads("ok")
    env.models_file.write_text(_models_yaml(env.model_dir, {**GOOD, "cheap": "{input: -1, output: 5}"}))
    deadline = time.monotonic() + 15
    while env.reloads("error") == errors:
        assert time.monotonic() < deadline
        time.sleep(0.1)  # the poll interval
    assert "models file" in env.frontend.proc.log_text() and "keeping the weights, prices and degradation policies in force" in \
        env.frontend.proc.log_text()
    assert "model 'cheap': prices: input must be a finite number >= 0" in env.frontend.proc.log_text()
    r = client.chat.completions.create(model="cheap", messages=[{"role": "user", "content": "still old prices"}],
                                       max_tokens=4)
    assert r.usage is not None
    assert env.record(r.id)["cost_usd"] == pytest.approx(_charge(CHEAP, r.usage), rel=1e-12)
    # A good file: the new prices apply to the next requests, without a restart.
    pid = env.frontend.proc.popen.pid
    new = Prices(input=1.0e6, cached_input=0.0, output=0.0)
    env.models_file.write_text(_models_yaml(env.model_dir, {**GOOD, "cheap": _table(new)}))
    while env.reloads("ok") == oks:
        assert time.monotonic() < deadline + 15
        time.sleep(0.1)  # the poll interval
    r = client.chat.completions.create(model="cheap", messages=[{"role": "user", "content": "new prices now"}],
                                       max_tokens=4)
    assert r.usage is not None
    assert env.record(r.id)["cost_usd"] == pytest.approx(_charge(new, r.usage), rel=1e-12)
    assert env.frontend.proc.popen.pid == pid and env.frontend.proc.popen.poll() is None
