"""Cache writes in Triton: store a step's new K/V into their cache slots (slot -1 = skip).

One program per token copies its [Hkv, D] key and value rows to slot (slot // BS, slot % BS), converting
through float32 to the KV cache dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_cache_pair,
    check_dim,
    check_dtype,
    check_rank,
    check_same_device,
    check_unit_last_stride,
)
from pdserve.kernels.triton_common import check_launchable, pow2_at_least


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    HEADS: tl.constexpr, H_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    # The slot test is broadcast to the tile first: Triton's interpreter rejects a scalar mask term.
    stored = (tl.zeros([H_PAD, D_PAD], tl.int64) + slot) >= 0
    mask = (offs_h[:, None] < HEADS) & (offs_d[None, :] < HEAD_DIM) & stored
    block = slot // PAGE
    offset = slot % PAGE
    tok64 = tok.to(tl.int64)
    key = tl.load(key_ptr + tok64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    value = tl.load(value_ptr + tok64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(k_dst, key.to(tl.float32).to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, value.to(tl.float32).to(v_cache_ptr.dtype.element_ty), mask=mask)


def _launch_store_kv(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N]
) -> None:
    """One program per token; the [Hkv, D] tile is padded to powers of two and masked."""
    n, heads, d = key.shape
    if n == 0:
        return
    _store_kv_kernel[(n,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEADS=heads, H_PAD=triton.next_power_of_2(heads), HEAD_DIM=d, D_PAD=pow2_at_least(d, 1),
        PAGE=k_cache.shape[1], num_warps=4,
    )


def store_kv(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [N] int64 (or int32); -1 = skip
) -> None:
    """Writes key[i]/value[i] into slot slot_mapping[i] of k_cache/v_cache. Changes only those slots.
    Slots must be distinct (two tokens writing one slot leave either value)."""
    check_cache_pair(k_cache, v_cache)
    check_dtype("k_cache", k_cache, FLOAT_DTYPES)  # no fp8 loads in the Triton kernels
    for name, t in (("key", key), ("value", value)):
        check_rank(name, t, 3, "[N, Hkv, D]")
        check_dtype(name, t, FLOAT_DTYPES)
        check_unit_last_stride(name, t)
        check_dim(name, t, 1, k_cache.shape[2], "KV heads of the cache")
        check_dim(name, t, 2, k_cache.shape[3], "head dim of the cache")
    check_dim("value", value, 0, key.shape[0], "tokens of key")
    check_rank("slot_mapping", slot_mapping, 1, "[N]")
    check_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    check_unit_last_stride("slot_mapping", slot_mapping)
    check_dim("slot_mapping", slot_mapping, 0, key.shape[0], "tokens of key")
    device = check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_launchable(_store_kv_kernel, device)
    _launch_store_kv(key, value, k_cache, v_cache, slot_mapping)
