"""No request lost when a decode node dies or drains, and model fallback at run time: a real local cluster
(etcd, 1 prefill + 2 decode node processes of the tiny model, plus a one-node pool of its own for the
fallback test) behind a real frontend process, seen through the official openai SDK.

Each test names the failure it injects:
1. SIGKILL of the decode node serving a stream: the stream continues on the other node with the text of
   an uninterrupted run (greedy, and seeded sampling with temperature > 0), usage counts every token
   once, and the migration metric counts it;
2. SIGSTOP of the serving decode node: the channel keepalive notices it and the stream moves on;
3. the same kill with `--max-migrations 0`: the client gets an OpenAI-shaped error event;
4. SIGTERM (drain) of a decode node running long requests: after the drain grace they are handed over
   and complete on the other node with identical text, none cancelled; the node exits; every block is
   accounted for;
5. the only decode node of a pool killed just before a request for its model: the model's fallback
   serves the request.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.registry.etcd_server import free_port
from testing.cluster import LocalCluster
from testing.procs import FrontendProc, start_frontend

pytestmark = pytest.mark.timeout(900)

MODEL = "tiny-llama"
NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "512", "--block-size", "16",
             "--model-name", MODEL]
DRAIN_GRACE_S = 1.0
# Threshold 0: every prompt (and every resumed request's prompt + completion so far) is prefilled remotely.
DECODE_ARGS = ["--local-prefill-threshold", "0", "--drain-grace", str(DRAIN_GRACE_S)]
FALLBACK_POOL_ARGS = ["--model-name", "primary"]


@dataclass(eq=False)
class Env:
    cluster: LocalCluster
    frontend: FrontendProc
    request_log: Path
    tmp: Path
    extra_frontends: list[FrontendProc] = field(default_factory=list)
    pool: list[str] = field(default_factory=lambda: ["d0", "d1"])  # the live decode nodes of MODEL

    def client(self, frontend: FrontendProc | None = None) -> openai.OpenAI:
        fe = frontend or self.frontend
        return openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key="sk-test", max_retries=0,
                             http_client=httpx.Client(timeout=300))

    def metric(self, sample: str, frontend: FrontendProc | None = None, **labels: str) -> float:
        text = httpx.get(f"{(frontend or self.frontend).base_url}/metrics").text
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))

    def record_for(self, request_id: str) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            data = self.request_log.read_bytes()
            for line in data[: data.rfind(b"\n") + 1].splitlines():
                rec = orjson.loads(line)
                if rec.get("request_id") == request_id:
                    return rec
            time.sleep(0.02)  # the poll interval
        raise AssertionError(f"{request_id} not in the request log")

    def serving_node(self, timeout_s: float = 30.0) -> str:
        """The decode node of the pool with a request in flight (waits for one)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for node_id in self.pool:
                if self.cluster.nodes[node_id].alive and self.cluster.get_load(node_id).in_flight:
                    return node_id
            time.sleep(0.01)  # the poll interval
        raise AssertionError("no decode node is serving the request")

    def replace(self, node_id: str) -> None:
        """Starts a new decode node of MODEL in place of a stopped one, under a new id (a restart under the
        same id before the old lease lapses would find the prefill node's pair channel to the dead
        process), and waits until the registry lists the new one and no longer the old one."""
        new_id = f"{node_id}r"
        self.pool = [n for n in self.pool if n != node_id] + [new_id]
        self.cluster.wait_ready([self.cluster.spawn_node("decode", new_id, DECODE_ARGS)])
        self.cluster.wait_registry(lambda m: new_id in m and node_id not in m, 30, f"{new_id} in place of {node_id}")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("migration")
    models = tmp / "models.yaml"
    models.write_bytes(orjson.dumps({"models": [
        {"name": MODEL, "path": str(tiny_llama_dir)},
        {"name": "primary", "path": str(tiny_llama_dir), "pool": "primary", "fallback": MODEL},
    ]}))
    # A lease long enough that a starved CPU does not make nodes leave the registry now and then (a killed
    # node is noticed by its broken connection, not by its lease), and that the fallback test's killed
    # node stays registered while its request is admitted.
    with LocalCluster(tmp / "cluster", tiny_llama_dir, node_args=NODE_ARGS, lease_ttl_s=10) as cluster:
        cluster.start(1, 2, decode_args=DECODE_ARGS)
        cluster.wait_ready([cluster.spawn_node("decode", "dx", FALLBACK_POOL_ARGS)])
        request_log = tmp / "requests.jsonl"
        fe = start_frontend("frontend", tmp, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                            "--models", str(models), "--request-log", str(request_log), "--max-migrations", "2",
                            "--log-level", "warning")
        e = Env(cluster, fe, request_log, tmp)
        try:
            yield e
        finally:
            for proc in [fe, *e.extra_frontends]:
                assert proc.stop() == 0, proc.proc.tail()
                assert "Traceback" not in proc.proc.log_text(), proc.proc.tail(80)


