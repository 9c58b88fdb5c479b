"""The C++ CPU decode kernel (`kernels.cpu_ops`) against the float32 references: shuffled block tables,
ragged lengths (1, block boundaries, long), every head dim path (64 and 128 in AVX-512 registers, others
in the portable loop), GQA groups, KV cache dtypes, and context splits merged by log-sum-exp."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.kernels import get_kernel_ops
from pdserve.kernels import reference as ref
from pdserve.kernels.cpu_ops import CpuOps, DecodePlan, ExtensionUnavailable, load_extension
from pdserve.kernels.testing import make_paged_problem, tolerance

try:
    load_extension()
except ExtensionUnavailable as e:  # pragma: no cover - a machine without a C++ toolchain
    pytest.skip(f"CPU extension unavailable: {e}", allow_module_level=True)

OPS = CpuOps.create()
SHAPES = list(itertools.product((8, 16, 32), (64, 128, 80, 32), ((1, 2), (3, 3), (4, 1), (8, 2))))


def _lens(bs: int) -> list[int]:
    return [1, 2 * bs, 3 * bs - 5, bs + 3, 11 * bs + 1, 7, bs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("bs", "d", "gh"), SHAPES[::2])
def test_decode_matches_reference(dtype: torch.dtype, bs: int, d: int, gh: tuple[int, int]) -> None:
    g, hkv = gh
    # Unused slots are NaN: the kernel must never read past a context.
    p = make_paged_problem(_lens(bs), hkv * g, hkv, d, bs, dtype, seed=bs * d + g, poison_unused=True)
    expected = ref.decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
    out = OPS.decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
    assert out.dtype == dtype and out.shape == p.q.shape
    torch.testing.assert_close(out.float(), expected, **tolerance(dtype))


@pytest.mark.parametrize("splits", [1, 2, 5, 64])
@pytest.mark.parametrize("d", [64, 80])
def test_context_splits_merge_exactly(splits: int, d: int) -> None:
    """Any split count (more splits than blocks included) gives the reference result."""
    p = make_paged_problem([1, 40, 129, 300], 6, 2, d, 16, torch.float32, seed=splits + d)
    expected = ref.decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
    out = OPS._ext.paged_decode(p.q.contiguous(), p.k_cache, p.v_cache, p.block_tables, p.context_lens,
                                p.scale, splits)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))


def test_plan_splits_few_long_sequences_only() -> None:
    p = make_paged_problem([2000], 9, 3, 64, 16, torch.bfloat16, seed=1)
    plan = OPS.plan(p.q, p.k_cache, p.block_tables, p.context_lens)
    assert isinstance(plan, DecodePlan) and plan.splits > 1
    out = OPS.attend_planned(p.q, p.k_cache, p.v_cache, plan, p.scale)
    expected = ref.decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
    torch.testing.assert_close(out.float(), expected, **tolerance(torch.bfloat16))
    many = make_paged_problem([20] * 64, 9, 3, 64, 16, torch.bfloat16, seed=2)
    assert OPS.plan(many.q, many.k_cache, many.block_tables, many.context_lens).splits == 1


def test_prefill_goes_through_the_torch_path() -> None:
    p = make_paged_problem([9, 30, 4], 4, 2, 32, 8, torch.float32, q_lens=[3, 30, 4], seed=13)
    expected = ref.prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.cu_seqlens_q, p.context_lens,
                                     p.scale)
    out = OPS.prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.cu_seqlens_q, p.context_lens, p.scale)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))


def test_empty_batch_and_bad_inputs() -> None:
    p = make_paged_problem([5], 4, 2, 64, 16, torch.float32, seed=3)
    empty = OPS.decode_attention(p.q[:0], p.k_cache, p.v_cache, p.block_tables[:0], p.context_lens[:0], p.scale)
    assert empty.shape == (0, 4, 64)
    with pytest.raises(ValueError):
        OPS.decode_attention(p.q[:, :3], p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
    plan = OPS.plan(p.q, p.k_cache, p.block_tables, p.context_lens)
    with pytest.raises(ValueError, match="plan was made"):
        OPS.attend_planned(p.q, p.k_cache.to(torch.bfloat16), p.v_cache.to(torch.bfloat16), plan, p.scale)


def test_auto_backend_on_cpu_is_the_extension() -> None:
    assert get_kernel_ops().name == "cpu"
    assert get_kernel_ops("cpu", "cpu").name == "cpu"
    assert get_kernel_ops("torch").name == "torch"


def test_a_builder_killed_mid_build_does_not_block_later_starts() -> None:
    """Injects torch's build lock as a SIGKILLed builder leaves it: a new process still loads the
    extension (the build is guarded by an flock the kernel released with the dead builder)."""
    import subprocess
    import sys

    from pdserve.kernels.cpu_ops import extension_dir

    builds = [p for p in extension_dir().glob("pdserve_cpu_attention_*") if (p / "build.ninja").exists()]
    assert builds, "the module loaded the extension above"
    for build in builds:
        (build / "lock").touch()
    code = "from pdserve.kernels.cpu_ops import load_extension; load_extension(); print('loaded')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "loaded", out.stderr[-2000:]


FP8 = [torch.float8_e5m2, torch.float8_e4m3fn]


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bs", "d", "gh"), SHAPES[1::2])
def test_fp8_decode_matches_the_dequantized_reference(fp8: torch.dtype, q_dtype: torch.dtype, bs: int, d: int,
                                                      gh: tuple[int, int]) -> None:
    """An fp8 KV cache (AVX-512 rows for D 64/128, the portable loop for 80/32): the reference reads the same
    fp8 values widened exactly by torch, so the kernel must match it to float32 noise; against the unrounded
    float32 pool it differs only by fp8 rounding (up to 12.5% per element for e5m2, 6.25% for e4m3)."""
    g, hkv = gh
    p = make_paged_problem(_lens(bs), hkv * g, hkv, d, bs, torch.float32, seed=bs * d + g + 7, poison_unused=True)
    # unowned slots: NaN (e5m2), or +-448 (e4m3fn saturates): huge scores if read
    k8, v8 = p.k_cache.nan_to_num(1e6).to(fp8), p.v_cache.nan_to_num(1e6).to(fp8)
    q = p.q.to(q_dtype)
    expected = ref.decode_attention(q, k8, v8, p.block_tables, p.context_lens, p.scale)
    out = OPS.decode_attention(q, k8, v8, p.block_tables, p.context_lens, p.scale)
    assert out.dtype == q_dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected, **tolerance(q_dtype))
    unrounded = ref.decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
    err = (out.float() - unrounded).abs().max().item()
    # a 1-token context returns its V row: error up to 1/8 of |v| (plus bf16 q rounding through the weights)
    assert 0 < err < 0.2 * float(p.v_cache.nan_to_num().abs().max()), err


@pytest.mark.parametrize("fp8", FP8)
def test_fp8_splits_merge_exactly(fp8: torch.dtype) -> None:
    p = make_paged_problem([1, 40, 129, 300], 6, 2, 64, 16, torch.float32, seed=5)
    k8, v8 = p.k_cache.to(fp8), p.v_cache.to(fp8)
    expected = ref.decode_attention(p.q, k8, v8, p.block_tables, p.context_lens, p.scale)
    for splits in (1, 3, 64):
        out = OPS._ext.paged_decode(p.q.contiguous(), k8, v8, p.block_tables, p.context_lens, p.scale, splits)
        torch.testing.assert_close(out, expected, **tolerance(torch.float32))


def test_e4m3_widening_is_exact_for_every_byte() -> None:
    """All 255 non-NaN e4m3fn bytes (subnormals, +-0, +-448) and every e5m2 byte but NaN/inf, as a 1-token
    context whose V row is the byte pattern: the kernel returns that row exactly as torch widens it."""
    for fp8 in FP8:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()  # [256]
        codes = codes[codes.isfinite()]
        d = 64
        rows = torch.nn.functional.pad(codes, (0, -codes.numel() % d)).view(-1, 1, 1, d)  # [R, 1, 1, D]
        v = rows.to(fp8)
        k = torch.zeros_like(rows).to(fp8)
        tables = torch.arange(rows.shape[0], dtype=torch.int32)[:, None]
        lens = torch.ones(rows.shape[0], dtype=torch.int32)
        q = torch.randn(rows.shape[0], 1, d)
        out = OPS.decode_attention(q, k, v, tables, lens, 0.125)
        assert torch.equal(out, rows.view(-1, 1, d)), fp8


# The bfloat16/fp8 path (AVX512-BF16 builds, head dims 64 and 128): an item covers every KV head of its
# sequence once a batch has at least 4 items per thread, else one KV head; both are checked.
BF16_PATH_DTYPES = [torch.bfloat16, torch.float8_e5m2, torch.float8_e4m3fn]


def _pool_problem(lens: list[int], g: int, hkv: int, d: int, bs: int, dtype: torch.dtype, q_dtype: torch.dtype,
                  seed: int, q_gain: float = 1.0):
    p = make_paged_problem(lens, hkv * g, hkv, d, bs, torch.float32, seed=seed, poison_unused=True)
    if dtype == torch.bfloat16:
        k, v = p.k_cache.to(dtype), p.v_cache.to(dtype)
    else:  # unowned slots: NaN (e5m2), or +-448 (e4m3fn saturates): huge scores if read
        k, v = p.k_cache.nan_to_num(1e6).to(dtype), p.v_cache.nan_to_num(1e6).to(dtype)
    return (p.q * q_gain).to(q_dtype), k, v, p


@pytest.mark.parametrize("dtype", BF16_PATH_DTYPES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bs", "d", "g"), [(16, 64, 3), (16, 128, 3), (8, 64, 1), (32, 64, 2), (16, 64, 4),
                                            (32, 128, 8), (16, 128, 5)])
@pytest.mark.parametrize("batch", ["few", "many"])
def test_bf16_path_matches_reference(dtype: torch.dtype, q_dtype: torch.dtype, bs: int, d: int, g: int,
                                     batch: str) -> None:
    """Ragged lengths with tails of every size below 16 (1, 5, 15, 17, 31, ...), shuffled tables, NaN or
    saturated unowned slots; "many" has enough sequences for items of all KV heads, "few" for one each.
    A float32 q takes the path's second (low) bfloat16 part of q, a bfloat16 q does not need it."""
    hkv = 2
    lens = [1, 5, 15, 16, 17, 31, 33, 2 * bs + 7, 100, 257]
    if batch == "many":
        lens = lens * (1 + 4 * torch.get_num_threads() // len(lens))
    q, k, v, p = _pool_problem(lens, g, hkv, d, bs, dtype, q_dtype, seed=bs + d + g)
    expected = ref.decode_attention(q, k, v, p.block_tables, p.context_lens, p.scale)
    out = OPS.decode_attention(q, k, v, p.block_tables, p.context_lens, p.scale)
    torch.testing.assert_close(out.float(), expected, **tolerance(q_dtype))


@pytest.mark.parametrize("dtype", BF16_PATH_DTYPES)
def test_bf16_path_wide_score_range(dtype: torch.dtype) -> None:
    """q scaled up 12x: scores spread over +-50, so the running max is raised (and what was accumulated
    rescaled) again and again along a sequence, and most tokens' weights underflow to 0. Scores that
    large carry float32 rounding of ~1e-5 in any summation order, hence the looser tolerance; a wrong
    rescale would be off by factors up to e^8."""
    lens = [700, 513, 64, 3] * (1 + torch.get_num_threads())
    q, k, v, p = _pool_problem(lens, 3, 3, 64, 16, dtype, torch.float32, seed=11, q_gain=12.0)
    expected = ref.decode_attention(q, k, v, p.block_tables, p.context_lens, p.scale)
    out = OPS.decode_attention(q, k, v, p.block_tables, p.context_lens, p.scale)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", BF16_PATH_DTYPES)
@pytest.mark.parametrize("splits", [2, 7])
def test_bf16_path_splits_merge(dtype: torch.dtype, splits: int) -> None:
    """Context splits (each item a share of the blocks) merged by log-sum-exp, for both item shapes."""
    for lens in ([1, 40, 129, 300], [1, 40, 129, 300] * (2 * torch.get_num_threads())):
        q, k, v, p = _pool_problem(lens, 3, 3, 64, 16, dtype, torch.float32, seed=splits)
        expected = ref.decode_attention(q, k, v, p.block_tables, p.context_lens, p.scale)
        out = OPS._ext.paged_decode(q.contiguous(), k, v, p.block_tables, p.context_lens, p.scale, splits)
        torch.testing.assert_close(out, expected, **tolerance(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, *FP8])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv_matches_reference(dtype: torch.dtype, slot_dtype: torch.dtype) -> None:
    """The extension's store writes exactly the reference's rows: shuffled slots, skipped -1 slots, K/V
    as strided views of a fused projection (as the model passes them), fp8 rounded as torch rounds."""
    gen = torch.Generator().manual_seed(5)
    nb, bs, h, d, n = 7, 16, 3, 64, 40
    ops = CpuOps.create()
    k_cache = torch.randn(nb, bs, h, d, generator=gen).to(dtype)
    v_cache = torch.randn(nb, bs, h, d, generator=gen).to(dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:n]
    slots[[3, 17, 31]] = -1
    qkv = torch.randn(n, (9 + 2 * h) * d, generator=gen) * 3  # [N, (Hq + 2 Hkv) D]
    qkv[0, 9 * d] = 1e4  # beyond e4m3's +-448: saturates, never NaN
    src_dtype = torch.bfloat16 if dtype.is_floating_point and dtype.itemsize == 1 else dtype
    qkv = qkv.to(src_dtype)
    key = qkv[:, 9 * d : (9 + h) * d].view(n, h, d)  # strided rows, as split from the fused projection
    value = qkv[:, (9 + h) * d :].view(n, h, d)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    ref.store_kv(key, value, k_expected, v_expected, slots)
    ops.store_kv(key, value, k_cache, v_cache, slots.to(slot_dtype))
    bits = (lambda t: t.view(torch.uint8)) if dtype.itemsize == 1 else (lambda t: t)
    assert torch.equal(bits(k_cache), bits(k_expected)) and torch.equal(bits(v_cache), bits(v_expected))
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        ops.store_kv(key[:1], value[:1], k_cache, v_cache, torch.tensor([nb * bs]))


# The small per-step ops (KernelOps.rotary / argmax / topk): the same bits as the torch definitions;
# rms_norm the same bits; silu_mul float32 the same bits, half precision apart in rare elements.
TORCH_OPS = get_kernel_ops("torch", "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_gives_the_torch_bits(dtype: torch.dtype) -> None:
    """q and k heads as strided views of a fused projection (as the model passes them), ragged head counts
    and dims, [T, 1, D] tables; float16 goes through torch."""
    gen = torch.Generator().manual_seed(9)
    for t, h, d in ((32, 12, 64), (7, 5, 128), (1, 3, 64), (100, 15, 32), (3, 2, 10)):
        qkv = (torch.randn(t, h + 3, d, generator=gen) * 4).to(dtype)  # [T, H + Hkv, D]
        x = qkv[:, :h]
        cos = torch.randn(t, 1, d, generator=gen).to(dtype)
        sin = torch.randn(t, 1, d, generator=gen).to(dtype)
        out = OPS.rotary(x, cos, sin)
        assert out.dtype == dtype and out.is_contiguous()
        assert torch.equal(out, TORCH_OPS.rotary(x, cos, sin)), (t, h, d)


def test_argmax_gives_torch_indices() -> None:
    """Random rows, bf16-rounded rows full of ties, all -inf, NaN (the first NaN wins), widths that are not a
    multiple of the vector width."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(32, 49152, generator=gen) * 5
    rows = [x, x.bfloat16().float(), torch.full((3, 100), -float("inf")), torch.randn(5, 17, generator=gen),
            torch.tensor([[1.0, float("nan"), 3.0, float("nan")], [2.0, 2.0, 1.0, 2.0]]), torch.zeros(1, 1)]
    for t in rows:
        assert torch.equal(OPS.argmax(t), t.argmax(-1))


def test_topk_gives_torch_values_and_the_lowest_index_of_ties() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(32, 49152, generator=gen) * 5
    for t in (x, x.bfloat16().float(), torch.randn(3, 17, generator=gen)):
        values, indices = OPS.topk(t, 16)
        assert torch.equal(values, t.topk(16, dim=-1).values)
        assert torch.equal(t.gather(1, indices), values)
    values, indices = OPS.topk(x, 16)
    assert torch.equal(indices, x.topk(16, dim=-1).indices)  # no ties: the same indices
    row = torch.tensor([[0.0, 5.0, 1.0, 1.0, 1.0, 5.0, 1.0]])
    assert OPS.topk(row, 4)[1].tolist() == [[1, 5, 2, 3]]  # equal values: lower index first, and kept
    nan = torch.tensor([[1.0, float("nan"), 3.0]])  # torch ranks NaN first; such rows go to torch.topk
    assert OPS.topk(nan, 2)[1].tolist() == nan.topk(2, dim=-1).indices.tolist()


def _rarely_apart(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Half-precision results of another float32 rounding upstream (silu's e^x): under 1% of the elements
    differ, each by at most two ulps of its dtype (one rounding step moved, then scaled by a second op)."""
    diff = (out.float() - expected.float()).abs()
    assert float((diff > 0).float().mean()) < 0.01, int((diff > 0).sum())
    assert bool((diff <= 2 * torch.finfo(out.dtype).eps * expected.float().abs()).all()), float(diff.max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_with_add_matches_the_torch_ops(dtype: torch.dtype) -> None:
    """The same bits as the torch ops: the residual add (x changed in place as torch's add_ changes it) and
    the normed rows (the sum of squares in torch's order, see CpuOps._torch_sum_lanes).
    Ragged widths, a strided x (a view of a wider buffer), adds in float32 and in the weights' dtype, and
    rows far from unit scale."""
    gen = torch.Generator().manual_seed(11)
    for t, h, eps in ((32, 576, 1e-5), (7, 960, 1e-6), (1, 100, 1e-8), (65, 2048, 1e-5), (3, 17, 1e-6)):
        w = (torch.randn(h, generator=gen) * 2).to(dtype)
        wide = torch.randn(t, h + 5, generator=gen) * torch.rand(t, 1, generator=gen) * 40  # [T, H + 5] float32
        for add in (None, torch.randn(t, h, generator=gen) * 3, (torch.randn(t, h, generator=gen) * 3).to(dtype)):
            x_cpu, x_ref = wide.clone()[:, :h], wide.clone()[:, :h]  # [T, H] strided views
            out = OPS.rms_norm(x_cpu, w, eps, add)
            expected = TORCH_OPS.rms_norm(x_ref, w, eps, add)
            assert torch.equal(x_cpu, x_ref), (t, h)  # the residual stream: the same bits
            assert out.dtype == dtype and out.shape == (t, h)
            assert torch.equal(out, expected), (t, h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_mul_matches_the_torch_ops(dtype: torch.dtype) -> None:
    """Rows of a fused gate|up projection, widths with and without a vector tail, a strided batch (rows of a
    wider buffer), large negative and positive gates (silu's tails) and zeros: float32 the same bits, half
    precision differing in under 1% of the elements."""
    gen = torch.Generator().manual_seed(12)
    for t, inter in ((32, 1536), (5, 40), (1, 7), (17, 2048)):
        wide = (torch.randn(t, 2 * inter + 3, generator=gen) * 6).to(dtype)
        wide[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)  # tails and signed zeros
        gate_up = wide[:, : 2 * inter]  # [T, 2I], row stride 2I + 3
        out = OPS.silu_mul(gate_up)
        expected = TORCH_OPS.silu_mul(gate_up)
        assert out.dtype == dtype and out.shape == (t, inter)
        if dtype == torch.float32:
            assert torch.equal(out, expected), (t, inter)
            continue
        finite = out.isfinite() & expected.isfinite()
        assert torch.equal(finite, expected.isfinite())
        _rarely_apart(out[finite], expected[finite])


def test_the_norm_sums_squares_in_torch_order() -> None:
    """This CPU's torch reduction width is found (the extension's row sums then equal torch's bit for bit,
    at widths with and without vector tails, cascade levels included), and rows whose sums are not exact
    in float32 show that the order matters: the other width differs on some of them."""
    lanes = OPS._norm_lanes
    assert lanes in (8, 16)
    gen = torch.Generator().manual_seed(13)
    mismatches_other = 0
    for n in (1, 5, 8, 17, 64, 100, 576, 960, 1536, 2048, 4099, 16384):
        x = torch.randn(8, n, generator=gen) * 5  # [8, n] float32
        assert torch.equal(OPS._ext.sum_sq_rows(x, lanes), x.pow(2).sum(-1)), n
        mismatches_other += int((OPS._ext.sum_sq_rows(x, 24 - lanes) != x.pow(2).sum(-1)).sum())
    assert mismatches_other > 0


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_takes_strided_half_precision_q(q_dtype: torch.dtype) -> None:
    """q as the model passes it (a strided view of the rotated q|k heads) in its own dtype: the same bits
    as widening it to a contiguous float32 copy first and rounding the result back, with and without
    context splits."""
    p = make_paged_problem([1, 40, 129, 300], 6, 2, 64, 16, torch.bfloat16, seed=21)
    qk = torch.cat((p.q, p.q[:, :2]), dim=1).to(q_dtype)  # [B, Hq + Hkv, D]
    q = qk[:, :6]  # [B, Hq, D], row stride (Hq + Hkv) * D
    assert not q.is_contiguous()
    for splits in (1, 3):
        out = OPS._ext.paged_decode(q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale, splits)
        widened = OPS._ext.paged_decode(q.float().contiguous(), p.k_cache, p.v_cache, p.block_tables,
                                        p.context_lens, p.scale, splits)
        assert out.dtype == q_dtype and out.is_contiguous()
        assert torch.equal(out, widened.to(q_dtype)), splits
