"""KV block pack and unpack in Triton, for the transfer between nodes.

Pack gathers a request's blocks (all layers, or one) into one contiguous wire-format v1 buffer
``[L, 2, n, BS, Hkv, D]`` (or ``[2, n, BS, Hkv, D]``); unpack scatters such a buffer into another KV cache's
block ids. A block's BS*Hkv*D elements are one contiguous run in both the KV cache and the buffer, so one
program copies one chunk of one block of one (layer, key/value) plane.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import (
    FLOAT_DTYPES,
    check_block_ids,
    check_dtype,
    check_kv_pool,
    check_layer,
    check_same_device,
    check_wire_buffer,
    wire_shape,
)
from pdserve.kernels.triton_common import check_launchable

MAX_CHUNK = 4096


@triton.jit
def _copy_blocks_kernel(
    pool_ptr, buffer_ptr, ids_ptr,
    num_ids, block_numel,
    stride_layer, stride_kv, stride_block,
    TO_BUFFER: tl.constexpr, CHUNK: tl.constexpr,
):
    i = tl.program_id(0)  # position in block_ids
    plane = tl.program_id(1)  # layer * 2 + (0 key | 1 value)
    chunk = tl.program_id(2)
    block = tl.load(ids_ptr + i).to(tl.int64)
    layer = (plane // 2).to(tl.int64)
    kv = (plane % 2).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    pool_at = pool_ptr + layer * stride_layer + kv * stride_kv + block * stride_block + offs
    buffer_at = buffer_ptr + (plane.to(tl.int64) * num_ids + i) * block_numel + offs
    if TO_BUFFER:
        x = tl.load(pool_at, mask=mask)
        tl.store(buffer_at, x.to(tl.float32).to(buffer_ptr.dtype.element_ty), mask=mask)
    else:
        x = tl.load(buffer_at, mask=mask)
        tl.store(pool_at, x.to(tl.float32).to(pool_ptr.dtype.element_ty), mask=mask)


def _launch_copy_blocks(
    kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
    buffer: torch.Tensor,  # wire format v1
    block_ids: torch.Tensor,  # [n]
    layer: int | None,
    to_buffer: bool,
) -> None:
    """Grid = (block, plane, chunk of a block); a single layer is addressed through its view of the KV cache."""
    n = block_ids.numel()
    if n == 0:
        return
    cache = kv_cache if layer is None else kv_cache[layer : layer + 1]
    planes = cache.shape[0] * 2
    block_numel = cache.shape[3] * cache.shape[4] * cache.shape[5]
    chunk = min(MAX_CHUNK, triton.next_power_of_2(block_numel))
    grid = (n, planes, triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        cache, buffer, block_ids, n, block_numel, cache.stride(0), cache.stride(1), cache.stride(2),
        TO_BUFFER=to_buffer, CHUNK=chunk, num_warps=4,
    )


def _check_common(kv_cache: torch.Tensor, block_ids: torch.Tensor, layer: int | None) -> None:
    check_kv_pool("kv_cache", kv_cache)
    check_dtype("kv_cache", kv_cache, FLOAT_DTYPES)
    check_layer(layer, kv_cache.shape[0])
    check_block_ids(block_ids, kv_cache.shape[2])
    if block_ids.numel() and block_ids.stride(0) != 1:
        raise ValueError(f"block_ids must be contiguous, got stride {block_ids.stride()}")


def pack_blocks(
    kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
    block_ids: torch.Tensor,  # [n] int64
    layer: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [L, 2, n, BS, Hkv, D] or [2, n, BS, Hkv, D]
    """Gathers the blocks, in the order given, into one wire-format v1 buffer in the KV cache dtype.
    Writes only `out` (allocated when not given)."""
    _check_common(kv_cache, block_ids, layer)
    shape = wire_shape(kv_cache, block_ids.numel(), layer)
    if out is None:
        out = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    else:
        check_wire_buffer("out", out, kv_cache, block_ids.numel(), layer)
        if out.dtype != kv_cache.dtype:
            raise ValueError(f"out dtype {out.dtype} must equal the KV cache dtype {kv_cache.dtype}")
    device = check_same_device(kv_cache=kv_cache, block_ids=block_ids, out=out)
    check_launchable(_copy_blocks_kernel, device)
    _launch_copy_blocks(kv_cache, out, block_ids, layer, to_buffer=True)
    return out


def unpack_blocks(
    buffer: torch.Tensor,  # [L, 2, n, BS, Hkv, D] or [2, n, BS, Hkv, D]
    kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
    block_ids: torch.Tensor,  # [n] int64
    layer: int | None = None,
) -> None:
    """Scatters a wire-format v1 buffer into blocks block_ids of kv_cache (converting to the KV cache dtype).
    Changes only those blocks; ids must be distinct."""
    _check_common(kv_cache, block_ids, layer)
    check_wire_buffer("buffer", buffer, kv_cache, block_ids.numel(), layer)
    check_dtype("buffer", buffer, FLOAT_DTYPES)
    device = check_same_device(buffer=buffer, kv_cache=kv_cache, block_ids=block_ids)
    check_launchable(_copy_blocks_kernel, device)
    _launch_copy_blocks(kv_cache, buffer, block_ids, layer, to_buffer=False)
