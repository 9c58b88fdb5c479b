"""A node restarted under the same id, before its old registry lease lapsed (so its peers never saw it
leave), is a new process: its peers drop what they shared with the old one, the KV channel included, so
the first transfer to the new process goes over a fresh channel instead of failing on the dead one
(real etcd, one prefill and one decode node process, a lease far longer than the restart)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from testing.cluster import LocalCluster, random_prompt

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("check_integrity_after_each_test")]

LEASE_TTL_S = 60  # the old decode process's lease outlives its restart
NODE_ARGS = ["--num-threads", "1", "--num-kv-blocks", "256", "--block-size", "16"]
DECODE_ARGS = ["--local-prefill-threshold", "16"]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("restart"), model_dir, lease_ttl_s=LEASE_TTL_S,
                      node_args=NODE_ARGS) as c:
        c.start(1, 1, decode_args=DECODE_ARGS)
        yield c
        c.wait_clean()


@pytest.mark.parametrize("restarted", ["d0", "p0"])
def test_a_node_restarted_under_its_id_gets_a_fresh_channel(cluster: LocalCluster, reference: LLMEngine,
                                                           restarted: str) -> None:
    prompt = random_prompt(80, seed=1)
    expected = reference.generate([prompt], PARAMS)[0].token_ids
    before = cluster.generate("d0", prompt, PARAMS, prefill_node_id="p0")  # opens the pair channel
    assert before.token_ids == expected and before.prefill_node_id == "p0"

    def failures() -> tuple[float, float]:  # d0's re-prefills (failed transfers) and prefill fallbacks
        return (cluster.metric("d0", "pdserve_decode_reprefills_total"),
                cluster.metric("d0", "pdserve_decode_local_prefill_fallbacks_total"))

    base = failures() if restarted != "d0" else (0.0, 0.0)  # a restarted d0 counts from zero
    node = cluster.nodes[restarted]
    old_pid = node.proc.pid
    cluster.kill(restarted, signal.SIGKILL)
    cluster.wait_ready([cluster.spawn_node(node.role, restarted, DECODE_ARGS if node.role == "decode" else [])])
    # The registry shows the new process (same id, new pid) without the old one ever having left.
    cluster.wait_registry(lambda m: restarted in m and m[restarted].record.pid != old_pid, timeout_s=30,
                          what=f"{restarted}'s new record")

    after = cluster.generate("d0", random_prompt(80, seed=2), PARAMS, prefill_node_id="p0")
    assert after.finish_reason == "length" and after.prefill_node_id == "p0" and not after.error
    assert after.token_ids == reference.generate([random_prompt(80, seed=2)], PARAMS)[0].token_ids
    # Served over a working channel: no failed transfer was re-prefilled, no prefill fell back.
    assert failures() == base
