"""Plain float32 references for every kernel, written to be read rather than to be fast.

Each one walks sequences, heads, tokens or blocks with ordinary Python loops and reads the KV cache through
the block table one block (or slot) at a time, so it shares no gathering, masking, tiling or merging
logic with the kernels it checks. Attention is a plain full softmax per query head, in float32 whatever
the input dtype (inputs are upcast exactly before any arithmetic). Results live on the inputs' device.
"""

from __future__ import annotations

import math

import torch


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Returns the first `num_tokens` cached vectors of one sequence as float32 [num_tokens, H, D]:
    block_table[j] holds positions j*BS .. j*BS+BS-1, so the blocks are read in table order and the
    last one is cut at num_tokens. Changes nothing."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = [cache[int(block_table[j])].float() for j in range(num_blocks)]  # each [BS, H, D]
    if not blocks:
        return cache.new_zeros(0, *cache.shape[2:], dtype=torch.float32)
    return torch.cat(blocks)[:num_tokens]


def attention(
    q: torch.Tensor,  # [M, Hq, D]
    k: torch.Tensor,  # [S, Hkv, D]
    v: torch.Tensor,  # [S, Hkv, D]
    q_positions: list[int],  # position of each query row in the sequence
    scale: float,
) -> torch.Tensor:  # [M, Hq, D] float32
    """Naive causal attention of each query row over keys at positions <= its own, one query head at
    a time; query head h reads KV head h // (Hq / Hkv). Changes nothing."""
    num_q, hq, head_dim = q.shape
    num_k, hkv = k.shape[0], k.shape[1]
    group = hq // hkv
    q_pos = torch.tensor(q_positions, device=q.device)  # [M]
    k_pos = torch.arange(num_k, device=q.device)  # [S]
    hidden = k_pos[None, :] > q_pos[:, None]  # [M, S]: keys after the query's own position
    out = torch.zeros(num_q, hq, head_dim, dtype=torch.float32, device=q.device)
    for h in range(hq):
        kv_head = h // group
        scores = (q[:, h].float() @ k[:, kv_head].float().T) * scale  # [M, S]
        scores = scores.masked_fill(hidden, float("-inf"))
        weights = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
        weights = weights / weights.sum(dim=1, keepdim=True)
        out[:, h] = weights @ v[:, kv_head].float()
    return out


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, MB]
    context_lens: torch.Tensor,  # [B]
    scale: float,
) -> torch.Tensor:  # [B, Hq, D] float32
    """One query per sequence at the last position, over context_lens[b] cached tokens. Changes nothing."""
    out = []
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        k = gather_context(k_cache, block_tables[b], n)
        v = gather_context(v_cache, block_tables[b], n)
        out.append(attention(q[b : b + 1], k, v, [n - 1], scale)[0])
    return torch.stack(out)


def prefill_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, MB]
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    context_lens: torch.Tensor,  # [B]
    scale: float,
) -> torch.Tensor:  # [T, Hq, D] float32
    """Causal attention for the new tokens of each sequence; the K/V of every position (cached prefix
    and new tokens alike) are read from the KV cache. Changes nothing."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(block_tables.shape[0]):
        start, stop = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n = int(context_lens[b])
        first = n - (stop - start)
        k = gather_context(k_cache, block_tables[b], n)
        v = gather_context(v_cache, block_tables[b], n)
        out[start:stop] = attention(q[start:stop], k, v, list(range(first, n)), scale)
    return out


def store_kv(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N]; -1 = skip
) -> None:
    """Writes token i's key/value into slot slot_mapping[i], one token at a time. Changes those slots."""
    block_size = k_cache.shape[1]
    for i in range(key.shape[0]):
        slot = int(slot_mapping[i])
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[i].to(k_cache.dtype)
        v_cache[slot // block_size, slot % block_size] = value[i].to(v_cache.dtype)


def pack_blocks(kv_cache: torch.Tensor, block_ids: list[int], layer: int | None = None) -> torch.Tensor:
    """Wire format v1 built block by block: [L, 2, n, BS, Hkv, D], or [2, n, BS, Hkv, D] for one layer.
    Changes nothing."""
    layers = range(kv_cache.shape[0]) if layer is None else [layer]
    per_layer = []
    for lyr in layers:
        per_kv = [torch.stack([kv_cache[lyr, kv, blk].clone() for blk in block_ids]) for kv in range(2)]
        per_layer.append(torch.stack(per_kv))
    return per_layer[0] if layer is not None else torch.stack(per_layer)


def unpack_blocks(buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: list[int], layer: int | None = None) -> None:
    """Copies buffer block i into block block_ids[i] of kv_cache, block by block. Changes those blocks."""
    layers = range(kv_cache.shape[0]) if layer is None else [layer]
    for li, lyr in enumerate(layers):
        layer_buf = buffer[li] if layer is None else buffer
        for kv in range(2):
            for i, blk in enumerate(block_ids):
                kv_cache[lyr, kv, blk] = layer_buf[kv, i].to(kv_cache.dtype)


def default_scale(head_dim: int) -> float:
    """The usual 1/sqrt(D) softmax scale."""
    return 1.0 / math.sqrt(head_dim)
