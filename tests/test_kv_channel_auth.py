"""Authenticated KV channels (`kv_transfer.auth`), with real processes: a prefill and a decode node holding
the cluster token (etcd, gloo on loopback, the tiny model in float32) and, as a process of its own, a
stranger at the prefill node's KV port that presents no token, a wrong one, garbage, a bare TCPStore client,
or silence. Each is refused and cut off before any rendezvous (its connection closed, no KV byte sent),
counted under its reason and logged once for its address, and the node serves on: a request through the
pair afterwards yields the single-process engine's text. In-process: channels with a token carry
tensors; a manager with a wrong token or none cannot open one; what the handshake adds to a channel open."""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import ChannelConfig, ChannelError, ChannelManager
from pdserve.kv_transfer.auth import FailureReason
from testing.cluster import LocalCluster, random_prompt
from testing.waits import wait_until

pytestmark = pytest.mark.timeout(300)

REPO_ROOT = Path(__file__).resolve().parents[1]
HANDSHAKE_TIMEOUT_S = 1.0
NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "256", "--block-size", "16",
             "--kv-handshake-timeout", str(HANDSHAKE_TIMEOUT_S)]
AUTH_FAILURES = "pdserve_kv_channel_auth_failures_total"
SENT_BYTES = "pdserve_kv_transfer_bytes_total"
REFUSAL_LOG = "refused a connection from"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    assert os.environ.get("PDSERVE_CLUSTER_TOKEN"), "the nodes inherit the cluster token (tests/conftest.py)"
    with LocalCluster(tmp_path_factory.mktemp("kvauth"), model_dir, node_args=NODE_ARGS) as c:
        c.start_etcd()
        c.wait_ready([c.spawn_node("prefill", "p0"), c.spawn_node("decode", "d0", ["--local-prefill-threshold", "0"])])
        c.wait_registry(lambda m: {"p0", "d0"} <= m.keys(), timeout_s=30, what="both nodes")
        yield c
        c.wait_clean()


