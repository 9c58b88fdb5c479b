"""Vectorized torch path for CPU pools (what the CPU cluster runs). No Python loop over sequences.

Attention works on chunks of sequences sorted by context length (a loop over a few chunks, not over
sequences): each chunk gathers only the blocks its longest member needs, so padding stays small and the
gathered K/V of one chunk stay in the last-level cache while the fused CPU attention kernel reads them.
That kernel takes the G query heads of each KV head against it directly (as G query rows for a decode,
enable_gqa for prefill), so K/V are never expanded to Hq heads. Work is float32 whatever the KV cache dtype.

Everything that depends only on the batch (sort, chunks, gather indices, masks) is an `AttentionPlan`
(`kernels.torch_plan`): the engine makes one per step and every layer reuses it (`plan` /
`attend_planned`).
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from pdserve.kernels.checks import (
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
from pdserve.kernels.interface import KernelOps, fp8_as_bytes
from pdserve.kernels.torch_plan import AttentionPlan, _ChunkPlan, _plan_chunks, plan_sorted_chunks, sort_batch

__all__ = ["AttentionPlan", "TorchOps", "_plan_chunks"]  # the plan lives in kernels.torch_plan


def _kv_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | None:  # [2*NB, BS, Hkv, D]
    """One view over K then V when v_cache directly follows k_cache in memory, as the two halves of
    a layer of the engine's KV cache do (kv_cache[l] = [2, NB, BS, Hkv, D]); else None."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    if k_cache.untyped_storage().data_ptr() != v_cache.untyped_storage().data_ptr():
        return None
    if v_cache.data_ptr() != k_cache.data_ptr() + k_cache.numel() * k_cache.element_size():
        return None
    nb, bs, hkv, d = k_cache.shape
    return k_cache.as_strided((2 * nb, bs, hkv, d), k_cache.stride())


