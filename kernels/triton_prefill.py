"""Paged prefill attention in Triton: variable-length prompts packed back to back, causal, with the
earlier part of each prompt possibly already cached (prefix-cache hit or an earlier chunk).

One program handles a tile of BLOCK_M queries of one sequence and one query head. Query i of sequence b
sits at position context_lens[b] - q_len_b + i; the program walks the keys from position 0 up to the
last position its tile can see, reading them through the block table, with an online softmax in
float32. The new tokens' K/V are already in the KV cache when it runs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_cache_pair,
    check_dim,
    check_dtype,
    check_gqa,
    check_rank,
    check_same_device,
    check_unit_last_stride,
)
from pdserve.kernels.triton_common import check_launchable, dot_precisions, pow2_at_least

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, cu_ptr, ctx_ptr, out_ptr,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tb,
    stride_ot, stride_oh,
    scale_log2,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QK_PRECISION: tl.constexpr, PV_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_first = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_first
    ctx = tl.load(ctx_ptr + seq)
    prefix = ctx - q_len  # tokens cached before this chunk

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    m_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    q_pos = prefix + offs_m  # [BLOCK_M]
    rows = (q_first + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_M, D_PAD]

    # Keys beyond the tile's last query are never visible; a tile past q_len reads nothing.
    kv_stop = tl.minimum(ctx, prefix + (tile + 1) * BLOCK_M)
    kv_stop = tl.where(tile * BLOCK_M < q_len, kv_stop, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table_row = tables_ptr + seq.to(tl.int64) * stride_tb
    for n0 in range(0, kv_stop, BLOCK_N):
        pos = n0 + offs_n  # [BLOCK_N]
        n_ok = pos < kv_stop
        block = tl.load(table_row + pos // PAGE, mask=n_ok, other=0).to(tl.int64)
        slot = (pos % PAGE).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load((k_ptr + block * stride_kb + slot * stride_ks + kv_head * stride_kh)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, D_PAD]
        s = tl.dot(q, tl.trans(k), input_precision=QK_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        # Position 0 is visible to every row, so each row has a finite maximum after the first tile.
        visible = (pos[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load((v_ptr + block * stride_vb + slot * stride_vs + kv_head * stride_vh)[:, None] + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, D_PAD]
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PV_PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _tile_config(dtype: torch.dtype, d_pad: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) that compile for sm_90 without register spills (checked with
    cuobjdump; float32 128-wide heads keep a small spill): wider heads and float32 tiles get smaller
    tiles or more warps."""
    if d_pad <= 64:
        return 64, 32, 4
    if d_pad <= 128:
        return (64, 32, 8) if dtype != torch.float32 else (32, 32, 8)
    return 32, 16, 8


def _launch_prefill(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, MB]
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    context_lens: torch.Tensor,  # [B]
    scale: float,
    max_q_len: int | None,
    block_m: int | None,
    block_n: int | None,
) -> torch.Tensor:  # [T, Hq, D]
    """Sizes the grid from the longest query chunk, then launches one program per (tile, sequence, head)."""
    t, hq, d = q.shape
    b = block_tables.shape[0]
    _, page, hkv, _ = k_cache.shape
    out = torch.empty_like(q)
    if t == 0 or b == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # one host read per prefill step
    d_pad = pow2_at_least(d)
    bm, bn, warps = _tile_config(k_cache.dtype, d_pad)
    bm = block_m or bm
    bn = block_n or bn
    qk_prec, pv_prec = dot_precisions(k_cache.dtype)
    grid = (triton.cdiv(max(1, max_q_len), bm), b, hq)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        scale * LOG2E,
        GROUP=hq // hkv, HEAD_DIM=d, D_PAD=d_pad, PAGE=page, BLOCK_M=bm, BLOCK_N=bn,
        QK_PRECISION=qk_prec, PV_PRECISION=pv_prec, num_warps=warps,
    )
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, MB] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    *,
    max_q_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # [T, Hq, D] in q.dtype
    """Causal attention of the packed new tokens over their sequences' cached context (which already
    holds the new tokens' K/V). `max_q_len` avoids a host read when the caller knows it; block_m/block_n
    override the tile sizes (powers of two >= 16). Changes nothing."""
    check_rank("q", q, 3, "[T, Hq, D]")
    check_dtype("q", q, FLOAT_DTYPES)
    check_unit_last_stride("q", q)
    check_cache_pair(k_cache, v_cache)
    check_dtype("k_cache", k_cache, FLOAT_DTYPES)  # no fp8 loads in the Triton kernels
    check_dim("q", q, 2, k_cache.shape[3], "head dim of the cache")
    check_gqa(q.shape[1], k_cache.shape[2])
    check_rank("block_tables", block_tables, 2, "[B, MB]")
    check_dtype("block_tables", block_tables, INDEX_DTYPES)
    check_unit_last_stride("block_tables", block_tables)
    b = block_tables.shape[0]
    check_rank("cu_seqlens_q", cu_seqlens_q, 1, "[B + 1]")
    check_dtype("cu_seqlens_q", cu_seqlens_q, INDEX_DTYPES)
    check_unit_last_stride("cu_seqlens_q", cu_seqlens_q)
    check_dim("cu_seqlens_q", cu_seqlens_q, 0, b + 1, "batch of block_tables + 1")
    check_rank("context_lens", context_lens, 1, "[B]")
    check_dtype("context_lens", context_lens, INDEX_DTYPES)
    check_unit_last_stride("context_lens", context_lens)
    check_dim("context_lens", context_lens, 0, b, "batch of block_tables")
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size is not None and (size < 16 or size & (size - 1)):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    device = check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                               cu_seqlens_q=cu_seqlens_q, context_lens=context_lens)
    check_launchable(_prefill_kernel, device)
    return _launch_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_q_len,
                           block_m, block_n)
