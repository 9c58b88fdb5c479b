"""The disk tier under the KV pool (engine.kv_tier.KVTier, wired through BlockManager): a prefix the pool
evicted is read back instead of recomputed, a restarted engine finds its blocks, and every bad file or
failing disk is detected and recomputed, with greedy output equal to an engine without a tier and every
block of the pool and of the tier accounted for after each test.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_tier import MAGIC, KVTier
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from testing.disks import small_tmpfs

BLOCK = 16
POOL_BLOCKS = 12  # small: two other prompts and their outputs evict every block of an earlier one
PARAMS = SamplingParams(max_tokens=12)


def prompt(seed: int, n: int = 4 * BLOCK + 5) -> list[int]:
    return [(seed * 7919 + i * 104729) % 3000 + 3 for i in range(n)]


def engine(model_dir: Path, tier: Path | None, tier_bytes: int = 64 << 20) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=POOL_BLOCKS,
                                  block_size=BLOCK, num_threads=1, kv_tier_dir=str(tier) if tier else None,
                                  kv_tier_bytes=tier_bytes))


def run(e: LLMEngine, p: list[int]) -> list[int]:
    return e.generate([p], PARAMS)[0].token_ids


def evict_with_others(e: LLMEngine) -> None:
    """Enough other prompts that the pool hands out (evicts) every block of earlier ones."""
    for seed in (101, 102, 103, 104):
        run(e, prompt(seed))


def settle(e: LLMEngine) -> None:
    """Every pool block back and consistent; the tier's writes done and its index consistent."""
    assert e.block_manager.num_used_blocks == 0
    e.check_integrity()
    if e.kv_tier is not None:
        assert e.kv_tier.flush()
        e.kv_tier.check_integrity()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> dict[int, list[int]]:
    """Greedy tokens of each prompt from an engine without a tier."""
    e = engine(tiny_llama_dir, None)
    return {seed: run(e, prompt(seed)) for seed in (1, 2, 3, 101, 102, 103, 104)}


@pytest.fixture
def tier_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "kv-tier"


def tier_files(e: LLMEngine) -> list[Path]:
    assert e.kv_tier is not None
    return sorted(e.kv_tier.dir.glob("*.kvb"))


def test_an_evicted_prefix_is_read_back_and_the_output_is_unchanged(tiny_llama_dir: Path, tier_dir: Path,
                                                                    reference: dict[int, list[int]]) -> None:
    e = engine(tiny_llama_dir, tier_dir)
    assert run(e, prompt(1)) == reference[1]
    evict_with_others(e)
    e.kv_tier.flush()
    before = e.block_manager.stats()
    assert e.prefix_hit_tokens(prompt(1)) == 4 * BLOCK  # the tier holds them, the pool does not
    assert run(e, prompt(1)) == reference[1]
    after = e.block_manager.stats()
    assert after.tier_hit_tokens - before.tier_hit_tokens == 4 * BLOCK
    assert e.kv_tier.stats.loaded >= 4 and e.kv_tier.stats.corrupt == 0
    settle(e)


def test_a_restarted_engine_finds_its_tier(tiny_llama_dir: Path, tier_dir: Path, reference: dict[int, list[int]]) -> None:
    first = engine(tiny_llama_dir, tier_dir)
    assert run(first, prompt(2)) == reference[2]
    settle(first)
    first.close()
    second = engine(tiny_llama_dir, tier_dir)  # a cold pool, a warm tier
    assert second.kv_tier.stats.recovered >= 4
    assert run(second, prompt(2)) == reference[2]
    assert second.block_manager.stats().tier_hit_tokens == 4 * BLOCK
    settle(second)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "foreign", "garbage"])
