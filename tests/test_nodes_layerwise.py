"""Layer-wise KV sends on a real cluster (real etcd; prefill node p0 sends layer by layer, p1 runs with
--no-layerwise-send; two decode nodes; gRPC on loopback): greedy tokens equal the single-process engine's
through the layer-wise path with chunked prefill (prompts longer than the prefill node's token budget),
with prefix-cache hits on the prefill side and on the decode side (skipped blocks), with several requests
completing their prefill in one engine step, with a first token that ends the request after its send was
announced, and with cancellation while the send is under way (p2 holds half of each send's layers back); every KV block is accounted for after every
test (the fixtures' integrity checks). The layer-wise path is told apart by p0's own counters."""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node_common.convert import params_to_proto
from pdserve.rpc import pdserve_pb2 as pb
from testing.cluster import GenerateResult, LocalCluster, reference_engine
from testing.faults import Faults

pytestmark = [pytest.mark.timeout(400), pytest.mark.usefixtures("check_integrity_after_each_test")]

BLOCK = 16
BUDGET = 128  # the prefill nodes' max_num_batched_tokens: longer prompts are prefilled in chunks
NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "768", "--block-size", str(BLOCK)]
STALL_S = 4.0  # p2 holds back the second half of each send's layers this long after the prefill
SENDS = "pdserve_prefill_layerwise_sends_total"
STEPS = "pdserve_prefill_layerwise_steps_total"
REPREFILLS = "pdserve_decode_reprefills_total"
FALLBACKS = "pdserve_decode_local_prefill_fallbacks_total"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("layerwise"), model_dir, node_args=NODE_ARGS) as c:
        decode_args = ["--local-prefill-threshold", "32"]
        budget = ["--max-num-batched-tokens", str(BUDGET)]
        c.start_etcd()
        nodes = [c.spawn_node("prefill", "p0", budget), c.spawn_node("prefill", "p1", [*budget, "--no-layerwise-send"]),
                 c.spawn_node("prefill", "p2", budget, faults=Faults(send_stall_s=STALL_S)),
                 c.spawn_node("decode", "d0", decode_args), c.spawn_node("decode", "d1", decode_args)]
        c.wait_ready(nodes)
        yield c
        c.wait_clean()


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> LLMEngine:
    return reference_engine(model_dir, num_kv_blocks=768)


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 4000) for _ in range(n)]


def counters(cluster: LocalCluster) -> dict[str, float]:
    names = {"sends": ("p0", SENDS), "steps": ("p0", STEPS), "p1_sends": ("p1", SENDS),
             "reprefills": ("d0", REPREFILLS), "reprefills1": ("d1", REPREFILLS),
             "fallbacks": ("d0", FALLBACKS), "fallbacks1": ("d1", FALLBACKS)}
    return {k: cluster.metric(node, name) for k, (node, name) in names.items()}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def check_healthy(d: dict[str, float]) -> None:
    """Every transfer landed as sent: nothing was re-prefilled or fell back to a local prefill."""
    assert d["reprefills"] == d["reprefills1"] == d["fallbacks"] == d["fallbacks1"] == 0, d


def test_chunked_prefill_parity_through_both_paths(cluster: LocalCluster, reference: LLMEngine) -> None:
    rng = random.Random(21)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [rand_tokens(rng, n) for n in (3 * BUDGET + 5, BUDGET - 7, 5 * BUDGET)]
    expected = reference.generate(prompts, greedy)
    before = counters(cluster)
    for i, (prompt, exp) in enumerate(zip(prompts, expected, strict=True)):
        res = cluster.generate(f"d{i % 2}", prompt, greedy, prefill_node_id="p0")
        assert res.prefill_node_id == "p0" and not res.error, res.messages[-1]
        assert res.token_ids == exp.token_ids, f"layer-wise send, prompt of {len(prompt)} tokens"
        assert res.text == exp.text
    d = delta(before, counters(cluster))
    assert d["sends"] == len(prompts), "every request's send was queued layer by layer during its prefill"
    # The same prompts without layer-wise sends (p1) give the same tokens and queue nothing early.
    for i, (prompt, exp) in enumerate(zip(prompts, expected, strict=True)):
        res = cluster.generate(f"d{(i + 1) % 2}", list(prompt), greedy, prefill_node_id="p1")
        assert res.prefill_node_id == "p1" and res.token_ids == exp.token_ids
    d = delta(before, counters(cluster))
    assert d["p1_sends"] == 0
    check_healthy(d)


def test_prefix_cache_hits_on_both_sides(cluster: LocalCluster, reference: LLMEngine) -> None:
    rng = random.Random(22)
    shared = rand_tokens(rng, 4 * BLOCK)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    warm, other, skipped = (shared + rand_tokens(rng, n) for n in (70, 90, 150))
    expected = reference.generate([warm, other, skipped], greedy)
    before = counters(cluster)
    cluster.generate("d0", warm, greedy, prefill_node_id="p0")  # caches the prefix on p0 and d0
    # d1 has not seen the prefix: it asks for every block, and p0 serves the prefix from its cache.
    res = cluster.generate("d1", other, greedy, prefill_node_id="p0")
    assert res.messages[-1].num_cached_tokens_prefill >= len(shared), "prefill-side prefix-cache hit expected"
    assert res.messages[-1].num_cached_tokens_decode == 0
    assert res.token_ids == expected[1].token_ids
    # d0 caches the prefix: the send skips those blocks (num_skip_blocks > 0), p0 hits its cache too.
    res = cluster.generate("d0", skipped, greedy, prefill_node_id="p0")
    assert res.messages[-1].num_cached_tokens_decode >= len(shared), "decode-side prefix-cache hit expected"
    assert res.messages[-1].num_cached_tokens_prefill >= len(shared)
    assert res.token_ids == expected[2].token_ids
    d = delta(before, counters(cluster))
    assert d["sends"] == 3
    check_healthy(d)


