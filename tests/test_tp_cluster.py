"""Disaggregated serving between nodes of different tensor-parallel widths: real node processes (a TP = 2
node is rank 0 plus one worker rank process), KV shipped over the nodes' channels with heads resharded
(kv_transfer.sharded). Greedy tokens must equal TP = 1's single-process engine, and every block must be
back on every node after the requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.sampling_params import SamplingParams
from testing.cluster import LocalCluster, random_prompt, reference_engine

pytestmark = pytest.mark.timeout(600)

NODE_ARGS = ["--num-threads", "1", "--num-kv-blocks", "256", "--block-size", "16"]


def test_prefill_tp2_to_decode_tp1_and_tp1_to_tp2(tiny_llama_dir: Path, tmp_path: Path) -> None:
    prompts = [random_prompt(n, seed) for seed, n in enumerate((40, 75, 130))]
    params = SamplingParams(max_tokens=12, temperature=0)
    ref = reference_engine(tiny_llama_dir)
    try:
        want = [r.token_ids for r in ref.generate(prompts, params)]
    finally:
        ref.close()
    with LocalCluster(tmp_path / "cluster", tiny_llama_dir, node_args=NODE_ARGS) as cluster:
        cluster.start_etcd()
        tp2 = ["--tensor-parallel-size", "2"]
        remote = ["--local-prefill-threshold", "0"]
        nodes = [cluster.spawn_node("prefill", "p1", []), cluster.spawn_node("prefill", "p2", tp2),
                 cluster.spawn_node("decode", "d1", remote), cluster.spawn_node("decode", "d2", [*remote, *tp2])]
        cluster.wait_ready(nodes)
        cluster.wait_registry(lambda m: {"p1", "p2", "d1", "d2"} <= m.keys(), timeout_s=30, what="all nodes")
        for decode, prefill in (("d1", "p2"), ("d2", "p1"), ("d2", "p2")):  # 2 -> 1, 1 -> 2, 2 -> 2
            for prompt, tokens in zip(prompts, want, strict=True):
                got = cluster.generate(decode, prompt, params, prefill_node_id=prefill)
                assert not got.error, got.error
                assert got.prefill_node_id == prefill
                assert got.token_ids == tokens, f"{prefill} -> {decode}: tokens differ from TP 1"
        loads = cluster.wait_clean()
        assert all(load.kv_blocks_used == 0 for load in loads.values()), loads
        cluster.check_integrity()