def test_a_bad_tier_file_is_detected_and_recomputed(tiny_llama_dir: Path, tmp_path: Path, tier_dir: Path,
                                                    reference: dict[int, list[int]], damage: str) -> None:
    first = engine(tiny_llama_dir, tier_dir)
    run(first, prompt(3))
    settle(first)
    first.close()
    files = tier_files(first)
    assert len(files) >= 4
    victim = files[len(files) // 2]
    original = victim.read_bytes()
    data = bytearray(original)
    if damage == "flipped":
        data[-100] ^= 0x40  # a byte of the K/V: only the checksum can tell
        victim.write_bytes(bytes(data))
    elif damage == "truncated":
        victim.write_bytes(bytes(data[: len(data) - 1000]))
    elif damage == "garbage":
        victim.write_bytes(os.urandom(len(data)))
    else:  # the same name, a block of another model (another fingerprint)
        other = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16", num_kv_blocks=POOL_BLOCKS,
                                       block_size=BLOCK, num_threads=1, kv_tier_dir=str(tmp_path / "other")))
        run(other, prompt(3))
        other.close()
        foreign = sorted(other.kv_tier.dir.glob("*.kvb"))
        assert foreign and other.kv_tier.dir != first.kv_tier.dir
        shutil.copyfile(foreign[0], victim)
    second = engine(tiny_llama_dir, tier_dir)
    assert run(second, prompt(3)) == reference[3]
    # a damaged header is refused at startup; damaged K/V bytes when the block is read
    assert second.kv_tier.stats.corrupt == 1, second.kv_tier.stats
    settle(second)
    second.close()
    # Removed, then written anew from the recomputed block: a good file whose K/V match the original's up to
    # float rounding (a suffix prefill multiplies other shapes than the whole prompt's did).
    if victim.exists():
        assert torch.allclose(_payload(victim.read_bytes()), _payload(original), rtol=1e-4, atol=1e-5)
        third = engine(tiny_llama_dir, tier_dir)
        assert run(third, prompt(3)) == reference[3] and third.kv_tier.stats.corrupt == 0, third.kv_tier.stats
        settle(third)


def _payload(data: bytes) -> torch.Tensor:
    """A float32 tier file's K/V values (the bytes after its header)."""
    n = int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "little")
    meta = json.loads(data[len(MAGIC) + 4:len(MAGIC) + 4 + n])
    assert meta["dtype"] == "float32", meta
    return torch.frombuffer(bytearray(data[len(MAGIC) + 4 + n:]), dtype=torch.float32)


def test_a_tier_directory_removed_while_serving_is_a_miss_then_made_again(
        tiny_llama_dir: Path, tier_dir: Path, reference: dict[int, list[int]]) -> None:
    e = engine(tiny_llama_dir, tier_dir)
    run(e, prompt(1))
    evict_with_others(e)
    e.kv_tier.flush()
    shutil.rmtree(e.kv_tier.dir)
    assert run(e, prompt(1)) == reference[1]  # every listed block is gone: recomputed
    assert e.kv_tier.stats.missing >= 1
    assert run(e, prompt(2)) == reference[2]  # new blocks are written into the directory made again
    e.kv_tier.flush()
    assert e.kv_tier.dir.is_dir() and tier_files(e)
    settle(e)


def test_a_tier_directory_takes_one_process(tiny_llama_dir: Path, tier_dir: Path) -> None:
    first = engine(tiny_llama_dir, tier_dir)
    with pytest.raises(ValueError, match="in use by another process"):
        KVTier(tier_dir, 1 << 20, fingerprint=first.model_config.fingerprint(), kv_cache=first.kv_cache)
    first.close()
    engine(tiny_llama_dir, tier_dir).close()  # released


def test_the_tier_stays_within_its_bound_and_evicts_the_oldest(tiny_llama_dir: Path, tier_dir: Path,
                                                             reference: dict[int, list[int]]) -> None:
    probe = engine(tiny_llama_dir, tier_dir)
    run(probe, prompt(1))
    probe.kv_tier.flush()
    per_block = max(f.stat().st_size for f in tier_files(probe))  # headers differ by a few bytes
    probe.close()
    shutil.rmtree(tier_dir)
    e = engine(tiny_llama_dir, tier_dir, tier_bytes=6 * per_block)  # six blocks
    for seed in (1, 2, 3):
        assert run(e, prompt(seed)) == reference[seed]
    settle(e)
    assert e.kv_tier.num_blocks == 6 and e.kv_tier.bytes <= 6 * per_block
    assert e.kv_tier.stats.evicted >= 6
    assert len(tier_files(e)) == 6


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs (root only): a disk that fills up."""
    with small_tmpfs(tmp_path, "256k") as mount:
        yield mount


def test_a_full_disk_degrades_to_no_tier_never_a_failed_request(tiny_llama_dir: Path, small_disk: Path,
                                                               reference: dict[int, list[int]]) -> None:
    e = engine(tiny_llama_dir, small_disk / "tier")
    for seed in (1, 2, 3):
        assert run(e, prompt(seed)) == reference[seed]
    e.kv_tier.flush()
    assert e.kv_tier.stats.write_errors >= 1 and e.kv_tier.disabled_until > 0
    for seed in (101, 1):
        assert run(e, prompt(seed)) == reference[seed]
    settle(e)