def probe(cluster: LocalCluster, mode: str, *extra: str, env: dict[str, str] | None = None) -> dict[str, object]:
    """Runs testing.kv_probe against p0's KV port in a process of its own; its JSON verdict."""
    address = str(cluster.nodes["p0"].info["kv_address"])
    out = subprocess.run([sys.executable, "-m", "testing.kv_probe", address, "p0", mode, *extra], cwd=REPO_ROOT,
                         env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def failures(cluster: LocalCluster) -> dict[str, float]:
    return {r.value: cluster.metric("p0", AUTH_FAILURES, reason=r.value) for r in FailureReason}


@pytest.mark.serial  # a refusal median under 50 ms
@pytest.mark.usefixtures("check_integrity_after_each_test")
def test_strangers_are_refused_before_any_rendezvous_and_the_node_serves_on(
        cluster: LocalCluster, reference: LLMEngine) -> None:
    before = failures(cluster)
    assert set(before) == {"no_token", "bad_response", "timeout", "protocol"}  # every series exported from start
    sent_before = cluster.metric("p0", SENT_BYTES)
    expected = dict(before)

    def moved(reason: str) -> None:
        expected[reason] += 1
        wait_until(lambda: failures(cluster) == expected, 10, f"the {reason} refusal counted (once)")

    got = probe(cluster, "no_token")
    assert got["refused"] and "no cluster token" in str(got["error"]), got
    moved("no_token")

    got = probe(cluster, "wrong_token", env={"KV_PROBE_TOKEN": secrets.token_urlsafe(24)})
    assert got["refused"] and "not the peer's" in str(got["error"]), got
    moved("bad_response")

    got = probe(cluster, "garbage")
    assert got == {"closed": True, "received_bytes": 0}, got  # cut off without one byte back
    moved("protocol")

    got = probe(cluster, "tcpstore")  # what a node without the token would do: no store answer for it
    assert got["refused"], got
    assert failures(cluster)["protocol"] >= expected["protocol"] + 1  # the client may retry its connect
    expected["protocol"] = failures(cluster)["protocol"]

    got = probe(cluster, "silent")
    assert got["closed"] and got["received_bytes"] == 0, got
    assert HANDSHAKE_TIMEOUT_S * 0.9 <= float(got["closed_after_s"]) < HANDSHAKE_TIMEOUT_S + 3, got
    # The silent peer held only its own thread: a handshake with the token went through meanwhile.
    assert got["good_while_silent"] == {"refused": False, "error": ""}, got
    assert float(got["good_while_silent_s"]) < HANDSHAKE_TIMEOUT_S, got
    moved("timeout")

    # Nothing moved on the data plane, and the log names the address once, not once per refusal.
    assert cluster.metric("p0", SENT_BYTES) == sent_before
    log = cluster.nodes["p0"].log_tail(200_000)
    assert log.count(REFUSAL_LOG) == 1 and "127.0.0.1:" in log, log[-3000:]

    # The pair still works: a request prefilled on p0 and decoded on d0 yields the reference's text.
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = random_prompt(90, seed=4242)
    res = cluster.generate("d0", prompt, greedy, prefill_node_id="p0")
    exp = reference.generate([prompt], greedy)[0]
    assert res.error == "" and res.prefill_node_id == "p0"
    assert res.token_ids == exp.token_ids and res.text == exp.text
    assert cluster.metric("p0", SENT_BYTES) > sent_before  # through the KV channel, not a local prefill
    assert failures(cluster) == expected  # the nodes' own channel passed the handshake


@pytest.mark.usefixtures("check_integrity_after_each_test")
def test_handshake_cost_per_channel_open(cluster: LocalCluster) -> None:
    """What a peer pays to be admitted by a real node's KV port, measured from another process."""
    got = probe(cluster, "open", "50")
    print(f"\nKV handshake, loopback, separate process: median {got['median_ms']:.2f} ms, max {got['max_ms']:.2f} ms "
          f"over {got['n']} channel opens")
    assert got["n"] == 50 and float(got["median_ms"]) < 50.0, got


# -- in-process: the channel manager with and without a token -------------------------------------------------

TOKEN = "kv-test-" + secrets.token_hex(12)


def _open_and_send(prefill: ChannelManager, decode: ChannelManager) -> torch.Tensor:
    ch = prefill.channel_to(decode.config.node_id)
    peer = decode.channel_from(prefill.config.node_id, prefill.kv_address, ch.key.epoch)
    send, recv = ch.wait_connected(10), peer.wait_connected(10)
    x, y = torch.arange(64, dtype=torch.float32), torch.zeros(64)
    ops = [send.isend(x, 1, 0), recv.irecv(y, 0, 0)]
    for op in ops:
        op.wait(time.monotonic() + 10)
    prefill.close_peer(decode.config.node_id, "test done")
    decode.close_peer(prefill.config.node_id, "test done")
    return y


def test_managers_with_the_token_carry_tensors_and_others_cannot_open() -> None:
    seen: list[tuple[FailureReason, str]] = []
    with ChannelManager(ChannelConfig("p-auth", "prefill", "127.0.0.1:0", token=TOKEN, handshake_timeout_s=1.0),
                        on_auth_failure=lambda r, peer: seen.append((r, peer))) as prefill:
        with ChannelManager(ChannelConfig("d-auth", "decode", "127.0.0.1:0", token=TOKEN)) as decode:
            assert torch.equal(_open_and_send(prefill, decode), torch.arange(64, dtype=torch.float32))
        for token, reason in ((TOKEN[::-1], FailureReason.BAD_RESPONSE), ("", FailureReason.PROTOCOL)):
            # A wrong token, or none (its store client then speaks straight to the gate).
            cfg = ChannelConfig("d-auth", "decode", "127.0.0.1:0", token=token, connect_timeout_s=3.0)
            with ChannelManager(cfg) as stranger:
                ch = stranger.channel_from("p-auth", prefill.kv_address, time.time_ns() // 1000)
                with pytest.raises(ChannelError):
                    ch.wait_connected(10)
            wait_until(lambda r=reason: prefill.auth_failures[r] >= 1, 10, f"{reason.value} counted")
        assert {r for r, _ in seen} == {FailureReason.BAD_RESPONSE, FailureReason.PROTOCOL}
        assert all(peer.startswith("127.0.0.1:") for _, peer in seen)
        assert prefill.open_channels() == []


def test_what_the_handshake_adds_to_a_channel_open() -> None:
    """Median wall time of opening a channel (rendezvous + gloo connect on both sides), token vs none."""
    medians = {}
    for token in ("", TOKEN):
        with ChannelManager(ChannelConfig("p-cost", "prefill", "127.0.0.1:0", token=token)) as prefill, \
                ChannelManager(ChannelConfig("d-cost", "decode", "127.0.0.1:0", token=token)) as decode:
            times = []
            for _ in range(15):
                start = time.perf_counter()
                ch = prefill.channel_to("d-cost")
                peer = decode.channel_from("p-cost", prefill.kv_address, ch.key.epoch)
                ch.wait_connected(10)
                peer.wait_connected(10)
                times.append((time.perf_counter() - start) * 1000)
                prefill.close_peer("d-cost", "measured")
                decode.close_peer("p-cost", "measured")
            medians["token" if token else "none"] = statistics.median(times)
    print(f"\nKV channel open, loopback, in-process: {medians['none']:.2f} ms without a token, "
          f"{medians['token']:.2f} ms with one")
    assert medians["token"] < medians["none"] + 50.0, medians
