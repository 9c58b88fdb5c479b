"""Per-step attention metadata the model runner builds and every attention layer reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import KernelOps


@dataclass
class AttentionMetadata:
    """Describes one forward step over T packed tokens: first the decode tokens (one per decoding
    sequence), then the prefill tokens (a chunk per prefilling sequence, back to back)."""

    slot_mapping: torch.Tensor  # [T] int64, cache slot for each token's K/V (-1: don't store)
    num_decode_tokens: int  # tokens [0, num_decode_tokens) are decodes, the rest prefill chunks
    decode_block_tables: torch.Tensor | None  # [Bd, MB] int32
    decode_context_lens: torch.Tensor | None  # [Bd] int32, KV length including the new token
    prefill_block_tables: torch.Tensor | None  # [Bp, MB] int32
    prefill_cu_seqlens_q: torch.Tensor | None  # [Bp + 1] int32, chunk offsets relative to the prefill part
    prefill_context_lens: torch.Tensor | None  # [Bp] int32, KV length including the chunk


def paged_attention(
    ops: KernelOps,
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Stores this step's K/V in the cache, then attends every query over its paged context."""
    ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    nd = meta.num_decode_tokens
    if nd == q.shape[0]:
        return ops.decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    if nd == 0:
        return ops.prefill_attention(
            q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q, meta.prefill_context_lens, scale
        )
    out = torch.empty_like(q)
    out[:nd] = ops.decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    out[nd:] = ops.prefill_attention(
        q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q, meta.prefill_context_lens, scale
    )
    return out
