"""The KV tier in real node processes (`--kv-tier-dir`): a decode node restarted mid-workload comes back
with its tier (warm), a node killed with SIGKILL too (what reached the disk), and bad tier files, a tier
directory removed while serving and a full disk are each detected and recomputed: the greedy tokens
equal the reference engine's and every KV block (pool and tier) is accounted for after each test.
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from testing.cluster import LocalCluster
from testing.disks import small_tmpfs

pytestmark = pytest.mark.timeout(600)

BLOCK = 16
NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "40", "--block-size", str(BLOCK)]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def prompt(seed: int, n: int = 12 * BLOCK + 3) -> list[int]:
    return [(seed * 7919 + i * 104729) % 3000 + 3 for i in range(n)]


@pytest.fixture
def cluster(tmp_path: Path, model_dir: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path / "cluster", model_dir, node_args=NODE_ARGS) as c:
        c.start_etcd()
        yield c


def start_decode(cluster: LocalCluster, tier: Path) -> None:
    # A decode node that prefills every prompt itself (no prefill pool): its own tier holds them.
    node = cluster.spawn_node("decode", "d0", ["--kv-tier-dir", str(tier), "--kv-tier-gib", "0.05", "--colocated"])
    cluster.wait_ready([node])


def generate(cluster: LocalCluster, reference: LLMEngine, seed: int) -> int:
    """Generates prompt(seed) on d0; asserts the reference's tokens; returns the prompt tokens it had cached."""
    out = cluster.generate("d0", prompt(seed), PARAMS)
    assert out.error == "" and out.token_ids == reference.generate([prompt(seed)], PARAMS)[0].token_ids
    return out.num_cached_tokens


def restart(cluster: LocalCluster, tier: Path, sig: int = signal.SIGTERM) -> None:
    cluster.kill("d0", sig)
    start_decode(cluster, tier)


def evict(cluster: LocalCluster, reference: LLMEngine) -> None:
    for seed in (201, 202, 203, 204):  # 4 x 13 blocks: the pool of 40 hands out every earlier block
        generate(cluster, reference, seed)


def settle(cluster: LocalCluster) -> None:
    cluster.wait_clean(["d0"])
    cluster.check_integrity(["d0"])  # the engine's, with its tier's index against its files


def test_a_restarted_node_comes_back_with_its_tier(cluster: LocalCluster, reference: LLMEngine, tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    start_decode(cluster, tier)
    assert generate(cluster, reference, 1) == 0
    settle(cluster)
    restart(cluster, tier)  # SIGTERM: a drain; the engine's close puts pending blocks on disk
    assert cluster.metric("d0", "pdserve_kv_tier_recovered_blocks_total") >= 12
    assert generate(cluster, reference, 1) == 12 * BLOCK  # read back, not recomputed
    assert cluster.metric("d0", "pdserve_kv_tier_hits_total") == 12 * BLOCK
    evict(cluster, reference)  # the pool evicts it; the tier still has it
    assert generate(cluster, reference, 1) == 12 * BLOCK
    settle(cluster)


def test_a_node_killed_mid_workload_comes_back_with_what_reached_the_disk(
        cluster: LocalCluster, reference: LLMEngine, tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    start_decode(cluster, tier)
    generate(cluster, reference, 2)
    settle(cluster)  # its blocks are on disk (integrity flushes the writer)
    generate(cluster, reference, 3)
    restart(cluster, tier, signal.SIGKILL)  # prompt 3's writes may or may not have landed
    assert not list(tier.rglob("*.tmp")), "an interrupted write's file is cleared at startup"
    assert generate(cluster, reference, 2) == 12 * BLOCK
    generate(cluster, reference, 3)
    settle(cluster)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "foreign"])