def test_several_requests_complete_their_prefill_in_one_step(cluster: LocalCluster, reference: LLMEngine) -> None:
    """A long prompt keeps p0's engine busy for many steps while eight short ones (two or three fit a
    step's budget) queue behind it: some step completes several prefills and queues several layer-wise
    sends at once."""
    rng = random.Random(23)
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    shared_steps = False
    for _ in range(3):
        prompts = [rand_tokens(rng, 20 * BUDGET)] + [rand_tokens(rng, 40 + rng.randrange(0, 10)) for _ in range(8)]
        expected = reference.generate(prompts, greedy)
        before = counters(cluster)
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(cluster.generate, f"d{i % 2}", p, greedy, prefill_node_id="p0")
                       for i, p in enumerate(prompts)]
            results: list[GenerateResult] = [f.result() for f in futures]
        for prompt, res, exp in zip(prompts, results, expected, strict=True):
            assert res.prefill_node_id == "p0" and res.token_ids == exp.token_ids, f"prompt of {len(prompt)} tokens"
        d = delta(before, counters(cluster))
        assert d["sends"] == len(prompts)
        check_healthy(d)
        if d["steps"] < d["sends"]:
            shared_steps = True
            break
    assert shared_steps, "no engine step ever completed two prefills"


def test_first_token_that_ends_the_request_after_its_send_was_announced(
        cluster: LocalCluster, reference: LLMEngine) -> None:
    """The first token is a stop token: p0 cannot know that before sampling, so its send was already
    announced and ships; d0 ends the request at that token and frees the reservation once the receive
    is over. max_tokens=1 is known in advance: nothing is queued."""
    rng = random.Random(24)
    prompt = rand_tokens(rng, 2 * BUDGET)
    first = reference.generate([prompt], SamplingParams(max_tokens=1))[0].token_ids[0]
    before = counters(cluster)
    res = cluster.generate("d0", prompt, SamplingParams(max_tokens=20, stop_token_ids=[first]), prefill_node_id="p0")
    assert res.token_ids == [first] and res.finish_reason == "stop" and not res.error
    assert delta(before, counters(cluster))["sends"] == 1
    before = counters(cluster)
    res = cluster.generate("d1", list(prompt), SamplingParams(max_tokens=1), prefill_node_id="p0")
    assert res.token_ids == [first] and res.finish_reason == "length"
    d = delta(before, counters(cluster))
    assert d["sends"] == 0
    check_healthy(d)
    cluster.wait_clean(["p0", "d0", "d1"])


# ------------------------------------------------------------------------------------------ cancellation


@pytest.mark.parametrize("how", ["client-cancel", "abort-rpc"])
def test_cancel_mid_send_frees_every_block(cluster: LocalCluster, reference: LLMEngine, how: str) -> None:
    """p2 ships the first half of each layer-wise send's layers as the prefill computes them and holds
    the rest back STALL_S: the request is cancelled (the client's stream, or the decode node's Abort RPC)
    once its first token is out, with the send announced and half shipped. d0 drains the transfer
    before it frees the reservation, p2 holds its blocks until the send completes; both end clean, and
    the pair channel is still in step for the next request."""
    rng = random.Random(25 + len(how))
    sends = cluster.metric("p2", SENDS)
    reprefills = cluster.metric("d0", REPREFILLS)
    request = pb.GenerateRequest(prompt_token_ids=rand_tokens(rng, 3 * BUDGET), prefill_node_id="p2",
                                 return_text=True, params=params_to_proto(SamplingParams(max_tokens=50, ignore_eos=True)))
    call = cluster.decode_stub("d0").Generate(request, timeout=120)
    stream = iter(call)
    first = next(stream)
    assert first.token_ids and first.prefill_node_id == "p2"
    assert cluster.metric("p2", SENDS) == sends + 1, "the send was queued layer by layer"
    load = cluster.get_load("d0")
    assert load.kv_blocks_reserved > 0, "the receive still holds the reservation (half the layers held back)"
    assert cluster.get_load("p2").kv_blocks_used > 0, "the send still holds its source blocks"
    if how == "client-cancel":
        call.cancel()
        with pytest.raises(grpc.RpcError) as cancelled:
            list(stream)
        assert cancelled.value.code() == grpc.StatusCode.CANCELLED
    else:
        assert cluster.decode_stub("d0").Abort(pb.AbortRequest(request_id=first.request_id)).found
        rest = list(stream)
        assert rest[-1].finished and rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    loads = cluster.wait_clean(["p2", "d0"], timeout_s=STALL_S + 20)
    for load in loads.values():
        assert load.kv_blocks_used == 0 and load.in_flight == 0
    prompt = rand_tokens(rng, 2 * BUDGET)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    res = cluster.generate("d0", prompt, greedy, prefill_node_id="p2")
    assert not res.error and res.token_ids == reference.generate([prompt], greedy)[0].token_ids
    assert cluster.metric("d0", REPREFILLS) == reprefills, "the next transfer over the pair lands"
