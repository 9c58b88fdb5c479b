"""KV transfer between nodes of different tensor-parallel widths (kv_transfer.sharded) over a real channel.

A TP = 2 engine's rank pools (shared memory, mapped by rank 0) are sent as one pool of all KV heads to a
TP = 1 pool, and a TP = 1 pool to TP = 2 rank pools (the replicated case: 1 KV head on both ranks), at
shuffled block ids. The bytes on the wire are wire format v1 of all heads, so both sides' checksums agree
with an unsharded transfer of the same blocks.

PDSERVE_TEST_DEVICE=cuda (bench/gpu_check.sh) runs it with the TP 2 pools on two GPUs (mapped by CUDA IPC)
and the channel over NCCL between them.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parallel import head_shard
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels import get_kernel_ops
from pdserve.kv_transfer import KVReceiver, KVSender, TransferMeta
from pdserve.kv_transfer.sharded import HeadShardedKV
from testing.kv_pair import loopback_pair
from tests.test_tensor_parallel import make_variant

DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")
if DEVICE.startswith("cuda") and torch.cuda.device_count() < 2:
    pytest.skip(f"TP 2 on CUDA needs 2 GPUs; {torch.cuda.device_count()} visible", allow_module_level=True)
# the prefill side on the engine's device, the decode side on another (an NCCL pair needs two GPUs)
P_DEV, D_DEV = ("cuda:0", "cuda:1") if DEVICE.startswith("cuda") else ("cpu", "cpu")
PROMPT = list(range(200, 261))  # 61 tokens: 8 blocks of 8, the last one partial


@pytest.fixture(scope="module")
def channel_pair():
    with loopback_pair("p-tp", "d-tp", P_DEV, D_DEV) as pair:
        yield pair


def transfer(pair, src, src_ids: list[int], dst, dst_ids: list[int]) -> tuple[str, str]:
    """Ships src's blocks src_ids into dst's dst_ids over the channel; returns both sides' checksums."""
    ch, peer = pair
    ops = get_kernel_ops("torch", DEVICE)
    handle = KVSender(ops).send(ch, src, src_ids, request_id=f"r{random.random()}", num_tokens=len(PROMPT),
                                timeout_s=20)
    meta = TransferMeta.from_dict(handle.meta.to_dict())
    got = KVReceiver(ops).recv(peer, dst, dst_ids, meta, timeout_s=20).result(30)
    sent = handle.result(30)
    assert sent.ok and got.ok, (sent.error, got.error)
    return sent.checksum, got.checksum


def engine(path: Path, tp: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device=DEVICE, dtype="float32", num_kv_blocks=32, block_size=8,
                                  num_threads=1, tensor_parallel_size=tp))


@pytest.mark.parametrize("kv", [1, 2, 4])
def test_tp2_and_tp1_pools_exchange_their_heads(tiny_model_dir: Callable[[str], Path], tmp_path: Path,
                                                 channel_pair, kv: int) -> None:
    path = make_variant(tiny_model_dir("llama"), tmp_path / "model", kv)
    pools = {}
    for tp in (1, 2):
        eng = engine(path, tp)
        try:
            eng.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))
            assert eng.kv_shards is not None and len(eng.kv_shards) == tp
            pools[tp] = [(t.clone(), start) for t, start in eng.kv_shards]  # the cached prompt's blocks
        finally:
            eng.close()
    whole_dev = pools[1][0][0]  # [L, 2, NB, BS, H, D]
    whole = whole_dev.cpu()
    sharded = HeadShardedKV(pools[2], kv)
    assert sharded.shape == whole.shape
    used = [b for b in range(whole.shape[2]) if whole[:, :, b].abs().sum() > 0]
    assert len(used) == 8, used  # the same allocation order on both engines
    ids = torch.tensor(used)
    gathered = torch.empty((whole.shape[0], 2, len(used), *whole.shape[3:]))
    sharded.gather(0, whole.shape[0], ids, gathered)
    torch.testing.assert_close(gathered, whole[:, :, ids], rtol=1e-4, atol=1e-5)  # TP 2 computed the same K/V

    dst_ids = random.Random(kv).sample(range(whole.shape[2]), len(used))
    # TP 2 -> TP 1: every rank's heads land in one pool; the bytes are what the TP 2 pools hold
    dst = torch.zeros_like(whole, device=D_DEV)
    sums = transfer(channel_pair, sharded, used, dst, dst_ids)
    assert sums[0] == sums[1]
    assert torch.equal(dst[:, :, dst_ids].cpu(), gathered)
    # TP 1 -> TP 2 (replicated heads written to every rank holding them); same checksum as TP 1 -> TP 1
    shards = [(torch.zeros_like(t), start) for t, start in pools[2]]
    sums2 = transfer(channel_pair, whole_dev, used, HeadShardedKV(shards, kv), dst_ids)
    plain = torch.zeros_like(whole, device=D_DEV)
    assert transfer(channel_pair, whole_dev, used, plain, dst_ids) == sums2
    for r, (t_dev, start) in enumerate(shards):
        t = t_dev.cpu()
        h = head_shard(4, kv, r, 2)
        assert start == h.kv_start and t.shape[4] == h.num_kv_heads
        assert torch.equal(t[:, :, dst_ids], whole[:, :, used, :, start : start + t.shape[4]])
        untouched = [b for b in range(t.shape[2]) if b not in dst_ids]
        assert not t[:, :, untouched].any()
