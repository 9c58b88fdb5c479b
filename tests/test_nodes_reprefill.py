"""A KV transfer that fails after the first token was streamed is invisible to the caller (real etcd, six
prefill node processes with test fault injection, one decode node, on loopback): the decode node waits
until no receive can write the reservation, frees it, prefills prompt + first token itself and goes on
decoding, so the stream has neither gap nor repeat and its text equals the uninterrupted run's; the
re-prefill is counted by reason, the fallback counter (failures before the first token) is not, and every
node ends with zero used KV blocks and a clean integrity check.

Injected failures, one per test (`testing.faults.Faults`): the prefill node SIGKILLed after its first
token (its send held back by `send_delay_s`), SIGKILLed with its send announced and half of it shipped
(`send_stall_s`), SIGSTOPped after its first token until its lease lapses (it leaves the registry),
reporting its send as failed (`send_failed`), stalling half-way through the send past the decode node's
receive timeout (`send_stall_s`), and flipping one byte of the staged KV after its checksum was taken
(`send_corrupt`), which the decode node must catch and never serve."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node_common.convert import params_to_proto
from pdserve.rpc import pdserve_pb2 as pb
from testing.cluster import LocalCluster, random_prompt
from testing.faults import Faults

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("check_integrity_after_each_test")]

NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "512", "--block-size", "16"]
RECEIVE_TIMEOUT_S = 3.0  # d0's bound on one receive; the tiny model's transfers take milliseconds
STALL_S = 30.0  # p-stall's held-back layers come far after d0's receive deadline
REPREFILLS = "pdserve_decode_reprefills_total"
CHECKSUM_FAILURES = "pdserve_decode_kv_checksum_failures_total"
FALLBACKS = "pdserve_decode_local_prefill_fallbacks_total"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("reprefill"), model_dir, node_args=NODE_ARGS) as c:
        c.start_etcd()
        c.wait_ready([
            c.spawn_node("prefill", "p-kill", faults=Faults(send_delay_s=60.0)),
            c.spawn_node("prefill", "p-stop", faults=Faults(send_delay_s=60.0)),
            c.spawn_node("prefill", "p-kill-mid", faults=Faults(send_stall_s=60.0)),
            c.spawn_node("prefill", "p-fail", faults=Faults(send_failed=True)),
            c.spawn_node("prefill", "p-stall", faults=Faults(send_stall_s=STALL_S)),
            c.spawn_node("prefill", "p-corrupt", faults=Faults(send_corrupt=True)),
            c.spawn_node("decode", "d0", ["--local-prefill-threshold", "32", "--transfer-timeout", str(RECEIVE_TIMEOUT_S)]),
        ])
        yield c
        c.wait_clean()


def prompt_of(n: int, seed: int) -> list[int]:
    return random_prompt(n, seed)


def generate_with_fault(cluster: LocalCluster, prefill: str, prompt: list[int], params: SamplingParams,
                        after_first_token: Callable[[], None] = lambda: None) -> list[pb.GenerateResponse]:
    """Streams a request from d0 prefilled on `prefill`, runs `after_first_token` once the first token
    arrived (from the prefill node), and returns every message."""
    request = pb.GenerateRequest(prompt_token_ids=prompt, params=params_to_proto(params), prefill_node_id=prefill,
                                 return_text=True)
    stream = iter(cluster.decode_stub("d0").Generate(request, timeout=120))
    first = next(stream)
    assert first.token_ids and first.prefill_node_id == prefill, first
    after_first_token()
    return [first, *stream]


def assert_reprefilled(cluster: LocalCluster, reference: LLMEngine, prompt: list[int], params: SamplingParams,
                       messages: list[pb.GenerateResponse], reason: str, before: dict[str, float]) -> None:
    """The uninterrupted run's tokens and text, a normal finish, one re-prefill under `reason`, no
    fallback, and d0 clean."""
    want = reference.generate([prompt], params)[0]
    last = messages[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and not last.error, last
    assert [t for m in messages for t in m.token_ids] == want.token_ids
    assert "".join(m.text for m in messages) == want.text
    assert last.num_completion_tokens == params.max_tokens
    assert cluster.metric("d0", REPREFILLS, reason=reason) == before[reason] + 1
    assert cluster.metric("d0", REPREFILLS) == before[""] + 1 and cluster.metric("d0", FALLBACKS) == before["fallbacks"]
    cluster.wait_clean(["d0"], timeout_s=10)


def counters(cluster: LocalCluster, reason: str) -> dict[str, float]:
    return {reason: cluster.metric("d0", REPREFILLS, reason=reason), "": cluster.metric("d0", REPREFILLS),
            "fallbacks": cluster.metric("d0", FALLBACKS)}


def test_prefill_node_killed_after_its_first_token(cluster: LocalCluster, reference: LLMEngine) -> None:
    """SIGKILL after the first token, before the send: the Prefill call fails (unavailable)."""
    prompt, params = prompt_of(300, seed=1), SamplingParams(max_tokens=12, ignore_eos=True)
    before = counters(cluster, "unavailable")
    try:
        messages = generate_with_fault(cluster, "p-kill", prompt, params, lambda: cluster.kill("p-kill", signal.SIGKILL))
    finally:
        cluster.kill("p-kill", signal.SIGKILL)
    assert_reprefilled(cluster, reference, prompt, params, messages, "unavailable", before)


def test_prefill_node_killed_in_the_middle_of_its_send(cluster: LocalCluster, reference: LLMEngine) -> None:
    """SIGKILL while the send is announced and half shipped (its other layers held back): whichever the
    decode node notices first, the failed call (unavailable) or the dead peer under the posted receive
    (receive_failed), the receive resolves before the reservation is freed and the request goes on."""
    prompt, params = prompt_of(280, seed=6), SamplingParams(max_tokens=12, ignore_eos=True)
    before = {**counters(cluster, "unavailable"), "receive_failed": cluster.metric("d0", REPREFILLS, reason="receive_failed")}
    try:
        messages = generate_with_fault(cluster, "p-kill-mid", prompt, params,
                                       lambda: cluster.kill("p-kill-mid", signal.SIGKILL))
    finally:
        cluster.kill("p-kill-mid", signal.SIGKILL)
    reason = next(r for r in ("unavailable", "receive_failed") if cluster.metric("d0", REPREFILLS, reason=r) > before[r])
    assert_reprefilled(cluster, reference, prompt, params, messages, reason, before)


def test_prefill_node_leaving_the_registry_after_its_first_token(cluster: LocalCluster, reference: LLMEngine) -> None:
    """SIGSTOP after the first token: hung, its connections open, only its lease lapses (lease_lost)."""
    prompt, params = prompt_of(300, seed=2), SamplingParams(max_tokens=12, ignore_eos=True)
    before = counters(cluster, "lease_lost")
    try:
        messages = generate_with_fault(cluster, "p-stop", prompt, params, lambda: cluster.kill("p-stop", signal.SIGSTOP))
        assert "p-stop" not in cluster.registry_members()
    finally:
        cluster.kill("p-stop", signal.SIGKILL)
    assert_reprefilled(cluster, reference, prompt, params, messages, "lease_lost", before)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=77, max_tokens=12, ignore_eos=True, presence_penalty=0.4),
], ids=["greedy", "seeded"])
def test_transfer_done_not_ok(cluster: LocalCluster, reference: LLMEngine, params: SamplingParams) -> None:
    """The prefill node reports its send as failed (TransferDone ok=false): the bytes are not used, and
    the seeded sampler continues after the prefill node's first token as if nothing happened."""
    prompt = prompt_of(200, seed=3 + (params.seed or 0))
    before = counters(cluster, "send_failed")
    messages = generate_with_fault(cluster, "p-fail", prompt, params)
    assert_reprefilled(cluster, reference, prompt, params, messages, "send_failed", before)
    cluster.wait_clean(["p-fail"], timeout_s=10)


