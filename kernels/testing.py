"""Builders of random paged-attention problems, shared by the kernel tests, the CPU bench and the GPU
check. Block tables are shuffled physical ids, lengths are ragged, and every cache slot that no
sequence owns is filled with NaN so that a kernel reading outside a context cannot go unnoticed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class PagedProblem:
    """One batch of sequences over a shuffled paged KV cache. For decode, q holds one row per sequence."""

    q: torch.Tensor  # [T, Hq, D]; T = B for decode
    k_cache: torch.Tensor  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor  # [B, MB] int32, 0-padded
    context_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    scale: float

    @property
    def max_q_len(self) -> int:
        return int((self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).max()) if self.context_lens.numel() else 0


def make_paged_problem(
    context_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    q_lens: list[int] | None = None,
    seed: int = 0,
    spare_blocks: int = 3,
    poison_unused: bool = True,
) -> PagedProblem:
    """Random problem: `q_lens` None means decode (one query per sequence), else the new tokens of each
    sequence (each <= its context length). Pool blocks are assigned in a random order; unused slots
    are NaN when `poison_unused`."""
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device(device)
    # Large pools are drawn on their device; CPU problems stay reproducible from `seed` alone.
    dev_gen = gen if dev.type == "cpu" else torch.Generator(device=dev).manual_seed(seed)
    b = len(context_lens)
    tables, owned = _block_tables(context_lens, block_size, spare_blocks, gen)
    shape = (owned.shape[0], block_size, num_kv_heads, head_dim)
    k_cache, v_cache = _pool_pair(shape, owned if poison_unused else None, dev_gen, dev)
    lens_q = [1] * b if q_lens is None else list(q_lens)
    if any(ql > n for ql, n in zip(lens_q, context_lens, strict=True)):
        raise ValueError("each q_len must be <= its context length")
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens_q, dtype=torch.int32), 0)
    q = torch.randn(int(cu[-1]), num_q_heads, head_dim, generator=dev_gen, device=dev)
    return PagedProblem(
        q=q.to(dtype),
        k_cache=k_cache.to(dtype),
        v_cache=v_cache.to(dtype),
        block_tables=tables.to(dev),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
        cu_seqlens_q=cu.to(dev),
        scale=1.0 / math.sqrt(head_dim),
    )


def _block_tables(context_lens: list[int], block_size: int, spare_blocks: int,
                  gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables [B, MB] int32 (0-padded) over a KV cache of the blocks needed plus `spare_blocks`, handed
    out in a random order, and the slots the sequences own ([NB, BS] bool)."""
    b = len(context_lens)
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    mb = max([1, *blocks_per_seq])
    nb = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(nb, generator=gen)
    tables = torch.zeros(b, mb, dtype=torch.int32)
    owned = torch.zeros(nb, block_size, dtype=torch.bool)
    used = 0
    for i, (n, nblk) in enumerate(zip(context_lens, blocks_per_seq, strict=True)):
        ids = order[used : used + nblk]
        used += nblk
        tables[i, :nblk] = ids.to(torch.int32)
        for j, blk in enumerate(ids.tolist()):
            owned[blk, : min(block_size, n - j * block_size)] = True
    return tables, owned


def _pool_pair(shape: tuple[int, int, int, int], owned: torch.Tensor | None, gen: torch.Generator,
               dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random float32 K and V pools; the slots not in `owned` NaN (none when `owned` is None)."""
    k_cache = torch.randn(shape, generator=gen, device=dev)
    v_cache = torch.randn(shape, generator=gen, device=dev)
    if owned is not None:
        unowned = (~owned).to(dev)
        k_cache[unowned] = float("nan")
        v_cache[unowned] = float("nan")
    return k_cache, v_cache


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances for a kernel output in `dtype` against a float32 reference: the output
    rounding of the dtype plus float32 summation-order noise."""
    if dtype == torch.float32:
        return {"atol": 2e-5, "rtol": 2e-5}
    if dtype == torch.float16:
        return {"atol": 2e-3, "rtol": 2e-3}
    return {"atol": 1.6e-2, "rtol": 1.6e-2}
