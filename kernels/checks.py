"""Argument checks shared by the public kernel wrappers. Each raises ValueError naming the argument and
what was expected, so a bad call fails at the Python boundary instead of reading wild memory."""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
# KV caches the torch and CPU kernels read: the float dtypes, and the two fp8 formats (widened to float32 on
# load). The Triton kernels check FLOAT_DTYPES only.
KV_DTYPES = (*FLOAT_DTYPES, torch.float8_e5m2, torch.float8_e4m3fn)


def check_rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    """Requires `t` to have `rank` dimensions (`layout` names them in the message). Changes nothing."""
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")


def check_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    """Requires `t.dtype` to be one of `allowed`. Changes nothing."""
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name} must have dtype in ({names}), got {str(t.dtype).removeprefix('torch.')}")


def check_dim(name: str, t: torch.Tensor, dim: int, size: int, what: str) -> None:
    """Requires `t.shape[dim] == size`; `what` says where `size` comes from. Changes nothing."""
    if t.shape[dim] != size:
        raise ValueError(f"{name}.shape[{dim}] must be {size} ({what}), got shape {tuple(t.shape)}")


def check_unit_last_stride(name: str, t: torch.Tensor) -> None:
    """Requires the innermost dimension to be contiguous (the kernels load rows as vectors). Changes nothing."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def check_contiguous_inner(name: str, t: torch.Tensor, ndims: int) -> None:
    """Requires the innermost `ndims` dimensions to be densely packed (a block is one contiguous run).
    Changes nothing."""
    expected = 1
    for dim in range(t.dim() - 1, t.dim() - 1 - ndims, -1):
        if t.shape[dim] > 1 and t.stride(dim) != expected:
            raise ValueError(
                f"{name} must be contiguous over its last {ndims} dimensions, got shape {tuple(t.shape)} "
                f"strides {t.stride()}"
            )
        expected *= t.shape[dim]


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """Requires every tensor to live on one device and returns it. Changes nothing."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listing = ", ".join(f"{n}={d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")
    return first


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Requires k_cache/v_cache to be matching [NB, BS, Hkv, D] pools with unit stride on D. Changes nothing."""
    check_rank("k_cache", k_cache, 4, "[NB, BS, Hkv, D]")
    check_rank("v_cache", v_cache, 4, "[NB, BS, Hkv, D]")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")
    check_dtype("k_cache", k_cache, KV_DTYPES)
    check_unit_last_stride("k_cache", k_cache)
    check_unit_last_stride("v_cache", v_cache)


def check_gqa(hq: int, hkv: int) -> int:
    """Returns the query heads per KV head, requiring Hq to be a multiple of Hkv. Changes nothing."""
    if hkv <= 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a positive multiple of KV heads ({hkv})")
    return hq // hkv


def check_kv_pool(name: str, kv_cache: torch.Tensor) -> None:
    """Requires a [L, 2, NB, BS, Hkv, D] KV cache whose blocks are contiguous runs. Changes nothing."""
    check_rank(name, kv_cache, 6, "[L, 2, NB, BS, Hkv, D]")
    check_dim(name, kv_cache, 1, 2, "key and value")
    check_contiguous_inner(name, kv_cache, 3)


def check_block_ids(block_ids: torch.Tensor, num_blocks: int) -> None:
    """Requires a 1-D integer tensor of block ids. Range is checked on CPU only (a device check would
    force a synchronisation). Changes nothing."""
    check_rank("block_ids", block_ids, 1, "[n]")
    check_dtype("block_ids", block_ids, INDEX_DTYPES)
    if block_ids.device.type == "cpu" and block_ids.numel() > 0:
        lo, hi = int(block_ids.min()), int(block_ids.max())
        if lo < 0 or hi >= num_blocks:
            raise ValueError(f"block_ids must lie in [0, {num_blocks}), got range [{lo}, {hi}]")


def check_layer(layer: int | None, num_layers: int) -> None:
    """Requires `layer` to be None or a valid layer index. Changes nothing."""
    if layer is not None and not 0 <= layer < num_layers:
        raise ValueError(f"layer must be in [0, {num_layers}) or None, got {layer}")


def wire_shape(kv_cache: torch.Tensor, n: int, layer: int | None) -> tuple[int, ...]:
    """The wire-format v1 buffer shape for `n` blocks of `kv_cache` (all layers, or one)."""
    inner = (n, *kv_cache.shape[3:])
    return (2, *inner) if layer is not None else (kv_cache.shape[0], 2, *inner)


def check_wire_buffer(name: str, buffer: torch.Tensor, kv_cache: torch.Tensor, n: int, layer: int | None) -> None:
    """Requires `buffer` to be a contiguous wire-format v1 buffer for `n` blocks of `kv_cache`. Changes nothing."""
    shape = wire_shape(kv_cache, n, layer)
    if tuple(buffer.shape) != shape:
        raise ValueError(f"{name} must have wire-format shape {shape}, got {tuple(buffer.shape)}")
    if not buffer.is_contiguous():
        raise ValueError(f"{name} must be contiguous (wire format v1 is one dense run)")