@pytest.fixture(autouse=True)
def _every_block_accounted_for(env: Env) -> Iterator[None]:
    yield
    env.cluster.wait_clean()  # every live node: nothing in flight, zero used blocks, integrity checked


@dataclass
class Streamed:
    text: str = ""
    chunks: int = 0
    finish: list[str] = field(default_factory=list)
    completion_tokens: int | None = None
    request_id: str = ""
    error: openai.APIError | None = None
    arrivals: list[float] = field(default_factory=list)  # monotonic time of each chunk

    @property
    def longest_gap_s(self) -> float:
        return max((b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)), default=0.0)


def stream_completion(client: openai.OpenAI, prompt: str, max_tokens: int, *, on_chunk: Any = None,
                      **params: Any) -> Streamed:
    """Reads one streamed completion to its end (or its error event), calling on_chunk(n) per chunk."""
    out = Streamed()
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                                       **params)
    try:
        for chunk in stream:
            out.request_id = chunk.id
            if chunk.usage is not None:
                out.completion_tokens = chunk.usage.completion_tokens
            for ch in chunk.choices:
                out.text += ch.text
                if ch.finish_reason:
                    out.finish.append(ch.finish_reason)
            out.chunks += 1
            out.arrivals.append(time.monotonic())
            if on_chunk is not None:
                on_chunk(out.chunks)
    except openai.APIError as err:
        out.error = err
    return out


def kill_after(env: Env, chunks: int, sig: int = signal.SIGKILL) -> tuple[Any, list[str]]:
    """An on_chunk callback that kills the serving decode node once `chunks` chunks arrived."""
    killed: list[str] = []

    def on_chunk(n: int) -> None:
        if n == chunks and not killed:
            node_id = env.serving_node()
            killed.append(node_id)
            env.cluster.kill(node_id, sig)

    return on_chunk, killed


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_sigkill_of_the_serving_decode_node_mid_stream(env: Env, sampling: str) -> None:
    """Injects: SIGKILL of the decode node a stream is served from, after 10 chunks."""
    client = env.client()
    params: dict[str, Any] = {"temperature": 0.0} if sampling == "greedy" else {"temperature": 0.9, "seed": 1234}
    prompt = f"The history of the {sampling} lighthouse keeper began"
    reference = stream_completion(client, prompt, 300, **params)
    assert reference.error is None and reference.finish == ["length"] and reference.completion_tokens == 300
    before = env.metric("pdserve_frontend_migrations_total", model=MODEL)
    unavailable = env.metric("pdserve_frontend_migrations_total", model=MODEL, reason="unavailable")
    on_chunk, killed = kill_after(env, 10)
    got = stream_completion(client, prompt, 300, on_chunk=on_chunk, **params)
    assert killed, "the stream ended before the node was killed"
    assert got.error is None, got.error
    assert got.text == reference.text, "the migrated stream differs from the uninterrupted run"
    assert got.finish == ["length"] and got.completion_tokens == 300  # every token counted once
    assert env.metric("pdserve_frontend_migrations_total", model=MODEL) - before == 1
    assert env.metric("pdserve_frontend_migrations_total", model=MODEL, reason="unavailable") - unavailable == 1
    print(f"{sampling}: longest gap between chunks {got.longest_gap_s * 1e3:.0f} ms (the migration), "
          f"uninterrupted {reference.longest_gap_s * 1e3:.0f} ms")
    rec = env.record_for(got.request_id)
    assert rec["status"] == 200 and rec["completion_tokens"] == 300 and rec["finish_reasons"] == ["length"]
    route = rec["routes"][0]
    assert route["migrations"] == 1 and route["tried"][0] == killed[0] and route["served_by"]["decode"] != killed[0]
    assert route["path"] == "migrated"
    env.replace(killed[0])


def test_hung_decode_node_mid_stream(env: Env) -> None:
    """Injects: SIGSTOP of the decode node a stream is served from (no connection reset: the frontend's
    channel keepalive notices the silent node)."""
    client = env.client()
    params: dict[str, Any] = {"temperature": 0.0}
    prompt = "A node that stops answering"
    reference = stream_completion(client, prompt, 300, **params)
    on_chunk, stopped = kill_after(env, 10, signal.SIGSTOP)
    got = stream_completion(client, prompt, 300, on_chunk=on_chunk, **params)
    assert stopped and got.error is None, got.error
    assert got.text == reference.text and got.completion_tokens == 300
    print(f"hung node: the stream stalled {got.longest_gap_s:.1f} s before it moved")
    assert got.longest_gap_s < 40
    env.cluster.kill(stopped[0], signal.SIGKILL)
    env.replace(stopped[0])


