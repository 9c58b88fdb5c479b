"""A KV pool split by KV heads over tensor-parallel ranks, seen by the transfer as one pool.

A node running its model over N ranks (`engine.parallel`) keeps one pool per rank, each holding that
rank's KV heads for the same block ids; with fewer KV heads than ranks a head is replicated on several
ranks. Rank 0 maps every rank's pool (host shared memory on a CPU; on CUDA each pool stays on its rank's
device, mapped by CUDA IPC), so a transfer reads and writes each rank's heads where they lie: the sender packs message bytes straight from every rank's pool into the
wire format v1 buffer `[L', 2, n, BS, H, D]` of ALL heads, and the receiver unpacks each head range into
every pool that holds it. That is the resharding: a TP = 2 prefill node and a TP = 1 decode node (or the
other way round, or any two widths) exchange the same bytes as two TP = 1 nodes, checksums included.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class HeadShardedKV:
    """Rank pools `[L, 2, NB, BS, h_r, D]` with their first KV head, covering heads [0, H). Reads and
    writes only the blocks named; never changes a pool's shape."""

    def __init__(self, shards: Sequence[tuple[torch.Tensor, int]], num_kv_heads: int) -> None:
        if not shards:
            raise ValueError("a sharded KV pool needs at least one shard")
        first = shards[0][0]
        for pool, start in shards:
            if pool.dim() != 6 or pool.shape[1] != 2:
                raise ValueError(f"a KV pool must be [L, 2, NB, BS, Hkv, D], got {tuple(pool.shape)}")
            same = (pool.shape[:4] == first.shape[:4] and pool.shape[5] == first.shape[5]
                    and pool.dtype == first.dtype and pool.device.type == first.device.type)
            if not same or start < 0 or start + pool.shape[4] > num_kv_heads:
                raise ValueError(f"shard of heads [{start}, {start + pool.shape[4]}) {tuple(pool.shape)} does not fit "
                                 f"{num_kv_heads} KV heads over {tuple(first.shape)}")
        self.shards = list(shards)
        # For reading: one shard per head range, the first that holds it (replicas are equal).
        self._sources: list[tuple[torch.Tensor, int]] = []
        covered = 0
        for pool, start in self.shards:
            if start == covered:
                self._sources.append((pool, start))
                covered += pool.shape[4]
        if covered != num_kv_heads:
            raise ValueError(f"the shards cover KV heads [0, {covered}) of {num_kv_heads}")
        layers, two, nb, bs, _, d = first.shape
        self.shape = torch.Size((layers, two, nb, bs, num_kv_heads, d))
        self.dtype = first.dtype
        self.device = first.device  # where the transfer's buffers live: rank 0's

    def dim(self) -> int:
        return 6

    def element_size(self) -> int:
        return self.dtype.itemsize

    def gather(self, l0: int, l1: int, ids: torch.Tensor, out: torch.Tensor) -> None:
        """out[l, kv, j, :, h] = head h of block ids[j] in layer l0 + l. out: [l1-l0, 2, n, BS, H, D]."""
        for pool, start in self._sources:
            out[:, :, :, :, start : start + pool.shape[4]].copy_(pool[l0:l1].index_select(2, ids.to(pool.device)))

    def scatter(self, buf: torch.Tensor, l0: int, l1: int, ids: torch.Tensor) -> None:
        """Every pool's heads of blocks `ids` in layers [l0, l1) from buf [l1-l0, 2, n, BS, H, D]."""
        for pool, start in self.shards:
            part = buf[:, :, :, :, start : start + pool.shape[4]]
            pool[l0:l1].index_copy_(2, ids.to(pool.device), part.to(pool.device))


KVPool = torch.Tensor | HeadShardedKV
