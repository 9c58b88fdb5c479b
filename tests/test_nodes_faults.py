"""Node processes under faults (real etcd, 2 prefill + 2 decode node processes on loopback): a refused
fingerprint, an etcd restart while serving, and peers that die or hang, whose registry leases lapsing
is what makes the surviving node give their KV blocks back (long before the transfer timeout)."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tiny import default_model_dir
from pdserve.node_common.convert import params_to_proto
from pdserve.node_common.ready import EXIT_REFUSED
from pdserve.rpc import pdserve_pb2 as pb
from testing.cluster import LocalCluster
from testing.threads import start_thread
from testing.waits import wait_until

pytestmark = pytest.mark.timeout(400)

# Above the slowest machine's 3000-token prefill on one thread (3.3 s on an AVX2-only Zen core), so that a
# send is queued before a stopped decode node's lease lapses; the bounds below are in TTLs.
TTL_S = 8
TRANSFER_TIMEOUT_S = 60  # far above the lease TTL: only a lapsed lease can explain a quick release
NODE_ARGS = [
    "--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "512",
    "--transfer-timeout", str(TRANSFER_TIMEOUT_S),
]  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("faults"), default_model_dir("llama"), node_args=NODE_ARGS,
                      lease_ttl_s=TTL_S) as c:
        c.start(2, 2, decode_args=["--local-prefill-threshold", "32"])
        yield c
        c.wait_clean()  # the survivors hold nothing


@pytest.fixture(autouse=True)
def _check_integrity_after_each_test(cluster: LocalCluster) -> Iterator[None]:
    """Every node's blocks, requests, streams and reservations agree after every test."""
    yield
    cluster.check_integrity()


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def open_stream(cluster: LocalCluster, decode: str, prefill: str, prompt: list[int], max_tokens: int):
    request = pb.GenerateRequest(
        prompt_token_ids=prompt, params=params_to_proto(SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
        prefill_node_id=prefill,
    )
    return cluster.decode_stub(decode).Generate(request, timeout=120)


def drain(call) -> list[pb.GenerateResponse]:
    out: list[pb.GenerateResponse] = []
    try:
        for msg in call:
            out.append(msg)
    except grpc.RpcError:
        pass
    return out


def test_mismatched_fingerprint_is_refused(cluster: LocalCluster) -> None:
    # Same pool (cluster and model name) but the weights held in another dtype: another fingerprint.
    node = cluster.spawn_node("prefill", "p-bf16", ["--dtype", "bfloat16"])
    assert node.proc.wait(timeout=120) == EXIT_REFUSED
    assert "model_fingerprint" in node.log_tail() and "refused" in node.log_tail()
    assert "p-bf16" not in cluster.registry_members()


OUTAGE_S = 1.0


def test_etcd_restart_while_serving(cluster: LocalCluster) -> None:
    assert cluster.etcd is not None
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    jobs = [(f"d{i % 2}", f"p{(i // 2) % 2}", prompt_of(60 + i, seed=i)) for i in range(6)]
    with ThreadPoolExecutor(len(jobs) + 2) as pool:
        futures = [pool.submit(cluster.generate, d, prompt, params, prefill_node_id=p) for d, p, prompt in jobs]
        wait_until(lambda: sum(cluster.get_load(d).running for d in ("d0", "d1")) == len(jobs), 60,
                   "every request to be decoding")
        cluster.etcd.stop()
        # Serving goes on without etcd: the nodes keep their last view of each other.
        during = cluster.generate("d1", prompt_of(80, seed=99), SamplingParams(max_tokens=8), prefill_node_id="p0")
        time.sleep(OUTAGE_S)  # the fault's length (not a synchronisation): etcd stays down a while longer
        cluster.etcd.start()
        results = [f.result(timeout=120) for f in futures]
    assert during.finish_reason in ("length", "stop") and during.prefill_node_id == "p0"
    for res in results:
        assert res.finish_reason == "length" and len(res.token_ids) == 400 and not res.error
    cluster.wait_registry(lambda m: {"p0", "p1", "d0", "d1"} <= set(m), timeout_s=30, what="all nodes back")
    cluster.wait_clean()


def test_prefill_lease_loss_before_the_first_token_falls_back_to_local_prefill(cluster: LocalCluster) -> None:
    fallbacks = "pdserve_decode_local_prefill_fallbacks_total"
    before = cluster.metric("d0", fallbacks, reason="lease_lost")
    call = open_stream(cluster, "d0", "p0", prompt_of(3000, seed=1), max_tokens=4)
    wait_until(lambda: cluster.get_load("p0").in_flight > 0, 30, "p0 to take the prefill")
    cluster.kill("p0", signal.SIGSTOP)  # hung, not dead: its connections stay open, only its lease lapses
    try:
        assert cluster.get_load("d0").kv_blocks_reserved > 0
        # Mid-prefill, no first token yet: the lapsed lease frees the reservation (long before the
        # transfer timeout) and d0 prefills the prompt itself; the caller sees a normal finish.
        messages = drain(call)
        assert messages and messages[-1].finish_reason == pb.FINISH_REASON_LENGTH and not messages[-1].error, messages[-1:]
        assert sum(len(m.token_ids) for m in messages) == 4 and messages[0].prefill_node_id == "d0"
        assert cluster.metric("d0", fallbacks, reason="lease_lost") == before + 1, "freed by the lease"
        cluster.wait_clean(["d0"], timeout_s=5)
        assert "p0" not in cluster.registry_members()
    finally:
        cluster.kill("p0", signal.SIGKILL)


def test_hung_decode_node_lease_loss_frees_prefill_blocks(cluster: LocalCluster) -> None:
    call = open_stream(cluster, "d0", "p1", prompt_of(3000, seed=2), max_tokens=4)
    wait_until(lambda: cluster.get_load("p1").in_flight > 0, 30, "p1 to take the prefill")
    cluster.kill("d0", signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        # d0 cannot take the bytes, so p1 keeps the blocks of the send ...
        wait_until(lambda: cluster.get_load("p1").kv_blocks_held_for_transfer > 0, 10, "p1 to hold the blocks")
        # ... until d0's lease lapses, which drops the send (the transfer timeout is far away).
        cluster.wait_clean(["p1"], timeout_s=TTL_S + 5)
        assert time.monotonic() - stopped < TTL_S + 5 < TRANSFER_TIMEOUT_S
        assert "d0" not in cluster.registry_members()
    finally:
        call.cancel()
        cluster.kill("d0", signal.SIGKILL)


def test_killed_decode_node_leaves_registry_within_ttl_and_prefill_frees(cluster: LocalCluster) -> None:
    call = open_stream(cluster, "d1", "p1", prompt_of(3000, seed=3), max_tokens=4)
    reader = start_thread(drain, call)
    wait_until(lambda: cluster.get_load("p1").in_flight > 0, 30, "p1 to take the prefill")
    cluster.kill("d1", signal.SIGKILL)
    killed = time.monotonic()
    cluster.wait_registry(lambda m: "d1" not in m, timeout_s=TTL_S + 2, what="d1 to leave")
    assert time.monotonic() - killed <= TTL_S + 2
    cluster.wait_clean(["p1"], timeout_s=TTL_S + 2)
    reader.result(timeout=10)
