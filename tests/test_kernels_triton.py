"""Every Triton kernel against its float32 reference, run by Triton's CPU interpreter.

The interpreter is slow, so shapes are tiny and the parameters follow a pairwise covering design:
every pair of (block size, head dim, GQA ratio, dtype) values appears in some case, instead of the
full product. On a machine with CUDA these tests are skipped; bench/gpu_check.py covers compiled kernels.
"""

from __future__ import annotations

import importlib
import itertools
import os
import sys
from typing import NamedTuple

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines; the GPU check covers CUDA", allow_module_level=True)

# Must be set before the kernel modules are imported: triton.jit picks the interpreter at decoration time.
# It stays set: Triton also reads it lazily at the first launch (and on a CPU-only machine nothing else
# can run Triton kernels anyway).
os.environ["TRITON_INTERPRET"] = "1"
for _name in ("pdserve.kernels.triton_decode", "pdserve.kernels.triton_prefill", "pdserve.kernels.triton_cache", "pdserve.kernels.triton_blocks",
              "pdserve.kernels.triton_ops"):
    if _name in sys.modules:  # imported earlier in this process without the interpreter
        importlib.reload(sys.modules[_name])

from pdserve.kernels import get_kernel_ops  # noqa: E402
from pdserve.kernels import reference as ref  # noqa: E402
from pdserve.kernels.testing import make_paged_problem, tolerance  # noqa: E402
from pdserve.kernels.triton_blocks import pack_blocks, unpack_blocks  # noqa: E402
from pdserve.kernels.triton_cache import store_kv  # noqa: E402
from pdserve.kernels.triton_decode import paged_decode_attention  # noqa: E402
from pdserve.kernels.triton_ops import TritonOps, interpreter_active  # noqa: E402
from pdserve.kernels.triton_prefill import paged_prefill_attention  # noqa: E402

BLOCK_SIZES = (8, 16, 32)
HEAD_DIMS = (32, 64, 128, 80)  # 80: not a power of two, padded and masked inside the kernels
GQA_RATIOS = (1, 2, 4, 8)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Case(NamedTuple):
    block_size: int
    head_dim: int
    group: int
    dtype: torch.dtype
    splits: int  # split-KV count forced on decode (1 = direct write, >1 = partials + merge kernel)

    @property
    def kv_heads(self) -> int:
        return 2 if self.group <= 2 else 1  # keeps Hq <= 8: the interpreter runs one program per head

    def __str__(self) -> str:
        return f"bs{self.block_size}-d{self.head_dim}-g{self.group}-{str(self.dtype)[6:]}-s{self.splits}"


def pairwise_cases() -> list[Case]:
    """16 cases: all head-dim x GQA pairs; block size and dtype follow two orthogonal Latin squares
    mod 3, so every pair among the four factors is covered; the split path alternates so that both
    decode paths see every head dim and every GQA ratio."""
    cases = []
    for i, d in enumerate(HEAD_DIMS):
        for j, g in enumerate(GQA_RATIOS):
            cases.append(Case(BLOCK_SIZES[(i + j) % 3], d, g, DTYPES[(i + 2 * j) % 3], 1 if (i + j) % 2 else 3))
    return cases


CASES = pairwise_cases()


def test_cases_cover_every_pair() -> None:
    factors = [BLOCK_SIZES, HEAD_DIMS, GQA_RATIOS, DTYPES]
    for a, b in itertools.combinations(range(4), 2):
        seen = {(c[a], c[b]) for c in CASES}
        missing = set(itertools.product(factors[a], factors[b])) - seen
        assert not missing, f"factors {a},{b} miss {missing}"
    for factor in (1, 2):
        for value in factors[factor]:
            assert {c.splits for c in CASES if c[factor] == value} == {1, 3}


