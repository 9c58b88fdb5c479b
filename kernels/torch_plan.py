"""The attention plan of the torch path (`TorchOps.plan`): everything about a batch's attention that does
not depend on the layer. The batch is sorted by (query rows, context length) and cut into chunks of
neighbours (`_plan_chunks`, plain ints); each chunk gets its gather indices and masks (`_plan_chunk`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


@dataclass(frozen=True)
class _ChunkPlan:
    """A chunk of the sorted batch with its layer-independent tensors."""

    start: int  # sequences [start, stop) of the sorted batch
    stop: int
    kv_ids: torch.Tensor  # [2*bk*MB] int64: the blocks to gather (padded tables point anywhere), then the
    #                       same + NB, their V blocks in a K-then-V view of an adjacent pair
    s_pad: int  # MB * BS key slots per sequence
    ctx: torch.Tensor  # [bk] int64 context lengths
    mask: torch.Tensor  # float32 additive (0 / -inf): decode [bk, 1, 1, S], prefill [bk, 1, Mq, S]
    mq: int  # query rows per sequence (padded); 1 for decode
    q_rows: torch.Tensor | None  # prefill: [bk*Mq] rows of q (padding rows repeat a real one)
    valid_rows: torch.Tensor | None  # prefill: [n] the real ones among those; None when all are
    out_rows: torch.Tensor | None  # prefill: [n] rows of the output they fill (q_rows[valid_rows])

    @property
    def ids(self) -> torch.Tensor:  # [bk*MB] int64, the K blocks alone
        return self.kv_ids[: self.kv_ids.numel() // 2]


@dataclass(frozen=True)
class AttentionPlan:
    """What `TorchOps.plan` works out once per batch for every layer (see there)."""

    geometry: tuple[int, int, int, int, torch.dtype, torch.device]  # (NB, BS, Hkv, D, dtype, device) of the cache
    decode: bool  # one query row per sequence, row b for sequence b
    num_seqs: int
    num_rows: int  # query rows T
    order: torch.Tensor  # [B] int64, sorted position -> sequence
    chunks: tuple[_ChunkPlan, ...]
    workspace_numel: int  # gather buffer elements the largest chunk needs (K and V)


def _plan_chunk(
    c: _Chunk,
    bs: int,
    kv_tables: torch.Tensor,  # [2, B, MB] int64, sorted: block ids, then block ids + NB
    q_start: torch.Tensor,  # [B] first query row, sorted
    q_lens: torch.Tensor | None,  # [B] query rows, sorted; None: one each (decode)
    ctx: torch.Tensor,  # [B] int64 context lengths, sorted
    kpos: torch.Tensor,  # [>= S] arange
    decode_mask: torch.Tensor | None,  # decode: [B, >= S] float32 additive, each sequence's own context
    num_rows: int,  # query rows T
) -> _ChunkPlan:
    dev = ctx.device
    mb = max(1, -(-c.kv_len // bs))
    s_pad = mb * bs
    kv_ids = kv_tables[:, c.start : c.stop, :mb].reshape(-1)  # [2*bk*mb]
    ctx_c = ctx[c.start : c.stop]
    q_rows, valid_rows, out_rows = None, None, None
    if q_lens is None:  # decode: one row per sequence, at its last position
        assert decode_mask is not None
        mask = decode_mask[c.start : c.stop, None, None, :s_pad]  # [bk, 1, 1, S], a view
    else:
        m_idx = torch.arange(c.q_len, device=dev)
        ql_c = q_lens[c.start : c.stop]
        row_valid = m_idx[None, :] < ql_c[:, None]  # [bk, Mq]
        rows = q_start[c.start : c.stop, None] + torch.where(row_valid, m_idx[None, :], 0)  # [bk, Mq]
        q_rows = rows.clamp_(max=num_rows - 1).reshape(-1)  # a sequence with no query rows points past the end
        out_rows = q_rows
        if not bool(row_valid.all()):
            valid_rows = row_valid.view(-1).nonzero().view(-1)
            out_rows = q_rows.index_select(0, valid_rows)
        qpos = (ctx_c - ql_c)[:, None] + m_idx[None, :]  # [bk, Mq]
        kp = kpos[:s_pad]
        # padding query rows sit past the context: keep them off the unwritten slots too
        allowed = ((kp[None, None, :] <= qpos[:, :, None]) & (kp[None, :] < ctx_c[:, None])[:, None, :])[:, None]
        # The float form of the mask is what SDPA would build from a boolean one on every call.
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=dev).masked_fill_(~allowed, float("-inf"))
    return _ChunkPlan(c.start, c.stop, kv_ids, s_pad, ctx_c, mask, c.q_len, q_rows, valid_rows, out_rows)


def sort_batch(
    context_lens: torch.Tensor,  # [B]
    cu_seqlens_q: torch.Tensor | None,  # [B + 1]; None: decode, query row b is sequence b
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]]:
    """The batch in chunking order: (order [B] sorted position -> sequence, sorted context lengths, sorted
    first query rows, sorted query row counts (None for decode), the same counts as ints)."""
    ctx_all = context_lens.long()
    if cu_seqlens_q is None:  # decode: sequence b owns query row b
        ctx_sorted, order = torch.sort(ctx_all, stable=True)
        return order, ctx_sorted, order, None, [1] * ctx_all.shape[0]
    cu = cu_seqlens_q.long()
    ql_all = cu[1:] - cu[:-1]
    # Sequences with similar query counts, then similar contexts, share a chunk (less padding).
    _, order = torch.sort(ql_all * (int(ctx_all.max()) + 1) + ctx_all, stable=True)
    ctx_sorted, ql_sorted = ctx_all.index_select(0, order), ql_all.index_select(0, order)
    start_sorted = cu[:-1].index_select(0, order)
    return order, ctx_sorted, start_sorted, ql_sorted, ql_sorted.tolist()


def plan_sorted_chunks(
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]; only its geometry is read
    block_tables: torch.Tensor,  # [B, MB]
    sorted_batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]],  # sort_batch
    num_rows: int,  # query rows T
    chunk_bytes: int,
    slack: float,
    floor_bytes: int,
) -> tuple[_ChunkPlan, ...]:
    """Cuts the sorted batch into chunks (`_plan_chunks`) and plans each: its gather indices and mask."""
    order, ctx_sorted, start_sorted, ql_sorted, ql_list = sorted_batch
    nb, bs, hkv, d = k_cache.shape
    dev = k_cache.device
    tables_sorted = block_tables.index_select(0, order).long()  # [B, MB]
    kv_tables = torch.stack((tables_sorted, tables_sorted + nb))  # [2, B, MB]
    chunks = _plan_chunks(ctx_sorted.tolist(), ql_list, hkv * d * k_cache.element_size(), chunk_bytes,
                          slack, floor_bytes)
    s_max = max(1, -(-max(c.kv_len for c in chunks) // bs)) * bs
    kpos = torch.arange(s_max, device=dev)
    decode_mask = None
    if ql_sorted is None:  # decode: every chunk's mask is a slice of one [B, S] table
        decode_mask = torch.zeros(order.shape[0], s_max, dtype=torch.float32, device=dev)
        decode_mask.masked_fill_(kpos[None, :] >= ctx_sorted[:, None], float("-inf"))
    return tuple(
        _plan_chunk(c, bs, kv_tables, start_sorted, ql_sorted, ctx_sorted, kpos, decode_mask, num_rows)
        for c in chunks
    )
