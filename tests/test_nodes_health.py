"""Health from progress: a decode node whose engine steps fail, or whose step hangs, leaves the registry
within its configured bound, its requests complete on the other decode node with the text of an
uninterrupted run (greedy), and it exits with EXIT_UNHEALTHY for its supervisor to restart it.

Real parts: etcd, 1 prefill + 2 decode node processes of the tiny model, a frontend process, the official
openai SDK. The fault is the nodes' test-only hook (`testing.faults.Faults`, its step faults): each decode
node watches trigger files of its own, and a test creates the file of the node serving its stream.
The first test checks the engine side in-process: consecutive failures, their reset, the stall age.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.engine.async_engine import AsyncEngine, EngineProgress
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node_common.health import STALL_FACTOR, HealthWatch
from pdserve.node_common.metrics import ObservedEngine
from pdserve.node_common.ready import EXIT_UNHEALTHY
from pdserve.registry.etcd_server import free_port
from testing.cluster import LocalCluster, NodeProcess
from testing.faults import Faults
from testing.procs import FrontendProc, start_frontend

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny-llama"
NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "512", "--block-size", "16",
             "--model-name", MODEL]
STALL_S = 1.5
# Threshold 0: prompts are prefilled on the prefill node; one failed step is enough to leave.
DECODE_ARGS = ["--local-prefill-threshold", "0", "--max-step-failures", "1", "--step-stall-timeout", str(STALL_S)]


def test_engine_progress_counts_failures_in_a_row_and_the_running_step(tmp_path: Path, model_dir: Path) -> None:
    fault = Faults(step_trigger=str(tmp_path / "fault"))
    trigger = fault.step_fail_file
    observer = type("Quiet", (), {"on_step": lambda self, step: None})()
    engine = ObservedEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64), observer, fault)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def run(aengine: AsyncEngine, request_id: str) -> tuple[str | None, int]:
        stream = await aengine.add_request(request_id, [1, 2, 3], params)
        tokens, finish = 0, None
        while True:
            for out in await stream.next_batch():
                tokens += len(out.new_token_ids)
                finish = out.finish_reason if out.finished else finish
                if out.finished:
                    aengine.close_stream(request_id)
                    return finish, tokens

    async def scenario() -> None:
        aengine = AsyncEngine(engine, name="t")
        aengine.start()
        watch = HealthWatch(aengine, max_step_failures=2, stall_timeout_s=60)
        try:
            assert await run(aengine, "a") == ("length", 4)  # steps succeed: nothing counted
            assert aengine.progress().consecutive_failures == 0
            trigger.touch()
            for i in range(2):
                assert (await run(aengine, f"f{i}"))[0] == "error"
                assert aengine.progress().consecutive_failures == i + 1
                assert (watch.verdict() is None) == (i == 0)
            assert watch.verdict() == "2 engine steps failed in a row"
            trigger.unlink()
            assert await run(aengine, "b") == ("length", 4)  # one good step resets the run
            progress = aengine.progress()
            assert (progress.consecutive_failures, progress.step_failures, progress.step_running_s) == (0, 2, 0.0)
            assert watch.verdict() is None and watch.healthy
        finally:
            await aengine.close()

    asyncio.run(scenario())


def test_the_stall_bound_grows_with_the_full_step_a_node_was_seen_to_need(model_dir: Path) -> None:
    """A real engine's prefill steps set the per-token cost behind `full_step_s`; a step is judged hung at
    the fixed timeout, or at STALL_FACTOR x the full step when that is longer (an 8B model on 2 cores)."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64,
                                    max_num_batched_tokens=256))
    aengine = AsyncEngine(engine, name="t")

    async def scenario() -> None:
        aengine.start()
        try:
            assert aengine.progress().full_step_s == 0.0  # nothing measured yet
            stream = await aengine.add_request("p", list(range(5, 205)), SamplingParams(max_tokens=1))
            while not any(out.finished for out in await stream.next_batch()):
                pass
            aengine.close_stream("p")
            full = aengine.progress().full_step_s
            assert 0.0 < full < 60.0  # 200 prompt tokens' step, scaled to the 256-token budget
        finally:
            await aengine.close()

    asyncio.run(scenario())

    class Stuck:  # the engine's progress as a node whose full step takes 100 s would report it
        def __init__(self, running_s: float) -> None:
            self.p = EngineProgress(0, 0, running_s, None, full_step_s=100.0)

        def progress(self) -> EngineProgress:
            return self.p

    assert HealthWatch(Stuck(300.0), 2, 120.0).verdict() is None  # type: ignore[arg-type]
    why = HealthWatch(Stuck(400.0), 2, 120.0).verdict()  # type: ignore[arg-type]
    assert why is not None and "stall timeout 400s" in why and f"{STALL_FACTOR}x the 100.0s" in why
    assert HealthWatch(Stuck(130.0), 2, 1000.0).verdict() is None  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[tuple[LocalCluster, FrontendProc]]:
    tmp = tmp_path_factory.mktemp("health")
    with LocalCluster(tmp / "cluster", model_dir, node_args=NODE_ARGS, lease_ttl_s=10) as cluster:
        cluster.start(1, 0)
        cluster.wait_ready([spawn_armed(cluster, node_id) for node_id in ("d0", "d1")])
        cluster.wait_registry(lambda m: {"d0", "d1"} <= m.keys(), 30, "both decode nodes")
        fe = start_frontend("frontend", tmp, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                            "--model", f"{MODEL}={model_dir}", "--max-migrations", "2", "--log-level", "warning")
        try:
            yield cluster, fe
        finally:
            assert fe.stop() == 0, fe.proc.tail()
            assert "Traceback" not in fe.proc.log_text(), fe.proc.tail(80)