def test_a_bad_tier_file_is_recomputed_never_served(cluster: LocalCluster, reference: LLMEngine, tmp_path: Path,
                                                    damage: str) -> None:
    tier = tmp_path / "tier"
    start_decode(cluster, tier)
    generate(cluster, reference, 4)
    settle(cluster)
    files = sorted(tier.rglob("*.kvb"))
    victim = files[len(files) // 2]
    data = bytearray(victim.read_bytes())
    if damage == "flipped":
        data[-7] ^= 0x01
        victim.write_bytes(bytes(data))
    elif damage == "truncated":
        victim.write_bytes(bytes(data[:-64]))
    else:  # a block file of another model (the header's fingerprint differs)
        text = bytes(data).replace(b'"fingerprint":"', b'"fingerprint":"0', 1)
        victim.write_bytes(text)
    restart(cluster, tier)
    cached = generate(cluster, reference, 4)
    assert cached < 12 * BLOCK  # the run of tier blocks ends at the bad one; the rest is computed
    assert cluster.metric("d0", "pdserve_kv_tier_corrupt_blocks_total") == 1
    settle(cluster)


def test_a_tier_directory_removed_while_serving(cluster: LocalCluster, reference: LLMEngine, tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    start_decode(cluster, tier)
    generate(cluster, reference, 5)
    evict(cluster, reference)
    settle(cluster)
    shutil.rmtree(tier)
    assert generate(cluster, reference, 5) == 0  # gone: recomputed
    assert cluster.metric("d0", "pdserve_kv_tier_missing_blocks_total") >= 1
    generate(cluster, reference, 6)
    settle(cluster)
    assert list(tier.rglob("*.kvb")), "the directory is made again and written"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs (root only)."""
    with small_tmpfs(tmp_path, "512k") as mount:
        yield mount


def test_a_full_disk_pauses_the_tier_and_fails_no_request(cluster: LocalCluster, reference: LLMEngine,
                                                         small_disk: Path) -> None:
    tier = small_disk / "tier"
    start_decode(cluster, tier)
    for seed in (7, 8, 9):
        generate(cluster, reference, seed)
    settle(cluster)
    assert cluster.metric("d0", "pdserve_kv_tier_write_errors_total") >= 1
    assert cluster.metric("d0", "pdserve_kv_tier_writes_paused") == 1
    generate(cluster, reference, 7)
    settle(cluster)


def test_disaggregated_pools_with_tiers_give_the_reference_tokens(cluster: LocalCluster, reference: LLMEngine,
                                                                 tmp_path: Path) -> None:
    """1 prefill + 1 decode, each with a tier: a history the pools evicted is read back on both sides (the
    prefill node computes only the suffix; the decode node reserves only what it lacks), tokens unchanged."""
    nodes = [cluster.spawn_node("prefill", "p0", ["--kv-tier-dir", str(tmp_path / "tier-p0")]),
             cluster.spawn_node("decode", "d0", ["--kv-tier-dir", str(tmp_path / "tier-d0"),
                                                 "--local-prefill-threshold", "0"])]
    cluster.wait_ready(nodes)
    cluster.wait_registry(lambda m: {"p0", "d0"} <= m.keys(), timeout_s=30, what="both nodes")
    for _ in range(50):  # d0 learns of p0 through its registry watch
        if "p0" in cluster.get_load("d0").members:
            break
        time.sleep(0.1)
    out = cluster.generate("d0", prompt(11), PARAMS)
    assert out.prefill_node_id == "p0" and out.token_ids == reference.generate([prompt(11)], PARAMS)[0].token_ids
    evict(cluster, reference)  # through p0 as well: both pools evict prompt 11
    cluster.check_integrity(["p0", "d0"])  # flushes both tiers
    again = cluster.generate("d0", prompt(11), PARAMS)
    assert again.token_ids == out.token_ids and again.num_cached_tokens >= 11 * BLOCK
    assert cluster.metric("d0", "pdserve_kv_tier_hits_total") >= 11 * BLOCK
    cluster.wait_clean(["p0", "d0"])
    cluster.check_integrity(["p0", "d0"])
