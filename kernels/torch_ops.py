"""Vectorized torch path for CPU pools (what the CPU cluster runs). No Python loop over sequences.

Attention works on chunks of sequences sorted by context length (a loop over a few chunks, not over
sequences): each chunk gathers only the blocks its longest member needs, so padding stays small and the
gathered K/V of one chunk stay in the last-level cache while the fused CPU attention kernel reads them.
That kernel takes the G query heads of each KV head against it directly (enable_gqa), so K/V are never
expanded to Hq heads. Work is float32 whatever the pool dtype.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.checks import (
    check_block_ids,
    check_cache_pair,
    check_dim,
    check_gqa,
    check_kv_pool,
    check_layer,
    check_rank,
    check_wire_buffer,
    wire_shape,
)
from kernels.interface import KernelOps


@dataclass(frozen=True)
class _Chunk:
    """Sequences [start, stop) of the sorted batch, attended together."""

    start: int
    stop: int
    kv_len: int  # longest context in the chunk
    q_len: int  # most query rows of any sequence in the chunk


def _plan_chunks(
    kv_lens: list[int],
    q_lens: list[int],
    row_bytes: int,
    chunk_bytes: int,
    slack: float = 1.25,
    floor_bytes: int = 1 << 20,
) -> list[_Chunk]:
    """Cuts a batch sorted by (q_len, kv_len) into chunks of neighbours. A chunk grows unless that would
    gather more than `chunk_bytes` of keys, or pad its work (members x most queries x longest context)
    beyond `slack` times the real work by more than `floor_bytes` worth of key rows (below that, one
    more chunk costs more than the padding). A planning pass over plain ints, no tensor work per
    sequence."""
    chunks: list[_Chunk] = []
    start, work, max_q, max_kv = 0, 0, 0, 0
    for i, (n, ql) in enumerate(zip(kv_lens, q_lens, strict=True)):
        grown_q, grown_kv, grown_work = max(max_q, ql), max(max_kv, n), work + ql * n
        members = i - start + 1
        padded = members * grown_q * grown_kv
        too_padded = padded > slack * grown_work and (padded - grown_work) * row_bytes > floor_bytes
        too_big = members * grown_kv * row_bytes > chunk_bytes
        if i > start and (too_padded or too_big):
            chunks.append(_Chunk(start, i, max_kv, max_q))
            start, work, max_q, max_kv = i, ql * n, ql, n
        else:
            work, max_q, max_kv = grown_work, grown_q, grown_kv
    if kv_lens:
        chunks.append(_Chunk(start, len(kv_lens), max_kv, max_q))
    return chunks


class _Workspace:
    """A reusable gather buffer: large allocations on CPU are fresh mmaps that page-fault on every call,
    so one buffer that grows as needed is kept. If two threads attend at once the second simply gets
    a private allocation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, bool]:
        """Returns a flat buffer of at least `numel` elements and whether the lock was taken (then the
        caller must call release)."""
        if not self._lock.acquire(blocking=False):
            return torch.empty(numel, dtype=dtype, device=device), False
        key = (dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf, True

    def release(self) -> None:
        self._lock.release()


class TorchOps(KernelOps):
    """Device-agnostic torch implementation; the fast path on CPU.

    chunk_bytes: gathered key bytes per chunk of sequences (keeps K+V of a chunk inside the last-level
    cache)."""

    name = "torch"

    def __init__(self, chunk_bytes: int = 4 << 20) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._workspace = _Workspace()

    def store_kv(
        self,
        key: torch.Tensor,  # [N, Hkv, D]
        value: torch.Tensor,  # [N, Hkv, D]
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        slot_mapping: torch.Tensor,  # [N]; -1 = skip
    ) -> None:
        check_cache_pair(k_cache, v_cache)
        check_rank("slot_mapping", slot_mapping, 1, "[N]")
        nb, bs, h, d = k_cache.shape
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
        slots = slot_mapping.long()
        k_cache.view(nb * bs, h, d).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(nb * bs, h, d).index_copy_(0, slots, value.to(v_cache.dtype))

    def decode_attention(
        self,
        q: torch.Tensor,  # [B, Hq, D]
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        block_tables: torch.Tensor,  # [B, MB]
        context_lens: torch.Tensor,  # [B]
        scale: float,
    ) -> torch.Tensor:  # [B, Hq, D]
        check_rank("q", q, 3, "[B, Hq, D]")
        check_rank("block_tables", block_tables, 2, "[B, MB]")
        check_dim("block_tables", block_tables, 0, q.shape[0], "batch of q")
        return self._attend(q, k_cache, v_cache, block_tables, None, None, context_lens, scale)

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
        check_rank("q", q, 3, "[T, Hq, D]")
        cu = cu_seqlens_q.long()
        return self._attend(q, k_cache, v_cache, block_tables, cu[:-1], cu[1:] - cu[:-1], context_lens, scale)

    def _attend(
        self,
        q: torch.Tensor,  # [T, Hq, D] packed query rows
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, MB]
        q_start: torch.Tensor | None,  # [B] first row of each sequence in q; None: row b (decode)
        q_lens: torch.Tensor | None,  # [B] rows per sequence (its last positions); None: 1 each (decode)
        context_lens: torch.Tensor,  # [B]
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D] in q.dtype
        """Causal paged attention of every query row over its sequence's cache. Changes nothing outside
        the returned tensor (and the private gather workspace)."""
        check_cache_pair(k_cache, v_cache)
        t, hq, d = q.shape
        nb, bs, hkv, _ = k_cache.shape
        check_dim("q", q, 2, k_cache.shape[3], "head dim of the cache")
        g = check_gqa(hq, hkv)
        check_rank("block_tables", block_tables, 2, "[B, MB]")
        b = block_tables.shape[0]
        out = torch.empty_like(q)
        if b == 0 or t == 0:
            return out
        dev = q.device
        ctx_all = context_lens.long()
        ql_sorted: torch.Tensor | None = None
        if q_lens is None or q_start is None:  # decode: sequence b owns query row b
            ctx_sorted, order = torch.sort(ctx_all, stable=True)
            start_sorted = order
            ql_list = [1] * b
        else:
            ql_all = q_lens.long()
            # Sequences with similar query counts, then similar contexts, share a chunk (less padding).
            _, order = torch.sort(ql_all * (int(ctx_all.max()) + 1) + ctx_all, stable=True)
            ctx_sorted, ql_sorted = ctx_all.index_select(0, order), ql_all.index_select(0, order)
            start_sorted = q_start.long().index_select(0, order)
            ql_list = ql_sorted.tolist()
        tables_sorted = block_tables.index_select(0, order).long()
        chunks = _plan_chunks(ctx_sorted.tolist(), ql_list, hkv * d * k_cache.element_size(), self.chunk_bytes)
        max_rows = max((c.stop - c.start) * -(-c.kv_len // bs) for c in chunks)
        workspace, locked = self._workspace.acquire(2 * max_rows * bs * hkv * d, k_cache.dtype, dev)
        try:
            for c in chunks:
                self._attend_chunk(q, k_cache, v_cache, tables_sorted, start_sorted, ql_sorted, ctx_sorted, c,
                                   scale, g, workspace, out)
        finally:
            if locked:
                self._workspace.release()
        return out

    def _attend_chunk(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,
        tables: torch.Tensor,  # [B, MB] int64, sorted
        q_start: torch.Tensor,  # [B] first query row, sorted
        q_lens: torch.Tensor | None,  # [B] query rows, sorted; None: one each (decode)
        ctx: torch.Tensor,  # [B] context lengths, sorted
        c: _Chunk,
        scale: float,
        g: int,
        workspace: torch.Tensor,  # flat, >= 2 * rows * BS * Hkv * D elements
        out: torch.Tensor,  # [T, Hq, D]; the chunk's query rows are written
    ) -> None:
        """Attention for one chunk of sequences; writes their rows of `out`."""
        _, bs, hkv, d = k_cache.shape
        hq = hkv * g
        bk = c.stop - c.start
        dev = q.device
        mb = max(1, -(-c.kv_len // bs))
        s_pad = mb * bs
        ids = tables[c.start : c.stop, :mb].reshape(-1)  # [bk*mb]
        n_el = bk * mb * bs * hkv * d
        k_buf = workspace[:n_el].view(bk * mb, bs, hkv, d)
        v_buf = workspace[n_el : 2 * n_el].view(bk * mb, bs, hkv, d)
        torch.index_select(k_cache, 0, ids, out=k_buf)
        torch.index_select(v_cache, 0, ids, out=v_buf)
        k = k_buf.view(bk, s_pad, hkv, d).float()  # [bk, S, Hkv, D]; no copy when the pool is fp32
        v = v_buf.view(bk, s_pad, hkv, d).float()
        ctx_c = ctx[c.start : c.stop]
        kpos = torch.arange(s_pad, device=dev)

        mq = c.q_len
        if q_lens is None:  # decode: one row per sequence, at its last position
            rows = q_start[c.start : c.stop, None]  # [bk, 1]
            row_valid = None
            allowed = (kpos[None, :] < ctx_c[:, None])[:, None, :]  # [bk, 1, S]
        else:
            m_idx = torch.arange(mq, device=dev)
            ql_c = q_lens[c.start : c.stop]
            row_valid = m_idx[None, :] < ql_c[:, None]  # [bk, Mq]
            rows = q_start[c.start : c.stop, None] + torch.where(row_valid, m_idx[None, :], 0)  # [bk, Mq]
            rows = rows.clamp_(max=q.shape[0] - 1)  # a sequence with no query rows points past the end
            qpos = (ctx_c - ql_c)[:, None] + m_idx[None, :]  # [bk, Mq]
            allowed = kpos[None, None, :] <= qpos[:, :, None]  # [bk, Mq, S]
            # padding query rows sit past the context: keep them off the unwritten slots too
            allowed &= (kpos[None, :] < ctx_c[:, None])[:, None, :]
        qc = q.index_select(0, rows.reshape(-1)).float().view(bk, mq, hq, d).transpose(1, 2)  # [bk, Hq, Mq, D]

        def attend() -> torch.Tensor:  # [bk, Hq, Mq, D]
            # Every row of a sequence sees the same padded key range whatever chunk it came in, so a
            # prompt prefilled in pieces sums in the same order as in one piece. SDPA's fused CPU
            # kernel reads the G query heads of a KV head against it (enable_gqa): no per-head K/V copy.
            return F.scaled_dot_product_attention(qc, k.transpose(1, 2), v.transpose(1, 2),
                                                  attn_mask=allowed[:, None], scale=scale, enable_gqa=g > 1)

        o = attend()
        if not math.isfinite(float(o.sum())):  # one reduction; a false alarm only costs the slow path
            # Slots past a context were never written and may hold anything; a masked score plus inf or
            # NaN, or a zero weight times NaN, is NaN. Zeroing exactly those rows and attending again
            # keeps the common path free of a pass over the gathered K/V.
            pad_rows = (kpos[None, :] >= ctx_c[:, None]).view(-1).nonzero().view(-1)  # over [bk*S]
            k.view(bk * s_pad, hkv * d).index_fill_(0, pad_rows, 0.0)
            v.view(bk * s_pad, hkv * d).index_fill_(0, pad_rows, 0.0)
            o = attend()
        oc = o.transpose(1, 2).reshape(bk * mq, hq, d)  # [bk*Mq, Hq, D]
        if row_valid is None or bool(row_valid.all()):
            out.index_copy_(0, rows.reshape(-1), oc.to(out.dtype))
        else:
            flat_valid = row_valid.view(-1)
            out.index_copy_(0, rows.reshape(-1)[flat_valid], oc[flat_valid].to(out.dtype))

    def pack_blocks(
        self,
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
        block_ids: torch.Tensor,  # [n]
        layer: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [L, 2, n, BS, Hkv, D] or [2, n, BS, Hkv, D]
        check_kv_pool("kv_cache", kv_cache)
        check_layer(layer, kv_cache.shape[0])
        check_block_ids(block_ids, kv_cache.shape[2])
        src = kv_cache if layer is None else kv_cache[layer]
        dim = 2 if layer is None else 1
        ids = block_ids.long()
        if out is None:
            return src.index_select(dim, ids)
        check_wire_buffer("out", out, kv_cache, ids.numel(), layer)
        if out.dtype != kv_cache.dtype:
            raise ValueError(f"out dtype {out.dtype} must equal the pool dtype {kv_cache.dtype}")
        torch.index_select(src, dim, ids, out=out)
        return out

    def unpack_blocks(
        self,
        buffer: torch.Tensor,  # [L, 2, n, BS, Hkv, D] or [2, n, BS, Hkv, D]
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
        block_ids: torch.Tensor,  # [n]
        layer: int | None = None,
    ) -> None:
        check_kv_pool("kv_cache", kv_cache)
        check_layer(layer, kv_cache.shape[0])
        check_block_ids(block_ids, kv_cache.shape[2])
        shape = wire_shape(kv_cache, block_ids.numel(), layer)
        if tuple(buffer.shape) != shape:
            raise ValueError(f"buffer must have wire-format shape {shape}, got {tuple(buffer.shape)}")
        dst = kv_cache if layer is None else kv_cache[layer]
        dim = 2 if layer is None else 1
        dst.index_copy_(dim, block_ids.long(), buffer.to(dst.dtype))
