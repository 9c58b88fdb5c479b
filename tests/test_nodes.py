"""Prefill and decode nodes as real processes (etcd, 2 prefill + 2 decode nodes, a gRPC client) on loopback:
greedy parity with the single-process engine and transformers, prefix-cache hits on both sides, the
conditional local prefill, and cancellation at every stage ending with every KV block given back.
p0 sends KV layer by layer during the prefill (the default), p1 after the first token
(--no-layerwise-send), so both paths carry the parity tests; cancellation goes through p1, whose send
follows the first token (cancelling a layer-wise send: tests/test_nodes_layerwise.py)."""

from __future__ import annotations

import random
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node_common.convert import params_to_proto
from pdserve.rpc import pdserve_pb2 as pb
from testing.cluster import GenerateResult, LocalCluster
from testing.threads import start_thread
from testing.waits import poll, wait_until

pytestmark = [pytest.mark.timeout(400), pytest.mark.usefixtures("check_integrity_after_each_test")]

BLOCK = 16
THRESHOLD = 32  # decode nodes prefill locally below this many uncached prompt tokens
NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "512", "--block-size", str(BLOCK)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("cluster"), model_dir, node_args=NODE_ARGS) as c:
        decode_args = ["--local-prefill-threshold", str(THRESHOLD)]
        c.start_etcd()
        nodes = [c.spawn_node("prefill", "p0"), c.spawn_node("prefill", "p1", ["--no-layerwise-send"]),
                 c.spawn_node("decode", "d0", decode_args), c.spawn_node("decode", "d1", decode_args)]
        c.wait_ready(nodes)
        yield c
        # Every test leaves both kinds of node with no request and no used block.
        c.wait_clean()


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_greedy(hf_model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=0, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 4000) for _ in range(n)]


def run_concurrently(cluster: LocalCluster, jobs: list[tuple[str, str, list[int], SamplingParams]]) -> list[GenerateResult]:
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [
            pool.submit(cluster.generate, d, prompt, params, prefill_node_id=p) for d, p, prompt, params in jobs
        ]
        return [f.result() for f in futures]


def test_greedy_parity_16_concurrent_over_both_pairs(cluster: LocalCluster, reference: LLMEngine, hf_model) -> None:
    rng = random.Random(11)
    shared = rand_tokens(rng, 3 * BLOCK)
    n = 6
    greedy = SamplingParams(max_tokens=n, ignore_eos=True)

    # Round 1: 16 concurrent requests over both pairs, half of them sharing a 3-block prefix.
    prompts = [shared + rand_tokens(rng, rng.randrange(33, 80)) if i % 2 else rand_tokens(rng, rng.randrange(40, 130))
               for i in range(16)]
    # The shared-prefix prompts (odd i) reach every decode node and every prefill node.
    jobs = [(f"d{(i // 2) % 2}", f"p{(i // 4) % 2}", p, greedy) for i, p in enumerate(prompts)]
    # Round 2: the shared prefix is now cached on both decode nodes and both prefill nodes.
    prompts2 = [shared + rand_tokens(rng, rng.randrange(33, 80)) for _ in range(16)]
    jobs2 = [(f"d{i % 2}", f"p{(i // 2) % 2}", p, greedy) for i, p in enumerate(prompts2)]

    results = run_concurrently(cluster, jobs) + run_concurrently(cluster, jobs2)
    all_prompts = prompts + prompts2
    expected = reference.generate(all_prompts, greedy)
    for (d, p, prompt, _), res, exp in zip(jobs + jobs2, results, expected, strict=True):
        assert res.finish_reason == "length" and not res.error, res
        assert res.prefill_node_id == p, "a long uncached prompt must be prefilled on the hinted prefill node"
        assert res.messages[0].decode_node_id == d
        assert res.token_ids == exp.token_ids, f"prompt of {len(prompt)} tokens via {p}->{d}"
        assert res.token_ids == hf_greedy(hf_model, prompt, n)
        assert res.text == exp.text
    for res in results[16:]:
        last = res.messages[-1]
        assert last.num_cached_tokens_decode >= len(shared), "decode-side prefix-cache hit expected"
        assert last.num_cached_tokens_prefill >= len(shared), "prefill-side prefix-cache hit expected"


def test_short_prompts_prefill_locally_and_match(cluster: LocalCluster, reference: LLMEngine) -> None:
    rng = random.Random(12)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    prompts = [rand_tokens(rng, n) for n in (1, 7, THRESHOLD - 1)]
    expected = reference.generate(prompts, params)
    for prompt, exp in zip(prompts, expected, strict=True):
        res = cluster.generate("d0", prompt, params, prefill_node_id="p0")
        assert res.prefill_node_id == "d0", "a prompt under the threshold is prefilled on the decode node"
        assert res.token_ids == exp.token_ids
    forced = rand_tokens(rng, 100)
    res = cluster.generate("d1", forced, params, force_local_prefill=True)
    assert res.prefill_node_id == "d1" and res.token_ids == reference.generate([forced], params)[0].token_ids


