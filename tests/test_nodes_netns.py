"""A prefill node and a decode node in two network namespaces joined by a veth pair, so the KV blocks
cross a real (virtual) link instead of loopback. etcd runs in the prefill node's namespace on the veth
address; the client runs in the decode node's namespace. Needs root and iproute2; skipped otherwise.
Every address lives only inside the two namespaces this test creates and deletes."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tiny import default_model_dir
from pdserve.registry import find_etcd_binary
from testing.cluster import REPO_ROOT, LocalCluster

pytestmark = pytest.mark.timeout(300)


@dataclass(frozen=True)
class NetnsPair:
    ns_prefill: str
    ns_decode: str
    veth_prefill: str
    veth_decode: str
    ip_prefill: str
    ip_decode: str

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def netns() -> Iterator[NetnsPair]:
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    tag = f"{os.getpid() % 100000}"
    subnet = random.Random(os.getpid()).randrange(1, 250)
    pair = NetnsPair(f"pdP{tag}", f"pdD{tag}", f"pdvp{tag}", f"pdvd{tag}", f"10.213.{subnet}.1", f"10.213.{subnet}.2")
    created: list[str] = []
    try:
        for ns in (pair.ns_prefill, pair.ns_decode):
            res = _ip("netns", "add", ns)
            if res.returncode != 0:
                pytest.skip(f"`ip netns add` failed: {res.stderr.strip()}")
            created.append(ns)
        steps = [
            ("link", "add", pair.veth_prefill, "type", "veth", "peer", "name", pair.veth_decode),
            ("link", "set", pair.veth_prefill, "netns", pair.ns_prefill),
            ("link", "set", pair.veth_decode, "netns", pair.ns_decode),
            ("-n", pair.ns_prefill, "addr", "add", f"{pair.ip_prefill}/24", "dev", pair.veth_prefill),
            ("-n", pair.ns_decode, "addr", "add", f"{pair.ip_decode}/24", "dev", pair.veth_decode),
            ("-n", pair.ns_prefill, "link", "set", pair.veth_prefill, "up"),
            ("-n", pair.ns_decode, "link", "set", pair.veth_decode, "up"),
            ("-n", pair.ns_prefill, "link", "set", "lo", "up"),
            ("-n", pair.ns_decode, "link", "set", "lo", "up"),
        ]
        for step in steps:
            res = _ip(*step)
            if res.returncode != 0:
                pytest.skip(f"`ip {' '.join(step)}` failed: {res.stderr.strip()}")
        yield pair
    finally:
        # Deleting a namespace deletes the veth end inside it, and with it the peer.
        for ns in created:
            _ip("netns", "del", ns)
        _ip("link", "del", pair.veth_prefill)


def tx_bytes(ns: str, dev: str) -> int:
    out = _ip("-n", ns, "-s", "-j", "link", "show", dev).stdout
    return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


def test_kv_crosses_a_veth_link_between_namespaces(netns: NetnsPair, tmp_path: Path) -> None:
    model_dir = default_model_dir("llama")
    etcd_dir = tmp_path / "etcd"
    etcd_url = f"http://{netns.ip_prefill}:2379"
    etcd = subprocess.Popen(
        [*netns.exec_prefix(netns.ns_prefill), str(find_etcd_binary()), "--name", "netns-etcd",
         "--data-dir", str(etcd_dir), "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
         "--listen-peer-urls", f"http://{netns.ip_prefill}:2380",
         "--initial-advertise-peer-urls", f"http://{netns.ip_prefill}:2380",
         "--initial-cluster", f"netns-etcd=http://{netns.ip_prefill}:2380", "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "etcd.log", "wb"), stdin=subprocess.DEVNULL,
    )  # fmt: skip
    node_args = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "256"]
    endpoint = f"{netns.ip_prefill}:2379"
    try:
        with LocalCluster(tmp_path / "nodes", model_dir, node_args=node_args) as cluster:
            prefill = cluster.spawn_node(
                "prefill", "p0", ["--grpc-host", netns.ip_prefill, "--kv-host", netns.ip_prefill],
                prefix=netns.exec_prefix(netns.ns_prefill), etcd=endpoint,
            )
            decode = cluster.spawn_node(
                "decode", "d0", ["--grpc-host", netns.ip_decode, "--kv-host", netns.ip_decode,
                                 "--local-prefill-threshold", "32"],
                prefix=netns.exec_prefix(netns.ns_decode), etcd=endpoint,
            )
            cluster.wait_ready([prefill, decode])
            assert str(prefill.info["kv_address"]).startswith(netns.ip_prefill)

            rng = random.Random(21)
            prompt = [rng.randrange(5, 4000) for _ in range(700)]
            before = tx_bytes(netns.ns_prefill, netns.veth_prefill)
            out = subprocess.run(
                [*netns.exec_prefix(netns.ns_decode), sys.executable, "-m", "pdserve.decode_node.client",
                 "--target", decode.grpc_address, "--prompt-ids", ",".join(map(str, prompt)),
                 "--max-tokens", "8", "--ignore-eos", "--prefill-node-id", "p0"],
                capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
            )  # fmt: skip
            assert out.returncode == 0, out.stderr
            result = json.loads(out.stdout)
            sent = tx_bytes(netns.ns_prefill, netns.veth_prefill) - before

            reference = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=256))
            expected = reference.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
            assert result["prefill_node_id"] == "p0" and result["decode_node_id"] == "d0"
            assert result["token_ids"] == expected.token_ids and not result["error"]
            mc = reference.model_config
            block_bytes = 2 * mc.num_layers * 16 * mc.num_kv_heads * mc.head_dim * 4
            kv_bytes = -(-len(prompt) // 16) * block_bytes
            assert sent >= kv_bytes, f"only {sent} bytes left the prefill namespace, the prompt's KV is {kv_bytes}"

            for node, role in ((prefill, "prefill"), (decode, "decode")):
                ns = netns.ns_prefill if role == "prefill" else netns.ns_decode
                deadline = time.monotonic() + 20
                while True:
                    load = json.loads(subprocess.run(
                        [*netns.exec_prefix(ns), sys.executable, "-m", "pdserve.decode_node.client", "--target",
                         node.grpc_address, "--load", role], capture_output=True, text=True, timeout=60,
                        cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
                    ).stdout)  # fmt: skip
                    if load["kvBlocksUsed"] == 0 and load["inFlight"] == 0:
                        break
                    assert time.monotonic() < deadline, f"{role} node not clean: {load}"
                    time.sleep(0.1)  # the poll interval
    finally:
        etcd.terminate()
        try:
            etcd.wait(timeout=10)
        except subprocess.TimeoutExpired:
            etcd.kill()
            etcd.wait()