def test_receive_timeout_mid_transfer(cluster: LocalCluster, reference: LLMEngine) -> None:
    """Half the layers arrive, the rest are held back past d0's receive deadline (timeout): d0 gives up
    on the transfer long before the prefill node would finish it."""
    prompt, params = prompt_of(250, seed=4), SamplingParams(max_tokens=12, ignore_eos=True)
    before = counters(cluster, "timeout")
    messages = generate_with_fault(cluster, "p-stall", prompt, params)
    assert_reprefilled(cluster, reference, prompt, params, messages, "timeout", before)
    cluster.wait_clean(["p-stall"], timeout_s=STALL_S + 10)


def test_corrupted_byte_in_flight_is_caught_and_never_served(cluster: LocalCluster, reference: LLMEngine) -> None:
    """One byte of the staged KV flipped after the prefill node's checksum: the decode node's digest of
    what arrived differs, the transfer fails (checksum), the blocks are never served, and the request
    still ends with the uninterrupted run's greedy text."""
    prompt, params = prompt_of(220, seed=5), SamplingParams(max_tokens=12, ignore_eos=True)
    before = counters(cluster, "checksum")
    failures = cluster.metric("d0", CHECKSUM_FAILURES)
    messages = generate_with_fault(cluster, "p-corrupt", prompt, params)
    assert cluster.metric("d0", CHECKSUM_FAILURES) == failures + 1
    assert_reprefilled(cluster, reference, prompt, params, messages, "checksum", before)
    cluster.wait_clean(["p-corrupt"], timeout_s=10)
