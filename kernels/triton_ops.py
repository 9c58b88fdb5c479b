"""The Triton implementation of KernelOps: CUDA pools (or CPU pools under TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch

from pdserve.kernels.interface import KernelOps
from pdserve.kernels.triton_blocks import pack_blocks, unpack_blocks
from pdserve.kernels.triton_cache import store_kv
from pdserve.kernels.triton_common import is_interpreted
from pdserve.kernels.triton_decode import _decode_split_kernel, paged_decode_attention
from pdserve.kernels.triton_prefill import paged_prefill_attention


class TritonOps(KernelOps):
    """Delegates each operation to its kernel file's checked wrapper."""

    name = "triton"

    def store_kv(
        self,
        key: torch.Tensor,  # [N, Hkv, D]
        value: torch.Tensor,  # [N, Hkv, D]
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        slot_mapping: torch.Tensor,  # [N]; -1 = skip
    ) -> None:
        store_kv(key, value, k_cache, v_cache, slot_mapping)

    def decode_attention(
        self,
        q: torch.Tensor,  # [B, Hq, D]
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        block_tables: torch.Tensor,  # [B, MB]
        context_lens: torch.Tensor,  # [B]
        scale: float,
    ) -> torch.Tensor:  # [B, Hq, D]
        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)

    def prefill_attention(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        block_tables: torch.Tensor,  # [B, MB]
        cu_seqlens_q: torch.Tensor,  # [B + 1]
        context_lens: torch.Tensor,  # [B]
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        return paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)

    def pack_blocks(
        self,
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
        block_ids: torch.Tensor,  # [n]
        layer: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [L, 2, n, BS, Hkv, D] or [2, n, BS, Hkv, D]
        return pack_blocks(kv_cache, block_ids, layer, out)

    def unpack_blocks(
        self,
        buffer: torch.Tensor,  # [L, 2, n, BS, Hkv, D] or [2, n, BS, Hkv, D]
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
        block_ids: torch.Tensor,  # [n]
        layer: int | None = None,
    ) -> None:
        unpack_blocks(buffer, kv_cache, block_ids, layer)


def interpreter_active() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_decode_split_kernel)


def cuda_ready(device: str | torch.device) -> bool:
    """True when `device` is a CUDA device this process can use."""
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.is_available()
