"""Per-step attention metadata the model runner builds and every attention layer reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.kernels import KernelOps


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
    # Layer-independent attention plans ("decode" / "prefill", see KernelOps.plan; None when the backend
    # makes none), made by the first layer and reused by the others: the tensors above must not change
    # while a step runs.
    plans: dict[str, object | None] = field(default_factory=dict, repr=False, compare=False)


def _planned(
    ops: KernelOps, kind: str, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata,
    tables: torch.Tensor, ctx: torch.Tensor, cu: torch.Tensor | None,
) -> object | None:
    if kind not in meta.plans:
        meta.plans[kind] = ops.plan(q, k_cache, tables, ctx, cu)
    return meta.plans[kind]


def _decode(
    ops: KernelOps, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [Bd, Hq, D]
    tables, ctx = meta.decode_block_tables, meta.decode_context_lens
    assert tables is not None and ctx is not None
    plan = _planned(ops, "decode", q, k_cache, meta, tables, ctx, None)
    if plan is None:
        return ops.decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    return ops.attend_planned(q, k_cache, v_cache, plan, scale)


def _prefill(
    ops: KernelOps, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [Tp, Hq, D]
    tables, cu, ctx = meta.prefill_block_tables, meta.prefill_cu_seqlens_q, meta.prefill_context_lens
    assert tables is not None and cu is not None and ctx is not None
    plan = _planned(ops, "prefill", q, k_cache, meta, tables, ctx, cu)
    if plan is None:
        return ops.prefill_attention(q, k_cache, v_cache, tables, cu, ctx, scale)
    return ops.attend_planned(q, k_cache, v_cache, plan, scale)


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
        return _decode(ops, q, k_cache, v_cache, meta, scale)
    if nd == 0:
        return _prefill(ops, q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    out[:nd] = _decode(ops, q[:nd], k_cache, v_cache, meta, scale)
    out[nd:] = _prefill(ops, q[nd:], k_cache, v_cache, meta, scale)
    return out