def fault_of(cluster: LocalCluster, node_id: str) -> Faults:
    return Faults(step_trigger=str(cluster.workdir / f"{node_id}-fault"))


def spawn_armed(cluster: LocalCluster, node_id: str) -> NodeProcess:
    """Starts decode node `node_id` with the fault hook armed on trigger files of its own (not created)."""
    return cluster.spawn_node("decode", node_id, DECODE_ARGS, faults=fault_of(cluster, node_id))


def stream(fe: FrontendProc, prompt: str, max_tokens: int, on_chunk: object = None) -> str:
    client = openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key="sk-test", max_retries=0,
                           http_client=httpx.Client(timeout=300))
    text, n = "", 0
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                           temperature=0.0, extra_body={"ignore_eos": True}):
        text += "".join(c.text for c in chunk.choices)
        n += 1
        if on_chunk is not None:
            on_chunk(n)  # type: ignore[operator]
    return text


def serving_node(cluster: LocalCluster, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for node_id in ("d0", "d1"):
            if cluster.nodes[node_id].alive and cluster.get_load(node_id).in_flight:
                return node_id
        time.sleep(0.01)  # the poll interval
    raise AssertionError("no decode node is serving the stream")


@pytest.mark.parametrize("kind", ["fail", "hang"])
def test_an_unhealthy_decode_node_leaves_and_its_streams_finish_elsewhere(
        env: tuple[LocalCluster, FrontendProc], kind: str) -> None:
    """Injects: the serving decode node's engine steps fail (`fail`) or its step hangs (`hang`) after 8
    chunks of a stream; 3 more streams run alongside."""
    cluster, fe = env
    prompts = [f"The {kind} report of lighthouse number {i} says" for i in range(4)]
    expected = [stream(fe, p, 60) for p in prompts]  # uninterrupted runs

    injected: list[tuple[str, float]] = []
    lock = threading.Lock()

    def on_chunk(n: int) -> None:
        with lock:
            if n == 8 and not injected:
                node_id = serving_node(cluster)
                trigger = fault_of(cluster, node_id)
                (trigger.step_fail_file if kind == "fail" else trigger.step_hang_file).touch()
                injected.append((node_id, time.monotonic()))

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream, fe, p, 60, on_chunk if i == 0 else None) for i, p in enumerate(prompts)]
        got = [f.result(timeout=300) for f in futures]
    assert injected, "the stream ended before the fault was injected"
    bad, at = injected[0]
    assert got == expected, "a stream moved off the unhealthy node differs from its uninterrupted run"

    # It left the registry within its bound (one failed step, or the stall timeout, plus the watch's poll).
    cluster.wait_registry(lambda m: bad not in m, 30, f"{bad} out of the registry")
    waited = time.monotonic() - at
    assert waited < (STALL_S if kind == "hang" else 0) + 10, waited
    proc = cluster.nodes[bad].proc
    assert proc.wait(timeout=30) == EXIT_UNHEALTHY
    cluster.kill(bad)  # it is gone: this forgets the test's channel to it
    log = cluster.nodes[bad].log_path.read_text()
    assert "is unhealthy" in log and ("failed in a row" in log if kind == "fail" else "stall timeout" in log)

    # Restarted (as a supervisor does on that exit code), it serves again with its fault cleared.
    for path in (fault_of(cluster, bad).step_fail_file, fault_of(cluster, bad).step_hang_file):
        path.unlink(missing_ok=True)
    cluster.wait_ready([spawn_armed(cluster, bad)])
    cluster.wait_registry(lambda m: bad in m, 30, f"{bad} back")
    assert stream(fe, prompts[0], 60) == expected[0]
    cluster.wait_clean()


def test_node_servers_accept_the_keepalive_pings_of_their_callers() -> None:
    """A call that waits long for its first token carries the caller's keepalive pings; a node's server
    must not count them as abuse (gRPC's default ends the connection at the third ping within 5 minutes,
    GOAWAY too_many_pings, failing every call on it)."""
    from pdserve.frontend.connections import _OPTIONS as FRONTEND_OPTIONS
    from pdserve.frontend.embeddings import _CHANNEL_OPTIONS as EMBEDDING_OPTIONS
    from pdserve.node_common.runtime import MIN_PING_INTERVAL_MS, SERVER_GRPC_OPTIONS

    assert dict(SERVER_GRPC_OPTIONS)["grpc.http2.min_recv_ping_interval_without_data_ms"] == MIN_PING_INTERVAL_MS
    for options in (FRONTEND_OPTIONS, EMBEDDING_OPTIONS):
        assert dict(options)["grpc.keepalive_time_ms"] >= MIN_PING_INTERVAL_MS