def test_migration_bound_exceeded_gives_an_openai_error_event(env: Env) -> None:
    """Injects: SIGKILL of the serving decode node under a frontend started with --max-migrations 0."""
    fe = start_frontend("frontend-nomigrate", env.tmp, env.cluster.etcd_endpoints, free_port(), "--cluster",
                        env.cluster.cluster, "--model", f"{MODEL}={env.cluster.model_dir}", "--max-migrations", "0",
                        "--request-log", "off", "--log-level", "warning")
    env.extra_frontends.append(fe)
    on_chunk, killed = kill_after(env, 5)
    got = stream_completion(env.client(fe), "A stream that may not move", 300, on_chunk=on_chunk)
    assert killed and got.chunks >= 5 and got.text
    assert isinstance(got.error, openai.APIError)
    body = got.error.body
    assert isinstance(body, dict) and set(body) == {"message", "type", "param", "code"}, body
    assert body["type"] == "server_error" and body["code"] == "upstream_error"
    assert "could not be moved to another decode node (0 migration(s) already)" in body["message"]
    assert got.finish == [] and got.completion_tokens is None  # no finish, no usage after the error
    assert env.metric("pdserve_frontend_migrations_total", frontend=fe) == 0
    env.replace(killed[0])


def test_drain_hands_running_requests_over_to_the_other_node(env: Env) -> None:
    """Injects: SIGTERM (graceful drain) of a decode node while long streams run on it; they outlive its
    drain grace, so it hands them over and exits."""
    client = env.client()
    prompts = [f"Request number {i} tells a long story about" for i in range(4)]
    references = [stream_completion(client, p, 400, temperature=0.0) for p in prompts]
    assert all(r.error is None and r.completion_tokens == 400 for r in references), [(r.error, r.completion_tokens) for r in references]
    before = env.metric("pdserve_frontend_migrations_total", model=MODEL, reason="hand_over")
    started = threading.Barrier(len(prompts) + 1)

    def run(prompt: str) -> Streamed:
        return stream_completion(client, prompt, 400, temperature=0.0, on_chunk=lambda n: n == 3 and started.wait(60))

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(run, p) for p in prompts]
        started.wait(60)  # every stream is under way
        on_node = {n: env.cluster.get_load(n).in_flight for n in env.pool}
        drained = max(on_node, key=lambda n: on_node[n])
        assert on_node[drained] >= 1, on_node
        t0 = time.monotonic()
        env.cluster.kill(drained, signal.SIGTERM)  # waits for the process to exit
        drain_s = time.monotonic() - t0
        results = [f.result(timeout=300) for f in futures]
    node = env.cluster.nodes[drained]
    assert node.proc.returncode == 0, node.log_tail()
    assert drain_s >= DRAIN_GRACE_S
    print(f"drain of {drained} with {on_node[drained]} request(s): exited after {drain_s:.2f} s; longest gap "
          f"in the moved streams {max(r.longest_gap_s for r in results) * 1e3:.0f} ms")
    log = node.log_tail(20000)
    assert "handed" in log and "request(s) over" in log
    assert f"node {drained}: drained" in log  # nothing in flight when it exited: the hand-over freed all
    for got, ref in zip(results, references, strict=True):
        assert got.error is None, got.error
        assert got.text == ref.text and got.finish == ["length"] and got.completion_tokens == 400
    records = [env.record_for(r.request_id) for r in results]
    assert all(r["status"] == 200 and r["finish_reasons"] == ["length"] for r in records)  # none cancelled
    moved = sum(r["routes"][0]["migrations"] for r in records)
    assert moved >= 1 and all(r["routes"][0]["served_by"]["decode"] != drained for r in records
                              if r["routes"][0]["migrations"])
    assert env.metric("pdserve_frontend_migrations_total", model=MODEL, reason="hand_over") - before == moved
    env.cluster.wait_clean()  # the other nodes hold nothing of the handed-over requests
    env.replace(drained)


def test_runtime_fallback_when_the_pool_fails_at_open(env: Env) -> None:
    """Injects: SIGKILL of the only decode node of pool "primary" just before a request for it; its
    registry lease is still alive, so admission routes to it and the Generate call fails at open."""
    client = env.client()
    env.cluster.kill("dx", signal.SIGKILL)
    raw = client.completions.with_raw_response.create(model="primary", prompt="Fallback, please", max_tokens=8)
    assert raw.headers["x-pdserve-model"] == MODEL
    resp = raw.parse()
    assert resp.model == MODEL and resp.choices[0].finish_reason in ("length", "stop") and resp.choices[0].text
    rec = env.record_for(raw.headers["x-request-id"])
    assert rec["requested_model"] == "primary" and rec["model"] == MODEL and rec["status"] == 200
    assert "pool 'primary' failed the request" in rec["fallback"], rec["fallback"]
    assert rec["routes"][0]["decode_node"] in env.pool