def test_sampling_logprobs_and_stop_strings_survive_the_handoff(cluster: LocalCluster, reference: LLMEngine) -> None:
    rng = random.Random(13)
    prompt = rand_tokens(rng, 90)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True, logprobs=2,
                            repetition_penalty=1.1, presence_penalty=0.3)
    exp = reference.generate([prompt], seeded)[0]
    res = cluster.generate("d1", prompt, seeded, prefill_node_id="p0")
    assert res.prefill_node_id == "p0"
    assert res.token_ids == exp.token_ids, "a seeded request continues the same random stream after the hand-off"
    lps = [lp for m in res.messages for lp in m.logprobs]
    assert [lp.token_id for lp in lps] == [lp.token_id for lp in exp.logprobs]
    for got, want in zip(lps, exp.logprobs, strict=True):
        assert abs(got.logprob - want.logprob) < 1e-3 and list(got.top_token_ids) == [t for t, _ in want.top]

    # A stop string cut from the reference text ends the disaggregated request at the same place.
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    full = reference.generate([prompt], greedy)[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    if stop.strip():
        with_stop = SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop])
        exp = reference.generate([prompt], with_stop)[0]
        res = cluster.generate("d0", prompt, with_stop, prefill_node_id="p1")
        assert (res.text, res.finish_reason) == (exp.text, exp.finish_reason)
    # max_tokens=1: the first token is the whole answer, nothing is shipped.
    one = SamplingParams(max_tokens=1)
    res = cluster.generate("d0", prompt, one, prefill_node_id="p1")
    assert res.token_ids == reference.generate([prompt], one)[0].token_ids and res.finish_reason == "length"


def test_tokens_are_batched_per_message_when_they_come_fast(cluster: LocalCluster) -> None:
    rng = random.Random(14)
    res = cluster.generate("d0", rand_tokens(rng, 20), SamplingParams(max_tokens=200, ignore_eos=True))
    assert len(res.token_ids) == 200
    assert res.messages[0].token_ids, "the first message carries the first token"
    # The client reads slower than the engine decodes at least now and then (one message per token
    # would be exactly 200 messages).
    assert len(res.messages) <= 200


# ------------------------------------------------------------------------------------------ cancellation