def _gather(
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,
    kv_pair: torch.Tensor | None,  # [2*NB, BS, Hkv, D] from _kv_pair
    c: _ChunkPlan,
    workspace: torch.Tensor,  # flat, >= 2 * ids * BS * Hkv * D elements
) -> tuple[torch.Tensor, torch.Tensor]:  # [bk, Hkv, S, D] float32 views each
    """Copies the chunk's blocks into the workspace (K then V) and returns them head-major."""
    _, bs, hkv, d = k_cache.shape
    n2 = c.kv_ids.numel()  # 2 * gathered blocks
    n_el = n2 // 2 * bs * hkv * d
    buf = workspace[: 2 * n_el].view(n2, bs, hkv, d)  # K blocks, then V blocks
    if kv_pair is not None:  # one copy op for both halves
        torch.index_select(kv_pair, 0, c.kv_ids, out=buf)
    else:
        ids = c.ids
        torch.index_select(k_cache, 0, ids, out=buf[: n2 // 2])
        torch.index_select(v_cache, 0, ids, out=buf[n2 // 2 :])
    # [bk, S, Hkv, D] memory read as [bk, Hkv, S, D] strided views (one op each)
    bk, s = c.stop - c.start, c.s_pad
    shape, stride = (bk, hkv, s, d), (s * hkv * d, d, hkv * d, 1)
    k, v = buf.as_strided(shape, stride), buf.as_strided(shape, stride, buf.storage_offset() + n_el)
    if k.dtype != torch.float32:  # a half-precision or fp8 KV cache: attend in float32 (copies)
        k, v = k.float(), v.float()
    return k, v


def _zero_padding(k: torch.Tensor, v: torch.Tensor, c: _ChunkPlan) -> None:
    """Zeroes the gathered slots past each context ([bk, Hkv, S, D] views, in place). Slots past a context
    were never written and may hold anything; a masked score plus inf or NaN, or a zero weight times NaN,
    is NaN. Zeroing exactly those slots keeps the common path free of a pass over the gathered K/V."""
    pad = torch.arange(c.s_pad, device=k.device)[None, :] >= c.ctx[:, None]  # [bk, S]
    k.masked_fill_(pad[:, None, :, None], 0.0)
    v.masked_fill_(pad[:, None, :, None], 0.0)


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
    cache). slack, pad_floor_bytes: how much padding a chunk may carry before it is cut (`_plan_chunks`).
    The fused kernel spends about as long on a padded key as on a real one while a chunk costs only a
    few tens of microseconds, so chunks are cut at 10% padding with no floor (on 64 decodes of 32-512+
    tokens, 0-5% less step time than a 25% slack above 1 MiB, within this machine's noise)."""

    name = "torch"

    def __init__(self, chunk_bytes: int = 4 << 20, slack: float = 1.1, pad_floor_bytes: int = 0) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        if slack < 1 or pad_floor_bytes < 0:
            raise ValueError(f"need slack >= 1 and pad_floor_bytes >= 0, got {slack} and {pad_floor_bytes}")
        self.chunk_bytes = chunk_bytes
        self.slack = slack
        self.pad_floor_bytes = pad_floor_bytes
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
        # an fp8 KV cache: the values are rounded to fp8 here (round to nearest even), then copied as bytes
        fp8_as_bytes(k_cache.view(nb * bs, h, d)).index_copy_(0, slots, fp8_as_bytes(key.to(k_cache.dtype)))
        fp8_as_bytes(v_cache.view(nb * bs, h, d)).index_copy_(0, slots, fp8_as_bytes(value.to(v_cache.dtype)))

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
        check_cache_pair(k_cache, v_cache)
        return self.attend_planned(q, k_cache, v_cache, self.plan(q, k_cache, block_tables, context_lens), scale)

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
        check_cache_pair(k_cache, v_cache)
        plan = self.plan(q, k_cache, block_tables, context_lens, cu_seqlens_q)
        return self.attend_planned(q, k_cache, v_cache, plan, scale)

    def plan(
        self,
        q: torch.Tensor,  # [T, Hq, D]; only its shape is read
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]; only its geometry is read
        block_tables: torch.Tensor,  # [B, MB]
        context_lens: torch.Tensor,  # [B]
        cu_seqlens_q: torch.Tensor | None = None,  # [B + 1]; None: decode, query row b is sequence b
    ) -> AttentionPlan:
        """Everything about a batch's attention that does not depend on the layer: the sort by length,
        the chunks, their gather indices and masks. The engine plans once per step and reuses the plan
        in every layer (`attend_planned`). Changes nothing."""
        check_rank("q", q, 3, "[T, Hq, D]")
        check_rank("k_cache", k_cache, 4, "[NB, BS, Hkv, D]")
        check_rank("block_tables", block_tables, 2, "[B, MB]")
        nb, bs, hkv, d = k_cache.shape
        geometry = (nb, bs, hkv, d, k_cache.dtype, k_cache.device)
        b = block_tables.shape[0]
        decode = cu_seqlens_q is None
        num_rows = q.shape[0]
        dev = k_cache.device
        if b == 0 or num_rows == 0:
            empty = torch.empty(0, dtype=torch.long, device=dev)
            return AttentionPlan(geometry, decode, b, num_rows, empty, (), 0)
        sorted_batch = sort_batch(context_lens, cu_seqlens_q)
        planned = plan_sorted_chunks(k_cache, block_tables, sorted_batch, num_rows, self.chunk_bytes, self.slack,
                                     self.pad_floor_bytes)
        max_blocks = max(c.kv_ids.numel() for c in planned)  # K and V
        return AttentionPlan(geometry, decode, b, num_rows, sorted_batch[0], planned, max_blocks * bs * hkv * d)

    def attend_planned(
        self,
        q: torch.Tensor,  # [T, Hq, D] packed query rows (T = B for a decode plan)
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        plan: AttentionPlan,  # from `plan` over a cache of the same geometry
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D] in q.dtype
        """Causal paged attention of every query row over its sequence's cache, as planned. Changes
        nothing outside the returned tensor (and the private gather workspace)."""
        check_cache_pair(k_cache, v_cache)
        check_rank("q", q, 3, "[T, Hq, D]")
        t, hq, d = q.shape
        nb, bs, hkv, _ = k_cache.shape
        check_dim("q", q, 2, k_cache.shape[3], "head dim of the cache")
        g = check_gqa(hq, hkv)
        if plan.geometry != (nb, bs, hkv, d, k_cache.dtype, k_cache.device):
            raise ValueError(f"the plan was made for a cache of (NB, BS, Hkv, D, dtype, device) {plan.geometry}, "
                             f"got {(nb, bs, hkv, d, k_cache.dtype, k_cache.device)}")
        check_dim("q", q, 0, plan.num_rows, "query rows of the plan")
        if not plan.chunks:  # no sequences or no query rows
            return torch.empty_like(q)
        workspace, locked = self._workspace.acquire(plan.workspace_numel, k_cache.dtype, q.device)
        try:
            kv_pair = _kv_pair(k_cache, v_cache)
            if plan.decode:
                return self._attend_decode(q, k_cache, v_cache, kv_pair, plan, scale, g, workspace)
            out = torch.empty_like(q)
            for c in plan.chunks:
                self._attend_prefill_chunk(q, k_cache, v_cache, kv_pair, c, scale, g, workspace, out)
            return out
        finally:
            if locked:
                self._workspace.release()

    def _attend_decode(
        self,
        q: torch.Tensor,  # [B, Hq, D]
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,
        kv_pair: torch.Tensor | None,  # [2*NB, BS, Hkv, D], see _kv_pair
        plan: AttentionPlan,
        scale: float,
        g: int,
        workspace: torch.Tensor,  # flat, >= plan.workspace_numel elements
    ) -> torch.Tensor:  # [B, Hq, D]
        """One query row per sequence. The G query heads of a KV head become G query rows against it,
        so the fused kernel reads each gathered K/V row once for all of them (one mask serves them all)."""
        b, hq, d = q.shape
        hkv = hq // g
        q_sorted = q.index_select(0, plan.order).float().view(b, hkv, g, d)  # [B, Hkv, G, D]

        def attend(c: _ChunkPlan, zero_padding: bool) -> torch.Tensor:  # [bk, Hkv, G, D]
            k, v = _gather(k_cache, v_cache, kv_pair, c, workspace)  # [bk, Hkv, S, D] each
            if zero_padding:
                _zero_padding(k, v, c)
            qc = q_sorted[c.start : c.stop]  # [bk, Hkv, G, D]
            return F.scaled_dot_product_attention(qc, k, v, attn_mask=c.mask, scale=scale)

        outs = [attend(c, False) for c in plan.chunks]
        o = torch.cat(outs) if len(outs) > 1 else outs[0]  # [B, Hkv, G, D] in sorted order
        if not math.isfinite(float(o.sum())):  # one reduction per layer; a false alarm costs the slow path
            for c in plan.chunks:
                oc = o[c.start : c.stop]
                if not math.isfinite(float(oc.sum())):
                    oc.copy_(attend(c, True))
        out = torch.empty_like(q)
        # SDPA hands back [bk, Hkv, G, D] as a transposed view; one copy puts every row in place
        out.index_copy_(0, plan.order, o.reshape(b, hq, d).to(out.dtype))
        return out

    def _attend_prefill_chunk(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,
        kv_pair: torch.Tensor | None,  # [2*NB, BS, Hkv, D], see _kv_pair
        c: _ChunkPlan,
        scale: float,
        g: int,
        workspace: torch.Tensor,  # flat, >= 2 * rows * BS * Hkv * D elements
        out: torch.Tensor,  # [T, Hq, D]; the chunk's query rows are written
    ) -> None:
        """Attention for one chunk of prefilling sequences; writes their rows of `out`."""
        assert c.q_rows is not None and c.out_rows is not None
        bk, (_, hq, d) = c.stop - c.start, q.shape
        k, v = _gather(k_cache, v_cache, kv_pair, c, workspace)  # [bk, Hkv, S, D] each
        qc = q.index_select(0, c.q_rows).float().view(bk, c.mq, hq, d).transpose(1, 2)  # [bk, Hq, Mq, D]

        def attend() -> torch.Tensor:  # [bk, Hq, Mq, D]
            # Every row of a sequence sees the same padded key range whatever chunk it came in, so a
            # prompt prefilled in pieces sums in the same order as in one piece. SDPA's fused CPU
            # kernel reads the G query heads of a KV head against it (enable_gqa): no per-head K/V copy.
            return F.scaled_dot_product_attention(qc, k, v, attn_mask=c.mask, scale=scale, enable_gqa=g > 1)

        o = attend()
        if not math.isfinite(float(o.sum())):  # one reduction; a false alarm only costs the slow path
            _zero_padding(k, v, c)
            o = attend()
        oc = o.transpose(1, 2).reshape(bk * c.mq, hq, d)  # [bk*Mq, Hq, D]
        if c.valid_rows is not None:  # drop the padding rows
            oc = oc.index_select(0, c.valid_rows)
        out.index_copy_(0, c.out_rows, oc.to(out.dtype))

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
            raise ValueError(f"out dtype {out.dtype} must equal the KV cache dtype {kv_cache.dtype}")
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
        fp8_as_bytes(dst).index_copy_(dim, block_ids.long(), fp8_as_bytes(buffer.to(dst.dtype)))
