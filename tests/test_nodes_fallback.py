"""A remote prefill that fails before the first token is invisible to the caller (real etcd, three prefill
and two decode node processes on loopback): the decode node frees the reservation and prefills the prompt
itself, so the greedy text matches the single-process engine, the request finishes normally, the fallback
is counted by reason, and every node ends with zero used KV blocks and a clean integrity check."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from testing.cluster import GenerateResult, LocalCluster, random_prompt
from testing.waits import wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("check_integrity_after_each_test")]

SHORT_LEN = 64  # p-short's context: longer prompts are refused there, while the decode nodes take them
PREFILL_TIMEOUT_S = 1.0  # d1's bound on the wait for a first token; below the lease TTL
NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "512", "--block-size", "16"]
DECODE_ARGS = ["--local-prefill-threshold", "32"]
FALLBACKS = "pdserve_decode_local_prefill_fallbacks_total"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("fallback"), model_dir, node_args=NODE_ARGS) as c:
        c.start_etcd()
        c.wait_ready([
            c.spawn_node("prefill", "p-short", ["--max-model-len", str(SHORT_LEN)]),
            c.spawn_node("prefill", "p-kill"),
            c.spawn_node("prefill", "p-slow"),
            c.spawn_node("decode", "d0", DECODE_ARGS),
            c.spawn_node("decode", "d1", [*DECODE_ARGS, "--prefill-timeout", str(PREFILL_TIMEOUT_S)]),
        ])
        yield c
        c.wait_clean()


def prompt_of(n: int, seed: int) -> list[int]:
    return random_prompt(n, seed)


def assert_prefilled_here(cluster: LocalCluster, reference: LLMEngine, decode: str, prompt: list[int],
                          params: SamplingParams, res: GenerateResult, reason: str, before: float) -> None:
    """Same greedy text as the reference, a normal finish, one fallback counted under `reason`, and
    every live node clean."""
    exp = reference.generate([prompt], params)[0]
    assert res.finish_reason == "length" and not res.error, res.messages[-1]
    assert res.token_ids == exp.token_ids and res.text == exp.text
    assert res.prefill_node_id == decode, "the decode node reports itself as the prefill node"
    assert cluster.metric(decode, FALLBACKS, reason=reason) == before + 1
    cluster.wait_clean(timeout_s=10)


def test_refused_prefill_is_done_on_the_decode_node(cluster: LocalCluster, reference: LLMEngine) -> None:
    prompt, params = prompt_of(SHORT_LEN + 36, seed=1), SamplingParams(max_tokens=12, ignore_eos=True)
    before = cluster.metric("d0", FALLBACKS, reason="refused")
    res = cluster.generate("d0", prompt, params, prefill_node_id="p-short")
    assert_prefilled_here(cluster, reference, "d0", prompt, params, res, "refused", before)


def test_prefill_node_killed_before_the_first_token(cluster: LocalCluster, reference: LLMEngine) -> None:
    prompt, params = prompt_of(300, seed=2), SamplingParams(max_tokens=12, ignore_eos=True)
    before = cluster.metric("d0", FALLBACKS, reason="unavailable")
    cluster.kill("p-kill", signal.SIGSTOP)  # it cannot answer: no first token can come before the kill
    try:
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(cluster.generate, "d0", prompt, params, prefill_node_id="p-kill")
            wait_until(lambda: cluster.get_load("d0").kv_blocks_reserved > 0, 30, "d0 to reserve the prompt")
            cluster.kill("p-kill", signal.SIGKILL)
            res = future.result(timeout=60)
    finally:
        cluster.kill("p-kill", signal.SIGKILL)
    assert_prefilled_here(cluster, reference, "d0", prompt, params, res, "unavailable", before)


def test_prefill_timeout_before_the_first_token(cluster: LocalCluster, reference: LLMEngine) -> None:
    prompt, params = prompt_of(200, seed=3), SamplingParams(max_tokens=12, ignore_eos=True)
    before = cluster.metric("d1", FALLBACKS, reason="timeout")
    cluster.kill("p-slow", signal.SIGSTOP)  # hung, its lease still live: only d1's prefill timeout helps
    try:
        start = time.monotonic()
        res = cluster.generate("d1", prompt, params, prefill_node_id="p-slow")
        assert PREFILL_TIMEOUT_S <= res.ttft_s and time.monotonic() - start < cluster.lease_ttl_s + 5
    finally:
        cluster.kill("p-slow", signal.SIGKILL)
    assert_prefilled_here(cluster, reference, "d1", prompt, params, res, "timeout", before)
