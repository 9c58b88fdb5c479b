"""The fp8 KV caches (e5m2 and e4m3, one cluster each) across disaggregation (real etcd, real node processes, gloo on loopback, tiny
model in float32): a request prefilled on an fp8 prefill node and decoded on an fp8 decode node yields
exactly the tokens of the same request prefilled on the decode node itself and of a single-process engine
at fp8 (both sides round K/V to fp8 once, at the store, and the blocks travel as their bytes, checksummed);
the wire carries one byte per element; a prefill node whose KV cache dtype differs refuses the request, which
the decode node then prefills itself. Every KV block is accounted for after every test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from testing.cluster import LocalCluster, random_prompt

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("check_integrity_after_each_test")]

BLOCK = 16
NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "256", "--block-size", str(BLOCK)]
KV_DTYPES = {"fp8_e5m2": "float8_e5m2", "fp8_e4m3": "float8_e4m3fn"}  # option -> KV cache dtype
FALLBACKS = "pdserve_decode_local_prefill_fallbacks_total"
REPREFILLS = "pdserve_decode_reprefills_total"
CHECKSUM_FAILURES = "pdserve_decode_kv_checksum_failures_total"
SENT_BYTES = "pdserve_kv_transfer_bytes_total"


@pytest.fixture(scope="module", params=sorted(KV_DTYPES))
def kv_dtype(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, kv_dtype: str) -> Iterator[LocalCluster]:
    fp8 = ["--kv-cache-dtype", kv_dtype]
    with LocalCluster(tmp_path_factory.mktemp("kvfp8"), model_dir, node_args=NODE_ARGS) as c:
        c.start_etcd()
        c.wait_ready([
            c.spawn_node("prefill", "p-fp8", fp8),
            c.spawn_node("prefill", "p-auto"),  # a float32 pool: the decode node's fp8 blocks do not fit it
            c.spawn_node("decode", "d0", [*fp8, "--local-prefill-threshold", "0"]),
        ])
        c.wait_registry(lambda m: {"p-fp8", "p-auto", "d0"} <= m.keys(), timeout_s=30, what="every node")
        yield c
        c.wait_clean()


@pytest.fixture(scope="module")
def reference(model_dir: Path, kv_dtype: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=256, num_threads=1,
                                  kv_cache_dtype=kv_dtype))


def _block_bytes(reference: LLMEngine) -> int:
    mc = reference.model_config
    return mc.num_layers * 2 * BLOCK * mc.num_kv_heads * mc.head_dim  # one byte per element


def test_disaggregated_fp8_equals_colocated_fp8(cluster: LocalCluster, reference: LLMEngine) -> None:
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [random_prompt(n, seed=80 + n) for n in (20, 100, 300)]
    expected = [r.token_ids for r in reference.generate(prompts, greedy)]
    before = {name: cluster.metric(node, name) for node, name in
              (("d0", FALLBACKS), ("d0", REPREFILLS), ("d0", CHECKSUM_FAILURES), ("p-fp8", SENT_BYTES))}
    remote = [cluster.generate("d0", p, greedy, prefill_node_id="p-fp8") for p in prompts]
    cluster.wait_clean()
    # fresh prompts for the colocated run: the decode node's prefix cache now holds the first ones
    local_prompts = [p[:1] + [7] + p[2:] for p in prompts]
    local_expected = [r.token_ids for r in reference.generate(local_prompts, greedy)]
    local = [cluster.generate("d0", p, greedy, force_local_prefill=True) for p in local_prompts]
    for res in remote:
        assert res.error == "" and res.finish_reason == "length" and res.prefill_node_id == "p-fp8", res
    assert [r.token_ids for r in remote] == expected
    assert [r.token_ids for r in local] == local_expected
    after = {name: cluster.metric(node, name) for node, name in
             (("d0", FALLBACKS), ("d0", REPREFILLS), ("d0", CHECKSUM_FAILURES), ("p-fp8", SENT_BYTES))}
    assert after[FALLBACKS] == before[FALLBACKS] and after[REPREFILLS] == before[REPREFILLS]
    assert after[CHECKSUM_FAILURES] == before[CHECKSUM_FAILURES]
    blocks = sum(-(-len(p) // BLOCK) for p in prompts)
    assert after[SENT_BYTES] - before[SENT_BYTES] == blocks * _block_bytes(reference)


def test_a_prefill_node_with_another_kv_dtype_refuses(cluster: LocalCluster, reference: LLMEngine,
                                                      kv_dtype: str) -> None:
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    prompt = random_prompt(90, seed=5)
    before = cluster.metric("d0", FALLBACKS, reason="refused")
    res = cluster.generate("d0", prompt, greedy, prefill_node_id="p-auto")
    assert res.error == "" and res.finish_reason == "length", res
    assert res.token_ids == reference.generate([prompt], greedy)[0].token_ids
    assert cluster.metric("d0", FALLBACKS, reason="refused") == before + 1
    assert cluster.metric("p-auto", SENT_BYTES) == 0
    assert f"kv dtype {KV_DTYPES[kv_dtype]} differs from this node's float32" in cluster.nodes["d0"].log_tail(20000)