def _decode_lens(bs: int) -> list[int]:
    # length 1, one ending exactly on a block boundary, and ragged ones spanning several blocks
    return [1, 2 * bs, 3 * bs - 5, bs + 3]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_matches_reference(case: Case) -> None:
    p = make_paged_problem(_decode_lens(case.block_size), case.kv_heads * case.group, case.kv_heads,
                           case.head_dim, case.block_size, case.dtype, seed=CASES.index(case))
    out = paged_decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale,
                                 num_splits=case.splits, block_n=16)
    expected = ref.decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
    assert out.dtype == case.dtype and out.shape == p.q.shape
    torch.testing.assert_close(out.float(), expected, **tolerance(case.dtype))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_prefill_matches_reference(case: Case) -> None:
    bs = case.block_size
    # a whole prompt; a single new token after a cached prefix ending on a block boundary; a chunk after a
    # cached prefix that crosses block boundaries; a one-token prompt
    ctx = [bs + 3, 2 * bs, 3 * bs - 5, 1]
    q_lens = [bs + 3, 1, bs - 2, 1]
    p = make_paged_problem(ctx, case.kv_heads * case.group, case.kv_heads, case.head_dim, bs, case.dtype,
                           q_lens=q_lens, seed=CASES.index(case) + 100)
    out = paged_prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.cu_seqlens_q, p.context_lens,
                                  p.scale, block_m=16, block_n=32)
    expected = ref.prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.cu_seqlens_q,
                                     p.context_lens, p.scale)
    torch.testing.assert_close(out.float(), expected, **tolerance(case.dtype))


def test_prefill_with_an_idle_sequence() -> None:
    p = make_paged_problem([9, 30, 4], 4, 2, 32, 8, torch.float16, q_lens=[3, 0, 4], seed=13)
    out = paged_prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.cu_seqlens_q, p.context_lens,
                                  p.scale, block_m=16, block_n=16)
    expected = ref.prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.cu_seqlens_q, p.context_lens,
                                     p.scale)
    torch.testing.assert_close(out.float(), expected, **tolerance(torch.float16))


def test_decode_split_counts_agree() -> None:
    """Splits that start past short contexts are empty; the merge must weigh them 0."""
    p = make_paged_problem([1, 5, 70], 4, 2, 32, 8, torch.float32, seed=7)
    expected = ref.decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
    for splits in (1, 2, 5):
        out = paged_decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale,
                                     num_splits=splits, block_n=16)
        torch.testing.assert_close(out, expected, **tolerance(torch.float32))


