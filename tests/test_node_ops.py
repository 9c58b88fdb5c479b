"""Node operations on a real cluster (etcd, one prefill and one decode node process): /metrics with the
catalogue's names, labels and buckets and values that match the requests served; the TTFT stage times
in the Generate stream; gRPC health; drain with `pdserve drain` (a request that ends within the drain grace
finishes, a longer one is handed over with finish reason HAND_OVER and its blocks freed, node out of the
registry, new work refused) and graceful exit on SIGTERM leaving no registry key."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve.deploy.launcher import registry_keys
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tiny import default_model_dir
from pdserve.engine.version import pdserve_version
from pdserve.node_common.convert import params_to_proto
from pdserve.node_common.metrics import LATENCY_BUCKETS
from pdserve.rpc import pdserve_pb2 as pb
from testing.cluster import REPO_ROOT, LocalCluster
from testing.threads import start_thread

pytestmark = pytest.mark.timeout(300)

NUM_BLOCKS = 256
NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", str(NUM_BLOCKS), "--block-size", "16",
             "--model-name", "tiny", "--load-interval", "0.5"]
DRAIN_GRACE_S = 1.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

COMMON = {"pdserve_prefix_cache_queries", "pdserve_prefix_cache_hits", "pdserve_kv_blocks", "pdserve_kv_usage_ratio",
          "pdserve_requests_running", "pdserve_requests_waiting", "pdserve_preemptions", "pdserve_build_info",
          "pdserve_model_info", "pdserve_node_step_failures", "pdserve_node_step_running_seconds", "pdserve_node_healthy",
          "pdserve_embedding_requests", "pdserve_embedding_inputs", "pdserve_embedding_tokens", "pdserve_kv_channel_auth_failures"}
EXPECTED = {
    "prefill": COMMON | {"pdserve_prefill_queue_seconds", "pdserve_prefill_time_seconds", "pdserve_prefill_batch_tokens",
                         "pdserve_prefill_tokens", "pdserve_kv_transfer_seconds", "pdserve_kv_transfer_bytes",
                         "pdserve_kv_transfer_failures", "pdserve_prefill_layerwise_sends", "pdserve_prefill_layerwise_steps"},
    "decode": COMMON | {"pdserve_decode_first_step_seconds", "pdserve_decode_itl_seconds", "pdserve_decode_batch_size",
                        "pdserve_decode_tokens", "pdserve_decode_local_prefill_fallbacks", "pdserve_decode_reprefills",
                        "pdserve_decode_kv_checksum_failures", "pdserve_decode_queue_local_prefills",
                        "pdserve_spec_draft_tokens", "pdserve_spec_accepted_tokens", "pdserve_spec_emitted_tokens",
                        "pdserve_spec_draft_steps", "pdserve_decode_seq_steps", "pdserve_decode_seq_tokens"},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("ops"), default_model_dir("llama"), node_args=NODE_ARGS) as c:
        c.start(1, 1, decode_args=["--local-prefill-threshold", "8", "--drain-grace", str(DRAIN_GRACE_S)])
        yield c


@pytest.fixture(autouse=True)
def _check_integrity_after_each_test(cluster: LocalCluster) -> Iterator[None]:
    """Every node's blocks, requests, streams and reservations agree after every test."""
    yield
    cluster.check_integrity()


