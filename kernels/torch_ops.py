"""Vectorized torch path for CPU pools (what the CPU cluster runs). No Python loop over sequences."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.interface import KernelOps


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    # cache [NB, BS, H, D], block_tables [B, MB] -> [B, MB*BS, H, D]
    b, mb = block_tables.shape
    g = cache.index_select(0, block_tables.reshape(-1).long())  # [B*MB, BS, H, D]
    return g.view(b, mb * cache.shape[1], cache.shape[2], cache.shape[3])


class TorchOps(KernelOps):
    name = "torch"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping):
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
        nb, bs, h, d = k_cache.shape
        k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

    def decode_attention(self, q, k_cache, v_cache, block_tables, context_lens, scale):
        b, hq, d = q.shape
        hkv = k_cache.shape[2]
        k = _gather_kv(k_cache, block_tables)  # [B, S, Hkv, D]
        v = _gather_kv(v_cache, block_tables)
        s = k.shape[1]
        pos = torch.arange(s, device=q.device)
        mask = pos[None, :] < context_lens[:, None].to(pos.dtype)  # [B, S]
        qf = q.view(b, hq, 1, d)  # [B, Hq, 1, D]
        kf = k.permute(0, 2, 1, 3)  # [B, Hkv, S, D]
        vf = v.permute(0, 2, 1, 3)
        out = F.scaled_dot_product_attention(
            qf, kf.to(q.dtype), vf.to(q.dtype), attn_mask=mask[:, None, None, :], scale=scale,
            enable_gqa=hq != hkv,
        )  # [B, Hq, 1, D]
        return out.view(b, hq, d)

    def prefill_attention(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):
        t, hq, d = q.shape
        hkv = k_cache.shape[2]
        b = block_tables.shape[0]
        cu = cu_seqlens_q.long()
        q_lens = cu[1:] - cu[:-1]  # [B]
        max_q = int(q_lens.max())
        # Scatter packed queries into a padded [B, maxq] grid.
        seq_idx = torch.repeat_interleave(torch.arange(b, device=q.device), q_lens)  # [T]
        local = torch.arange(t, device=q.device) - cu[:-1][seq_idx]  # [T]
        qp = q.new_zeros(b, max_q, hq, d)
        qp[seq_idx, local] = q
        k = _gather_kv(k_cache, block_tables)  # [B, S, Hkv, D]
        v = _gather_kv(v_cache, block_tables)
        s = k.shape[1]
        ctx = context_lens.long()
        qpos = (ctx - q_lens)[:, None] + torch.arange(max_q, device=q.device)[None, :]  # [B, maxq]
        kpos = torch.arange(s, device=q.device)
        mask = kpos[None, None, :] <= qpos[:, :, None]  # [B, maxq, S]; causal, also bounds by ctx
        out = F.scaled_dot_product_attention(
            qp.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3).to(q.dtype), v.permute(0, 2, 1, 3).to(q.dtype),
            attn_mask=mask[:, None], scale=scale, enable_gqa=hq != hkv,
        )  # [B, Hq, maxq, D]
        return out.permute(0, 2, 1, 3)[seq_idx, local]  # [T, Hq, D]

    def pack_blocks(self, kv_cache, block_ids, layer=None, out=None):
        src = kv_cache if layer is None else kv_cache[layer]
        dim = 2 if layer is None else 1
        if out is None:
            return src.index_select(dim, block_ids)
        torch.index_select(src, dim, block_ids, out=out)
        return out

    def unpack_blocks(self, buffer, kv_cache, block_ids, layer=None):
        dst = kv_cache if layer is None else kv_cache[layer]
        dim = 2 if layer is None else 1
        dst.index_copy_(dim, block_ids, buffer.to(dst.dtype))