@pytest.mark.parametrize(
    ("block_size", "head_dim", "kv_heads", "dtype", "key_dtype"),
    [
        (8, 32, 1, torch.float32, torch.float32),
        (16, 80, 2, torch.float16, torch.float32),
        (32, 64, 4, torch.bfloat16, torch.bfloat16),
        (16, 128, 8, torch.bfloat16, torch.float16),
    ],
)
def test_store_kv_matches_reference(block_size: int, head_dim: int, kv_heads: int, dtype: torch.dtype,
                                    key_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(block_size + head_dim)
    nb = 6
    k_cache = torch.randn(nb, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(nb, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    n = 9
    slots = torch.randperm(nb * block_size, generator=gen)[:n]
    slots[[2, 5]] = -1  # padding tokens are skipped
    key = torch.randn(n, kv_heads, head_dim, generator=gen).to(key_dtype)
    value = torch.randn(n, kv_heads, head_dim, generator=gen).to(key_dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    ref.store_kv(key, value, k_expected, v_expected, slots)
    store_kv(key, value, k_cache, v_cache, slots)
    if dtype == torch.bfloat16 and key_dtype != dtype:
        # The interpreter rounds float32 -> bfloat16 toward zero (GPUs round to nearest): one ulp apart.
        torch.testing.assert_close(k_cache, k_expected, atol=0.0, rtol=2.0**-7)
        torch.testing.assert_close(v_cache, v_expected, atol=0.0, rtol=2.0**-7)
    else:
        assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


def _pool(layers: int, nb: int, bs: int, heads: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, nb, bs, heads, d, generator=gen).to(dtype)  # [L, 2, NB, BS, Hkv, D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", [None, 1])
def test_pack_unpack_round_trip(dtype: torch.dtype, layer: int | None) -> None:
    src = _pool(3, 9, 8, 2, 40, dtype, seed=1)
    dst = _pool(3, 13, 8, 2, 40, dtype, seed=2)
    src_ids = torch.tensor([7, 0, 4, 8])
    dst_ids = torch.tensor([12, 3, 9, 1])
    buf = pack_blocks(src, src_ids, layer)
    assert torch.equal(buf, ref.pack_blocks(src, src_ids.tolist(), layer))
    untouched = dst.clone()
    unpack_blocks(buf, dst, dst_ids, layer)
    layers = slice(None) if layer is None else slice(layer, layer + 1)
    assert torch.equal(dst[layers][:, :, dst_ids], src[layers][:, :, src_ids])
    expected = untouched.clone()
    ref.unpack_blocks(buf, expected, dst_ids.tolist(), layer)
    assert torch.equal(dst, expected)  # nothing outside the target blocks moved
    assert torch.equal(pack_blocks(dst, dst_ids, layer), buf)


def test_pack_into_given_buffer_and_errors() -> None:
    src = _pool(2, 5, 16, 1, 32, torch.float16, seed=3)
    ids = torch.tensor([4, 2])
    out = torch.empty(2, 2, 2, 16, 1, 32, dtype=torch.float16)
    assert pack_blocks(src, ids, out=out) is out
    assert torch.equal(out, ref.pack_blocks(src, [4, 2]))
    with pytest.raises(ValueError, match="wire-format shape"):
        pack_blocks(src, ids, out=torch.empty(2, 2, 3, 16, 1, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="block_ids must lie in"):
        pack_blocks(src, torch.tensor([5]))
    with pytest.raises(ValueError, match="layer must be"):
        pack_blocks(src, ids, layer=2)


def test_wrappers_reject_bad_arguments() -> None:
    p = make_paged_problem([5, 9], 4, 2, 32, 8, torch.float32, seed=4)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_decode_attention(p.q[:, :3], p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
    with pytest.raises(ValueError, match="block_tables must have dtype"):
        paged_decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables.float(), p.context_lens, p.scale)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        paged_decode_attention(p.q.transpose(1, 2).contiguous().transpose(1, 2), p.k_cache, p.v_cache,
                               p.block_tables, p.context_lens, p.scale)
    with pytest.raises(ValueError, match="cu_seqlens_q.shape"):
        paged_prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.cu_seqlens_q[:2],
                                p.context_lens, p.scale)
    with pytest.raises(ValueError, match="dtypes differ"):
        store_kv(p.q[:, :2], p.q[:, :2], p.k_cache, p.v_cache.half(), torch.tensor([0, 1]))


def test_triton_ops_through_dispatch() -> None:
    """get_kernel_ops('triton') on CPU gives the interpreted kernels, and the engine's interface reaches them."""
    assert interpreter_active()
    ops = get_kernel_ops("triton", "cpu")
    assert isinstance(ops, TritonOps)
    p = make_paged_problem([3, 17], 4, 2, 32, 8, torch.bfloat16, q_lens=[3, 6], seed=5)
    out = ops.prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.cu_seqlens_q, p.context_lens, p.scale)
    expected = ref.prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.cu_seqlens_q, p.context_lens,
                                     p.scale)
    torch.testing.assert_close(out.float(), expected, **tolerance(torch.bfloat16))
    last = p.cu_seqlens_q[1:].long() - 1
    dec = ops.decode_attention(p.q[last].contiguous(), p.k_cache, p.v_cache, p.block_tables, p.context_lens,
                               p.scale)
    torch.testing.assert_close(dec.float(), expected[last], **tolerance(torch.bfloat16))