def start_stream(cluster: LocalCluster, decode: str, prefill: str, prompt: list[int], max_tokens: int) -> grpc.Future:
    request = pb.GenerateRequest(
        prompt_token_ids=prompt, params=params_to_proto(SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
        prefill_node_id=prefill, return_text=True,
    )
    return cluster.decode_stub(decode).Generate(request, timeout=120)


def cancel_at(cluster: LocalCluster, stage: str, prompt: list[int]) -> bool:
    """Starts a request over p1->d0 and cancels it at `stage`; returns whether the cancel really came
    at that stage (checked from the nodes' own loads and what the client had received)."""
    call = start_stream(cluster, "d0", "p1", prompt, max_tokens=1000 if stage == "decode" else 4)
    received: list[pb.GenerateResponse] = []
    first = threading.Event()

    def read() -> None:
        try:
            for msg in call:
                received.append(msg)
                first.set()
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.CANCELLED, err

    reader = start_thread(read)
    hit = False
    if stage == "prefill":
        # p1 has the request and the client has no token yet.
        ok = poll(lambda: cluster.get_load("p1").in_flight > 0, 10, interval_s=0.001)
        hit = ok and not first.is_set()
        call.cancel()
        hit = hit and not received
    elif stage == "transfer":
        # The first token is out while d0 still holds the reservation the transfer is writing.
        first.wait(30)
        hit = cluster.get_load("d0").kv_blocks_reserved > 0
        call.cancel()
    else:
        poll(lambda: sum(len(m.token_ids) for m in received) >= 5, 30, interval_s=0.001)
        load = cluster.get_load("d0")
        hit = load.running == 1 and load.kv_blocks_reserved == 0
        call.cancel()
    reader.result(timeout=30)  # re-raises the reader's failure
    loads = cluster.wait_clean(["p1", "d0"], timeout_s=20)
    for load in loads.values():
        assert load.kv_blocks_used == 0 and load.in_flight == 0
    return hit


@pytest.mark.parametrize("stage", ["prefill", "transfer", "decode"])
def test_cancel_frees_every_block_on_both_nodes(cluster: LocalCluster, stage: str) -> None:
    rng = random.Random(hash(stage) % 1000)
    hits = 0
    for _ in range(6):
        # Long fresh prompts make the prefill and the transfer last long enough to be hit.
        hits += cancel_at(cluster, stage, rand_tokens(rng, 3000))
        if hits:
            break
    assert hits, f"never managed to cancel during {stage}"


def test_reservation_queue_waits_then_refuses_when_blocks_run_out(cluster: LocalCluster) -> None:
    # A decode node whose KV cache holds one 3000-token request (188 blocks + decode growth) but not two;
    # its queue is set with the flags' older names, the aliases deploy scripts may still use.
    small = cluster.spawn_node("decode", "dq", ["--num-kv-blocks", "300", "--admission-queue-limit", "1",
                                                "--admission-timeout", "60", "--local-prefill-threshold", "32"])
    cluster.wait_ready([small])
    try:
        rng = random.Random(16)
        first = start_stream(cluster, "dq", "p0", rand_tokens(rng, 3000), max_tokens=1000)
        assert next(iter(first)).token_ids  # decoding, holding 188+ blocks
        queued_prompt = rand_tokens(rng, 3000)
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(cluster.generate, "dq", queued_prompt, SamplingParams(max_tokens=3, ignore_eos=True),
                                 prefill_node_id="p1")
            assert poll(lambda: cluster.get_load("dq").reservation_queue == 1, 10), "the second request waits"
            assert cluster.get_load("p1").in_flight == 0, "no prefill work is spent before blocks are reserved"
            with pytest.raises(grpc.RpcError) as refused:
                cluster.generate("dq", rand_tokens(rng, 3000), SamplingParams(max_tokens=3), prefill_node_id="p1")
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            first.cancel()  # its blocks come back and the queued request goes through
            res = queued.result(timeout=60)
        assert res.finish_reason == "length" and len(res.token_ids) == 3 and res.prefill_node_id == "p1"
        cluster.wait_clean(["dq", "p0", "p1"])
    finally:
        cluster.kill("dq", signal.SIGTERM)


def test_a_full_prefill_queue_sends_new_requests_to_local_prefill(cluster: LocalCluster, reference: LLMEngine) -> None:
    """--max-prefill-queue-tokens: while this decode node's request waits at a (stopped) prefill node,
    the next requests are prefilled on the decode node; every one matches the single-process engine."""
    dq = cluster.spawn_node("decode", "dq", ["--local-prefill-threshold", str(THRESHOLD),
                                             "--max-prefill-queue-tokens", "100"])
    cluster.wait_ready([dq])
    try:
        rng = random.Random(17)
        prompts = [rand_tokens(rng, 300) for _ in range(3)]
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        expected = reference.generate(prompts, params)
        cluster.kill("p1", signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(1) as pool:
                first = pool.submit(cluster.generate, "dq", prompts[0], params, prefill_node_id="p1")
                # Routed to p1, where it waits (300 queued tokens >= 100), holding blocks for p1's KV.
                wait_until(lambda: cluster.get_load("dq").kv_blocks_reserved > 0, 30, "dq to reserve its blocks")
                local = [cluster.generate("dq", p, params, prefill_node_id="p1") for p in prompts[1:]]
                cluster.kill("p1", signal.SIGCONT)
                remote = first.result(timeout=60)
        finally:
            cluster.kill("p1", signal.SIGCONT)
        assert remote.prefill_node_id == "p1" and [r.prefill_node_id for r in local] == ["dq", "dq"]
        assert cluster.metric("dq", "pdserve_decode_queue_local_prefills_total") == 2
        for res, exp in zip([remote, *local], expected, strict=True):
            assert res.finish_reason == "length" and res.token_ids == exp.token_ids
        cluster.wait_clean(["dq", "p0", "p1"])
    finally:
        cluster.kill("dq", signal.SIGTERM)


def test_abort_rpc_and_load_records_in_registry(cluster: LocalCluster) -> None:
    rng = random.Random(15)
    call = start_stream(cluster, "d1", "p1", rand_tokens(rng, 100), max_tokens=3000)
    first = next(iter(call))
    assert first.token_ids
    assert cluster.decode_stub("d1").Abort(pb.AbortRequest(request_id=first.request_id)).found
    rest = list(call)
    assert rest and rest[-1].finished and rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    cluster.wait_clean()

    # The registry load records (republished about once a second) show the same: no used blocks.
    def all_idle(members: dict) -> bool:
        loads = [m.load for m in members.values()]
        return len(loads) == 4 and all(
            load is not None and load.kv_blocks_used == 0 and load.running == 0 and load.queue_len == 0
            and load.in_flight == 0
            for load in loads
        )

    members = cluster.wait_registry(all_idle, timeout_s=10, what="every node idle with zero used blocks")
    assert {m.role for m in members.values()} == {"prefill", "decode"}