def scrape(cluster: LocalCluster, node_id: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """name -> samples (sample name, labels, value) of the node's /metrics."""
    address = cluster.nodes[node_id].info["metrics_address"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def value(families: dict[str, list[tuple[str, dict[str, str], float]]], sample: str, **labels: str) -> float:
    return sum(v for name, lab, v in (s for f in families.values() for s in f)
               if name == sample and all(lab.get(k) == want for k, want in labels.items()))


def health(cluster: LocalCluster, node_id: str, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(cluster.channel(node_id))
    return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)


def test_metrics_follow_the_catalogue(cluster: LocalCluster) -> None:
    prompt = list(range(100, 150))  # 50 tokens: above the local-prefill threshold, so prefilled on p0
    first = cluster.generate("d0", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    assert first.prefill_node_id == "p0" and len(first.token_ids) == 8
    timing = first.messages[-1].timing
    assert timing.prefill_s > 0 and timing.transfer_s > 0 and timing.first_decode_step_s > 0
    assert timing.prefill_queue_s >= 0 and timing.reservation_wait_s >= 0
    again = cluster.generate("d0", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    assert again.num_cached_tokens > 0  # the decode node's prefix cache now holds the prompt's full blocks
    cluster.wait_clean()

    for node_id, pool in (("p0", "prefill"), ("d0", "decode")):
        families = scrape(cluster, node_id)
        ours = {name for name in families if name.startswith("pdserve_")}
        assert ours == EXPECTED[pool], f"{pool}: unexpected {ours ^ EXPECTED[pool]}"
        for name in ours:
            for sample, labels, _ in families[name]:
                assert {k: labels[k] for k in ("pool", "node", "model")} == {"pool": pool, "node": node_id,
                                                                              "model": "tiny"}, sample
        blocks = {lab["state"]: v for name, lab, v in families["pdserve_kv_blocks"]}
        assert set(blocks) == {"used", "held", "cached", "free"} and sum(blocks.values()) == NUM_BLOCKS
        assert blocks["used"] == blocks["held"] == 0 and blocks["cached"] > 0  # idle, prompt blocks cached
        assert value(families, "pdserve_requests_running") == value(families, "pdserve_requests_waiting") == 0
        # Health from progress and versions: a healthy node with no failed step; its model's fingerprint.
        assert value(families, "pdserve_node_healthy") == 1 and value(families, "pdserve_node_step_failures_total") == 0
        assert value(families, "pdserve_build_info", version=pdserve_version()) == 1
        fingerprint = cluster.nodes[node_id].info["fingerprint"][:16]
        assert value(families, "pdserve_model_info", fingerprint=fingerprint, dtype="float32") == 1

    p0, d0 = scrape(cluster, "p0"), scrape(cluster, "d0")
    bounds = sorted({float(lab["le"]) for name, lab, _ in p0["pdserve_prefill_queue_seconds"] if "le" in lab})
    assert bounds == [*LATENCY_BUCKETS, float("inf")]
    assert value(p0, "pdserve_prefill_tokens_total") == 50  # computed once; the repeat was a decode-side hit
    assert value(p0, "pdserve_prefill_queue_seconds_count") == value(p0, "pdserve_prefill_time_seconds_count") == 1
    assert value(p0, "pdserve_kv_transfer_seconds_count") == 1
    assert value(p0, "pdserve_kv_transfer_bytes_total") > 0
    assert value(p0, "pdserve_kv_transfer_failures_total") == 0
    assert value(d0, "pdserve_decode_first_step_seconds_count") == 1
    # Remote: 7 decode steps after the prefill node's token; local repeat: its prefill step plus 3 more.
    assert value(d0, "pdserve_decode_tokens_total") == 7 + 4
    assert value(d0, "pdserve_decode_itl_seconds_count") == 6 + 3
    assert value(d0, "pdserve_prefix_cache_hits_total") >= 48
    assert value(d0, "pdserve_prefix_cache_queries_total") >= 100


def test_health_drain_and_graceful_exit(cluster: LocalCluster) -> None:
    for node_id, service in (("p0", "pdserve.v1.PrefillNode"), ("d0", "pdserve.v1.DecodeNode")):
        assert health(cluster, node_id, "") == SERVING
        assert health(cluster, node_id, service) == SERVING

    # Two requests are decoding on d0 when the drain starts: a short one ends within the drain's grace and
    # finishes; a long one is still running when the grace is over and is handed over (its stream ends
    # with finish reason HAND_OVER, for the frontend to continue it elsewhere), and its blocks are freed.
    streams = {}
    for rid, max_tokens in (("short", 30), ("long", 4000)):
        request = pb.GenerateRequest(request_id=rid, prompt_token_ids=list(range(200, 260)),
                                     params=params_to_proto(SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        streams[rid] = cluster.decode_stub("d0").Generate(request, timeout=120)
    tokens: dict[str, list[int]] = {rid: [] for rid in streams}
    last: dict[str, pb.GenerateResponse] = {}
    finished_at: dict[str, float] = {}
    for rid, stream in streams.items():
        msg = next(stream)
        tokens[rid].extend(msg.token_ids)
        last[rid] = msg

    def read_rest(rid: str) -> None:
        for msg in streams[rid]:
            tokens[rid].extend(msg.token_ids)
            last[rid] = msg
        finished_at[rid] = time.monotonic()

    readers = [start_thread(read_rest, rid) for rid in streams]
    drain_started = time.monotonic()
    drain = subprocess.run(
        [sys.executable, "-m", "pdserve.deploy", "drain", "--grpc", cluster.nodes["d0"].grpc_address, "--timeout", "90"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    drain_ended = time.monotonic()
    for reader in readers:
        reader.result(timeout=60)
    assert drain.returncode == 0, drain.stderr
    assert "0 request(s) in flight" in drain.stdout
    assert len(tokens["short"]) == 30 and last["short"].finish_reason == pb.FINISH_REASON_LENGTH, "the short request finished"
    assert last["long"].finished and last["long"].finish_reason == pb.FINISH_REASON_HAND_OVER, last["long"]
    assert 0 < len(tokens["long"]) < 4000 and last["long"].num_completion_tokens in (0, len(tokens["long"]))
    assert finished_at["long"] - drain_started >= DRAIN_GRACE_S, "the long request ran for the drain's grace"
    assert drain_started < finished_at["long"] <= drain_ended, "the drain returned once the request was handed over"
    load = cluster.get_load("d0")
    assert load.in_flight == 0 and load.kv_blocks_used == 0 and load.running == 0, load

    assert health(cluster, "d0", "pdserve.v1.DecodeNode") == NOT_SERVING
    assert health(cluster, "d0", "") == SERVING  # still alive: liveness holds while drained
    assert "d0" not in cluster.registry_members()
    with pytest.raises(grpc.RpcError) as refused:
        cluster.generate("d0", [5, 6, 7], SamplingParams(max_tokens=2))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    # SIGTERM: a drained node exits at once; a serving one drains, then exits; no registry key is left.
    for node_id in ("d0", "p0"):
        started = time.monotonic()
        cluster.kill(node_id, signal.SIGTERM)
        assert cluster.nodes[node_id].proc.returncode == 0, cluster.nodes[node_id].log_tail()
        assert time.monotonic() - started < 10
    assert cluster.etcd is not None
    assert registry_keys(cluster.etcd.endpoints, cluster.cluster) == []
