"""Paged decode attention in Triton: one query token per sequence, GQA, split-KV with a log-sum-exp merge.

One program handles one (sequence, KV head, split): it loads the G query heads that share the KV head
as the rows of one tile, so every key/value is read once per KV head rather than once per query head.
Long contexts are cut into splits that run in parallel; each writes a normalised partial output and its
log-sum-exp (base 2), and a second small kernel merges the splits. Arithmetic is float32 throughout.
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
from pdserve.kernels.triton_common import (
    check_launchable,
    dot_precisions,
    multiprocessor_count,
    pow2_at_least,
)

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
MIN_TILES_PER_SPLIT = 4


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, ctx_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tb,
    stride_ob, stride_oh, stride_osplit,
    stride_lb, stride_lh,
    scale_log2,
    tokens_per_split,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    QK_PRECISION: tl.constexpr, PV_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    start = split * tokens_per_split
    stop = tl.minimum(start + tokens_per_split, ctx)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    # Rows past GROUP load as zeros: tl.dot needs >= 16 rows, and those rows are never stored.
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [G_PAD, D_PAD]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    table_row = tables_ptr + seq.to(tl.int64) * stride_tb
    for n0 in range(start, stop, BLOCK_N):
        pos = n0 + offs_n  # [BLOCK_N] token positions
        n_ok = pos < stop
        block = tl.load(table_row + pos // PAGE, mask=n_ok, other=0).to(tl.int64)
        slot = (pos % PAGE).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k_rows = k_ptr + block * stride_kb + slot * stride_ks + kv_head * stride_kh
        k = tl.load(k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, D_PAD]
        s = tl.dot(q, tl.trans(k), input_precision=QK_PRECISION) * scale_log2  # [G_PAD, BLOCK_N]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = v_ptr + block * stride_vb + slot * stride_vs + kv_head * stride_vh
        v = tl.load(v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, D_PAD]
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PV_PRECISION)
        m_i = m_new

    # A split that starts past the context saw no token: it contributes weight 0 to the merge.
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    out_rows = out_ptr + seq * stride_ob + heads * stride_oh + split * stride_osplit
    tl.store(out_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=g_ok)


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    num_splits,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)  # [SPLITS_PAD]; empty splits weigh 0
    part = tl.load(part_ptr + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # [SPLITS_PAD, D_PAD] float32
    total = tl.sum(w, 0)
    o = tl.sum(w[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def _tile_config(dtype: torch.dtype, d_pad: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) that compile for sm_90 without register spills (checked with cuobjdump):
    float32 tiles and 256-wide heads take half the key tile; 128-wide heads take 8 warps."""
    block_n = 64 if dtype != torch.float32 and d_pad <= 128 else 32
    return block_n, 8 if d_pad >= 128 else 4


def _choose_splits(batch: int, kv_heads: int, tiles: int, device: torch.device) -> int:
    """Enough splits that the grid covers the GPU about twice, but at least MIN_TILES_PER_SPLIT tiles each."""
    want = -(-2 * multiprocessor_count(device) // max(1, batch * kv_heads))
    return max(1, min(want, -(-tiles // MIN_TILES_PER_SPLIT), MAX_SPLITS))


def _launch_decode(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, MB]
    context_lens: torch.Tensor,  # [B]
    scale: float,
    num_splits: int | None,
    block_n: int | None,
) -> torch.Tensor:  # [B, Hq, D]
    """Picks the split count and tile constants, then launches the split kernel (and the merge)."""
    b, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    group = hq // hkv
    out = torch.empty_like(q)
    if b == 0:
        return out
    d_pad = pow2_at_least(d)
    default_n, warps = _tile_config(k_cache.dtype, d_pad)
    block_n = block_n or default_n
    # The table width bounds every context, so no device-to-host read of context_lens is needed.
    max_tokens = max(1, block_tables.shape[1] * page)
    tiles = -(-max_tokens // block_n)
    splits = num_splits if num_splits is not None else _choose_splits(b, hkv, tiles, q.device)
    splits = max(1, min(splits, tiles))
    tokens_per_split = -(-tiles // splits) * block_n
    splits = -(-max_tokens // tokens_per_split)
    qk_prec, pv_prec = dot_precisions(k_cache.dtype)
    consts = dict(
        GROUP=group, GROUP_PAD=pow2_at_least(group), HEAD_DIM=d, D_PAD=d_pad, PAGE=page, BLOCK_N=block_n,
        QK_PRECISION=qk_prec, PV_PRECISION=pv_prec, num_warps=warps,
    )
    common = (q, k_cache, v_cache, block_tables, context_lens)
    strides = (
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
    )
    scale_log2 = scale * LOG2E
    if splits == 1:
        _decode_split_kernel[(b, hkv, 1)](
            *common, out, out, *strides, out.stride(0), out.stride(1), 0, 0, 0,
            scale_log2, tokens_per_split, WRITE_LSE=False, **consts,
        )
        return out
    part = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)  # [B, Hq, S, D]
    lse = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)  # [B, Hq, S]
    _decode_split_kernel[(b, hkv, splits)](
        *common, part, lse, *strides, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        scale_log2, tokens_per_split, WRITE_LSE=True, **consts,
    )
    _merge_splits_kernel[(b, hq)](
        part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), splits,
        SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=d, D_PAD=d_pad, num_warps=4,
    )
    return out


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, MB] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # [B, Hq, D] in q.dtype
    """Attention of each sequence's single query over its first context_lens[b] cached tokens.
    `num_splits` forces the split-KV count (default: sized to the GPU); `block_n` overrides the key
    tile (a power of two >= 16). Changes nothing."""
    check_rank("q", q, 3, "[B, Hq, D]")
    check_dtype("q", q, FLOAT_DTYPES)
    check_unit_last_stride("q", q)
    check_cache_pair(k_cache, v_cache)
    check_dtype("k_cache", k_cache, FLOAT_DTYPES)  # no fp8 loads in the Triton kernels
    check_dim("q", q, 2, k_cache.shape[3], "head dim of the cache")
    check_gqa(q.shape[1], k_cache.shape[2])
    check_rank("block_tables", block_tables, 2, "[B, MB]")
    check_dtype("block_tables", block_tables, INDEX_DTYPES)
    check_unit_last_stride("block_tables", block_tables)
    check_dim("block_tables", block_tables, 0, q.shape[0], "batch of q")
    check_rank("context_lens", context_lens, 1, "[B]")
    check_dtype("context_lens", context_lens, INDEX_DTYPES)
    check_unit_last_stride("context_lens", context_lens)
    check_dim("context_lens", context_lens, 0, q.shape[0], "batch of q")
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    device = check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                               context_lens=context_lens)
    check_launchable(_decode_split_kernel, device)
    return _launch_decode(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, block_n)
