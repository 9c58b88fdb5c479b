"""The vectorized torch path (what CPU nodes run) against the float32 references, plus dispatch."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kernels import get_kernel_ops
from pdserve.kernels import reference as ref
from pdserve.kernels.testing import make_paged_problem, tolerance
from pdserve.kernels.torch_ops import TorchOps, _plan_chunks

ROOT = Path(__file__).resolve().parents[1]

# Default chunking, and a tiny budget that forces a chunk per sequence or two.
OPS = {"default": TorchOps(), "tiny-chunks": TorchOps(chunk_bytes=1 << 10)}
SHAPES = [(bs, d, g, hkv) for bs, d, (g, hkv) in itertools.product((8, 16, 32), (32, 64, 128, 80),
                                                                   ((1, 2), (2, 2), (4, 1), (8, 2), (3, 2)))]


def _lens(bs: int) -> list[int]:
    return [1, 2 * bs, 3 * bs - 5, bs + 3, 5 * bs + 1, 7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("bs", "d", "g", "hkv"), SHAPES[::3])
def test_decode_matches_reference(dtype: torch.dtype, bs: int, d: int, g: int, hkv: int) -> None:
    # Unused slots hold NaN (the recovery path) or finite noise (the fast path), alternately.
    p = make_paged_problem(_lens(bs), hkv * g, hkv, d, bs, dtype, seed=bs * d + g, poison_unused=bs != 16)
    expected = ref.decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
    for ops in OPS.values():
        out = ops.decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
        assert out.dtype == dtype and out.shape == p.q.shape
        torch.testing.assert_close(out.float(), expected, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bs", "d", "g", "hkv"), SHAPES[1::4])
def test_prefill_matches_reference(dtype: torch.dtype, bs: int, d: int, g: int, hkv: int) -> None:
    ctx = [bs + 3, 2 * bs, 3 * bs - 5, 1, 4 * bs]
    q_lens = [bs + 3, 1, bs - 2, 1, 2 * bs]  # whole prompts, cached prefixes, chunks crossing blocks
    p = make_paged_problem(ctx, hkv * g, hkv, d, bs, dtype, q_lens=q_lens, seed=bs + d + g, poison_unused=d != 64)
    expected = ref.prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.cu_seqlens_q,
                                     p.context_lens, p.scale)
    for ops in OPS.values():
        out = ops.prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.cu_seqlens_q, p.context_lens,
                                    p.scale)
        torch.testing.assert_close(out.float(), expected, **tolerance(dtype))


@pytest.mark.parametrize("fp8", [torch.float8_e5m2, torch.float8_e4m3fn])
@pytest.mark.parametrize(("bs", "d", "g", "hkv"), SHAPES[2::7])
def test_fp8_pool_matches_the_dequantized_reference(fp8: torch.dtype, bs: int, d: int, g: int, hkv: int) -> None:
    """Decode and prefill over an fp8 pool: the reference widens the same fp8 values, so only float32
    summation noise separates them (the fp8 rounding itself is in both)."""
    ctx = [bs + 3, 2 * bs, 3 * bs - 5, 1, 4 * bs]
    q_lens = [bs + 3, 1, bs - 2, 1, 2 * bs]
    for lens in (None, q_lens):
        p = make_paged_problem(ctx, hkv * g, hkv, d, bs, torch.float32, q_lens=lens, seed=bs + d + g,
                               poison_unused=d != 64)
        k8, v8 = p.k_cache.to(fp8), p.v_cache.to(fp8)
        for ops in OPS.values():
            if lens is None:
                expected = ref.decode_attention(p.q, k8, v8, p.block_tables, p.context_lens, p.scale)
                out = ops.decode_attention(p.q, k8, v8, p.block_tables, p.context_lens, p.scale)
            else:
                expected = ref.prefill_attention(p.q, k8, v8, p.block_tables, p.cu_seqlens_q, p.context_lens,
                                                 p.scale)
                out = ops.prefill_attention(p.q, k8, v8, p.block_tables, p.cu_seqlens_q, p.context_lens, p.scale)
            torch.testing.assert_close(out, expected, **tolerance(torch.float32))


def test_prefill_with_an_idle_sequence() -> None:
    """A sequence with no new tokens (cu_seqlens repeats) contributes no rows and disturbs none."""
    p = make_paged_problem([9, 30, 4], 4, 2, 32, 8, torch.float32, q_lens=[3, 0, 4], seed=13)
    expected = ref.prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.cu_seqlens_q, p.context_lens,
                                     p.scale)
    for ops in OPS.values():
        out = ops.prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.cu_seqlens_q, p.context_lens,
                                    p.scale)
        torch.testing.assert_close(out, expected, **tolerance(torch.float32))


def test_decode_batch_order_and_duplicates() -> None:
    """Sorting by length must not reorder outputs; equal lengths and one shared table are fine."""
    p = make_paged_problem([9, 9, 40, 2, 40, 17], 4, 2, 32, 8, torch.float32, seed=11)
    tables = p.block_tables.clone()
    tables[1] = tables[0]  # two sequences reading the same blocks
    expected = ref.decode_attention(p.q, p.k_cache, p.v_cache, tables, p.context_lens, p.scale)
    for ops in OPS.values():
        out = ops.decode_attention(p.q, p.k_cache, p.v_cache, tables, p.context_lens, p.scale)
        torch.testing.assert_close(out, expected, **tolerance(torch.float32))


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -float("inf"), 3e38])
def test_unused_slots_never_leak(garbage: float) -> None:
    """Whatever unused slots hold, outputs are those of the written tokens; padded tables point at
    unused blocks too."""
    p = make_paged_problem([3, 12, 16], 2, 1, 16, 8, torch.float32, seed=12, spare_blocks=4)
    unused = torch.isnan(p.k_cache)
    assert unused.any()
    p.k_cache[unused] = garbage
    p.v_cache[unused] = garbage
    p.block_tables[0, 1:] = int(unused.flatten(1).all(1).nonzero()[0])  # padding ids name an unused block
    expected = ref.decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
    out = OPS["default"].decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))


def test_plan_chunks_bounds_padding_and_bytes() -> None:
    # decode: a chunk holds neighbours whose padding stays within 25% (3 x 31 <= 1.25 x 81), and the
    # chunks tile the batch in order
    chunks = _plan_chunks([1, 5, 9, 20, 30, 31, 40], [1] * 7, row_bytes=1, chunk_bytes=1 << 20, floor_bytes=0)
    assert [(c.start, c.stop, c.kv_len, c.q_len) for c in chunks] == [
        (0, 1, 1, 1), (1, 2, 5, 1), (2, 3, 9, 1), (3, 6, 31, 1), (6, 7, 40, 1)]
    # the byte budget splits equal lengths too
    chunks = _plan_chunks([10] * 6, [1] * 6, row_bytes=100, chunk_bytes=2_000)
    assert [(c.start, c.stop) for c in chunks] == [(0, 2), (2, 4), (4, 6)]
    # prefill: single-token rows group apart from a long chunk of queries
    chunks = _plan_chunks([50, 60, 70, 300], [1, 1, 1, 200], row_bytes=1, chunk_bytes=1 << 20, floor_bytes=0)
    assert [(c.start, c.stop, c.kv_len, c.q_len) for c in chunks] == [(0, 3, 70, 1), (3, 4, 300, 200)]
    # padding too small to be worth another chunk stays
    assert len(_plan_chunks([1, 5, 9, 20, 30, 31, 40], [1] * 7, row_bytes=512, chunk_bytes=1 << 20)) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2, torch.float8_e4m3fn])
def test_store_kv_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(5, 8, 2, 40, generator=gen).to(dtype)
    v_cache = torch.randn(5, 8, 2, 40, generator=gen).to(dtype)
    slots = torch.tensor([33, -1, 0, 7, 39, -1])
    key = torch.randn(6, 2, 40, generator=gen)
    value = torch.randn(6, 2, 40, generator=gen)
    key[0, 0, :2] = torch.tensor([1e4, -1e4])  # beyond e4m3's +-448: saturates, never NaN
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    ref.store_kv(key, value, k_expected, v_expected, slots)
    TorchOps().store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    assert not k_cache.float().isnan().any()


@pytest.mark.parametrize("layer", [None, 0, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e5m2, torch.float8_e4m3fn])
def test_pack_unpack_round_trip(layer: int | None, dtype: torch.dtype) -> None:
    ops = TorchOps()
    gen = torch.Generator().manual_seed(5)
    src = torch.randn(3, 2, 10, 16, 2, 32, generator=gen).to(dtype)  # [L, 2, NB, BS, Hkv, D]
    dst = torch.randn(3, 2, 6, 16, 2, 32, generator=gen).to(dtype)  # a smaller pool, other ids
    src_ids, dst_ids = torch.tensor([9, 2, 5]), torch.tensor([0, 4, 3])
    buf = ops.pack_blocks(src, src_ids, layer)
    assert torch.equal(buf, ref.pack_blocks(src, src_ids.tolist(), layer))
    expected = dst.clone()
    ref.unpack_blocks(buf, expected, dst_ids.tolist(), layer)
    ops.unpack_blocks(buf, dst, dst_ids, layer)
    assert torch.equal(dst, expected)
    assert torch.equal(ops.pack_blocks(dst, dst_ids, layer), buf)
    out = torch.empty_like(buf)
    assert ops.pack_blocks(src, src_ids, layer, out=out) is out and torch.equal(out, buf)


def test_dispatch() -> None:
    # auto on CPU is the C++ decode kernel where it builds (tests/test_kernels_cpu.py), else this path
    assert get_kernel_ops("auto", "cpu").name in ("cpu", "torch")
    assert get_kernel_ops("torch", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match="must be one of"):
        get_kernel_ops("cuda-magic")


def test_triton_unavailable_gives_a_clear_error() -> None:
    """Without CUDA and without the interpreter, asking for Triton fails loudly (fresh process, so that
    the interpreter switch of other test modules does not apply)."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "from pdserve.kernels import get_kernel_ops\n"
        "for dev in ('cpu', 'cuda'):\n"
        "    try:\n"
        "        get_kernel_ops('triton', dev)\n"
        "    except RuntimeError as e:\n"
        "        print('ERR', e)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("ERR")]
    assert len(lines) == 2, res.stdout + res.stderr
    assert all("needs a usable CUDA device" in ln or "unavailable" in ln for ln in lines)
