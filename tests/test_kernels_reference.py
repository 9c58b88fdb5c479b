"""The float32 references checked against torch's own attention and plain indexing, so that the kernels'
yardstick is itself independent and right."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import reference as ref
from pdserve.kernels.testing import make_paged_problem


def _sdpa_over_context(
    q: torch.Tensor,  # [M, Hq, D] queries at the last M positions of the context
    k: torch.Tensor,  # [S, Hkv, D]
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [M, Hq, D] float64
    group = q.shape[1] // k.shape[1]
    m, s = q.shape[0], k.shape[0]
    # bottom-right aligned causal mask: query i sits at position s - m + i
    allowed = torch.arange(s)[None, :] <= (s - m + torch.arange(m))[:, None]  # [M, S]
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        k.double().repeat_interleave(group, dim=1).transpose(0, 1),
        v.double().repeat_interleave(group, dim=1).transpose(0, 1),
        attn_mask=allowed,
        scale=scale,
    )  # [Hq, M, D]
    return out.transpose(0, 1)


def _contiguous_context(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    # A different way to read a context than reference.gather_context: whole blocks, then trim.
    return cache[table.long()].flatten(0, 1)[:n]  # [n, H, D]


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reference_matches_sdpa(hq: int, hkv: int, dtype: torch.dtype) -> None:
    p = make_paged_problem([1, 16, 29, 40], hq, hkv, 24, 8, dtype, seed=hq)
    out = ref.decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
    assert out.dtype == torch.float32
    for b, n in enumerate(p.context_lens.tolist()):
        k = _contiguous_context(p.k_cache, p.block_tables[b], n)
        v = _contiguous_context(p.v_cache, p.block_tables[b], n)
        expected = _sdpa_over_context(p.q[b : b + 1], k, v, p.scale)
        torch.testing.assert_close(out[b : b + 1].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (6, 3), (8, 2)])
def test_prefill_reference_matches_sdpa(hq: int, hkv: int) -> None:
    ctx, q_lens = [7, 20, 33, 1], [7, 5, 1, 1]
    p = make_paged_problem(ctx, hq, hkv, 16, 4, torch.float32, q_lens=q_lens, seed=hkv)
    out = ref.prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.cu_seqlens_q, p.context_lens,
                                p.scale)
    cu = p.cu_seqlens_q.tolist()
    for b, n in enumerate(ctx):
        k = _contiguous_context(p.k_cache, p.block_tables[b], n)
        v = _contiguous_context(p.v_cache, p.block_tables[b], n)
        expected = _sdpa_over_context(p.q[cu[b] : cu[b + 1]], k, v, p.scale)
        torch.testing.assert_close(out[cu[b] : cu[b + 1]].double(), expected, atol=1e-5, rtol=1e-5)


def test_gather_context_follows_the_block_table() -> None:
    cache = torch.arange(5 * 4, dtype=torch.float32).view(5, 4, 1, 1)  # slot value = its global slot
    table = torch.tensor([3, 0, 4])
    got = ref.gather_context(cache, table, 10).flatten().tolist()
    assert got == [12, 13, 14, 15, 0, 1, 2, 3, 16, 17]


def test_store_and_block_references() -> None:
    k_cache = torch.zeros(3, 2, 1, 2)
    v_cache = torch.zeros(3, 2, 1, 2)
    key = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]])
    ref.store_kv(key, -key, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache[2, 1, 0].tolist() == [1.0, 2.0] and k_cache[0, 0, 0].tolist() == [5.0, 6.0]
    assert v_cache[2, 1, 0].tolist() == [-1.0, -2.0]
    assert int((k_cache != 0).sum()) == 4  # the skipped token wrote nothing

    pool = torch.arange(2 * 2 * 4 * 3, dtype=torch.float32).view(2, 2, 4, 3, 1, 1)  # [L, 2, NB, BS, 1, 1]
    buf = ref.pack_blocks(pool, [2, 0])
    assert buf.shape == (2, 2, 2, 3, 1, 1)
    assert torch.equal(buf[1, 0, 0], pool[1, 0, 2]) and torch.equal(buf[0, 1, 1], pool[0, 1, 0])
    one = ref.pack_blocks(pool, [3], layer=1)
    assert one.shape == (2, 1, 3, 1, 1) and torch.equal(one[1, 0], pool[1, 1, 3])
    dst = torch.zeros(2, 2, 6, 3, 1, 1)
    ref.unpack_blocks(buf, dst, [5, 1])
    assert torch.equal(dst[:, :, 5], pool[:, :, 2]) and torch.equal(dst[:, :, 1], pool[:, :, 0])
    assert int(dst[:, :, [0, 2, 3, 4]].abs().sum()) == 0
