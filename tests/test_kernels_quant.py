"""GGUF block-quantized weights and their CPU kernels: `kernels.quant_format` (the checked constructor from
a file's bytes, the float reference, row selection and stacking, the quantizers' error and stability) and
`kernels.quant_ops` (matmul and embedding on every ISA path this CPU has, against x @ dequantize(w).T).

Tolerance of matmul. With activations="int8" the kernels round each span of activations (32 values; 256
for the K types in the row kernels, at up to quant_ops.ROW_MAX_M activation rows) to int8 with scale
d = max|x| / 127, so each activation moves by at most d / 2 and an output by at most sum over spans of
d / 2 * sum |w| (`rounding_bound`, taken over spans of 256 for the K types, which bounds both). With
"int8x2" (the default) the residual, at most d / 2 per value, is rounded to int8 again with scale at most
d / 254, so the bound shrinks to rounding_bound / 254 (tested as / X2_GAIN = 250: the residual's own float32
rounding, 2^-24 of d, stays far inside the margin). At up to ROW_MAX_M rows of a 32-value type int8x2
rounds each activation to int16 instead, d = max|x| / 32767 per 32: 258 times finer than int8, inside
the same bound. On top of either the float32 sums of the group
products may round, by at most FLOAT_RTOL of sum |w| |x|. Where every activation group of 32 is exactly
d * (integers up to 127, one of them +-127) with d a power of two shared by its 256, the int8 rounding is
exact (the residual is zero) and only the float32 part remains.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pdserve.kernels.cpu_ops import ExtensionUnavailable
from pdserve.kernels.quant_format import QUANT_TYPES, QuantFormatError, QuantWeight, block_layout, quantize
from pdserve.kernels.quant_ops import (
    ACTIVATIONS_ENV,
    ISA_ENV,
    ISAS,
    QuantOps,
    available_isas,
    choose_activations,
    choose_isa,
    missing_flags,
)
from pdserve.kernels.quant_ops import load_extension as load_quant_extension

try:
    load_quant_extension()
except ExtensionUnavailable as e:  # pragma: no cover - a machine without a C++ toolchain
    pytest.skip(f"CPU quant extension unavailable: {e}", allow_module_level=True)

FLOAT_RTOL = 1e-5
# How much tighter int8x2's rounding bound is than int8's (254 in exact arithmetic; see the docstring).
X2_GAIN = 250.0
ACTS = ("int8", "int8x2")

# Relative RMSE of dequantize(quantize(w)) on standard Gaussian rows; ggml's reference quantizers land at
# about 0.005 / 0.086 / 0.078 / 0.043 / 0.072 / 0.036 / 0.018 (the K types' searches beat min/max).
MAX_REL_RMSE = {"Q8_0": 0.006, "Q4_0": 0.095, "Q4_1": 0.085, "Q5_0": 0.048, "Q4_K": 0.076, "Q5_K": 0.039,
                "Q6_K": 0.020}
# Types whose quantizer gives back the same blocks for already-quantized values.
IDEMPOTENT = ("Q8_0", "Q4_0", "Q4_1", "Q5_0")


def _rel_rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()


@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_quantize_error_and_stability(type_name: str) -> None:
    w = torch.randn(48, 512, generator=torch.Generator().manual_seed(1))
    q = quantize(w, type_name)
    values, size = block_layout(type_name)
    assert q.data.dtype == torch.uint8 and q.data.shape == (48, 512 // values * size) and q.data.is_contiguous()
    deq = q.dequantize()
    assert deq.shape == (48, 512) and deq.dtype == torch.float32
    assert _rel_rmse(deq, w) < MAX_REL_RMSE[type_name]
    again = quantize(deq, type_name)
    if type_name in IDEMPOTENT:
        assert torch.equal(again.data, q.data)
    else:  # the searches may pick other scales for the same grid values, but barely move them
        assert _rel_rmse(again.dequantize(), deq) < MAX_REL_RMSE[type_name] / 10


@pytest.mark.parametrize("type_name", ("Q4_K", "Q6_K"))
def test_quantize_zero_and_constant_rows(type_name: str) -> None:
    w = torch.zeros(3, 256)
    w[1] = 0.5
    w[2, :128] = -3.0
    deq = quantize(w, type_name).dequantize()
    torch.testing.assert_close(deq, w, atol=0.05, rtol=0.02)
    assert torch.all(deq[0] == 0)


def test_from_raw_wraps_a_memory_map_without_a_copy(tmp_path) -> None:
    q = quantize(torch.randn(5, 256), "Q5_K")
    path = tmp_path / "blocks.bin"
    q.data.numpy().tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    w = QuantWeight.from_raw("blk.0.ffn_down.weight", "Q5_K", (5, 256), mm)
    assert w.data.data_ptr() == mm.ctypes.data and w.nbytes == mm.size == 5 * 176
    assert torch.equal(w.dequantize(), q.dequantize())
    assert torch.equal(QuantWeight.from_raw("t", "Q5_K", (5, 256), q.data.numpy().tobytes()).data, q.data)
    assert torch.equal(QuantWeight.from_raw("t", "Q5_K", (5, 256), q.data.reshape(-1)).data, q.data)


@pytest.mark.parametrize(("type_name", "shape", "nbytes", "says"), [
    ("Q4_K", (4, 512), 4 * 2 * 144 - 7, "truncated"),
    ("Q4_K", (4, 512), 4 * 2 * 144 + 144, "wrong block count"),
    ("Q3_K", (4, 512), 4 * 2 * 110, "not served quantized"),
    ("BF16", (4, 512), 4 * 512 * 2, "not served quantized"),
    ("Q8_0", (4, 48), 4 * 2 * 34, "not whole blocks of 32"),
    ("Q8_0", (4, 32, 1), 4 * 34, "2-D"),
])
def test_from_raw_errors_name_the_tensor(type_name: str, shape: tuple[int, ...], nbytes: int, says: str) -> None:
    with pytest.raises(QuantFormatError, match=says) as err:
        QuantWeight.from_raw("blk.7.attn_k.weight", type_name, shape, np.zeros(nbytes, dtype=np.uint8))  # type: ignore[arg-type]
    assert "blk.7.attn_k.weight" in str(err.value)
    if says in ("truncated", "wrong block count"):
        assert f"{nbytes} bytes" in str(err.value) and "1152 bytes" in str(err.value)


def test_select_rows_and_cat() -> None:
    w = torch.randn(9, 64)
    q = quantize(w, "Q4_1")
    index = torch.tensor([8, 0, 3, 3])
    assert torch.equal(q.select_rows(index).dequantize(), q.dequantize()[index])
    k = quantize(torch.randn(4, 64), "Q4_1")
    both = QuantWeight.cat([q, k])
    assert both.rows == 13 and torch.equal(both.dequantize(), torch.cat([q.dequantize(), k.dequantize()]))
    with pytest.raises(QuantFormatError, match="share type"):
        QuantWeight.cat([q, quantize(torch.randn(4, 64), "Q4_0")])
    with pytest.raises(QuantFormatError, match="share type"):
        QuantWeight.cat([q, quantize(torch.randn(4, 96), "Q4_1")])
    # Built directly, a weight is held to the layout the kernels read through its pointer.
    with pytest.raises(QuantFormatError, match="contiguous"):
        QuantWeight("Q4_1", 9, 64, q.data.T.contiguous().T)
    with pytest.raises(QuantFormatError, match=r"needs data uint8 \[9, 40\]"):
        QuantWeight("Q4_1", 9, 64, q.data[:, :-1])


# ------------------------------------------------------------------------------------------ kernels

_OPS: dict[tuple[str, str], QuantOps] = {}


def _ops(isa: str, activations: str = "int8x2") -> QuantOps:
    """The ops of path `isa` rounding activations as `activations`; skips (naming the missing CPU flags)
    where this CPU lacks the path."""
    lacking = missing_flags(isa)
    if lacking:
        pytest.skip(f"this CPU lacks {' '.join(lacking)} for the {isa} path")
    if (isa, activations) not in _OPS:
        _OPS[isa, activations] = QuantOps.create(isa, activations)
    return _OPS[isa, activations]


# fp16 scales the random blocks draw from: ordinary, zero, the extremes, a subnormal, negative.
_SCALES = np.array([0.0, 65504.0, -65504.0, 6e-8, -6e-8, 1.0, -0.75, 0.0123, -0.002, 3.5], dtype=np.float16)


def random_weight(type_name: str, rows: int, cols: int, seed: int) -> QuantWeight:
    """Random blocks of `type_name`: random quants (some blocks all-max or all-min) under scales that
    include zero, +-65504, subnormals and negatives (and random mins)."""
    rng = np.random.default_rng(seed)
    values, size = block_layout(type_name)
    nb = rows * cols // values
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)

    def halves(n: int) -> np.ndarray:  # [nb, 2] uint8: mostly ordinary scales, some extreme
        pick = np.where(rng.random(n) < 0.3, rng.choice(_SCALES, n), (rng.standard_normal(n) * 0.05))
        return pick.astype(np.float16).reshape(-1, 1).view(np.uint8)

    quant = {"Q8_0": slice(2, 34), "Q4_0": slice(2, 18), "Q4_1": slice(4, 20), "Q5_0": slice(2, 22),
             "Q4_K": slice(4, 144), "Q5_K": slice(16, 176), "Q6_K": slice(0, 192)}[type_name]
    edge = rng.random(nb)
    raw[edge < 0.1, quant] = 0xFF  # all quants at their maximum (Q8_0: -1; Q4_K: also the largest scales)
    raw[(edge >= 0.1) & (edge < 0.2), quant] = 0x00  # all at their minimum
    if type_name == "Q8_0":
        raw[(edge >= 0.2) & (edge < 0.3), quant] = 0x7F
        raw[(edge >= 0.3) & (edge < 0.4), quant] = 0x80
    if type_name == "Q6_K":
        raw[:, 208:210] = halves(nb)
        raw[edge < 0.05, 192:208] = 0x80  # scales of -128
    else:
        raw[:, 0:2] = halves(nb)
        if type_name in ("Q4_1", "Q4_K", "Q5_K"):
            raw[:, 2:4] = halves(nb)
    raw[rng.random(nb) < 0.05, :] = 0  # whole blocks of zeros
    return QuantWeight.from_raw("random", type_name, (rows, cols), raw.reshape(-1))


def rounding_bound(x: torch.Tensor, w_abs: torch.Tensor, span: int) -> torch.Tensor:  # [M, N] float64
    """The most the int8 rounding of x's spans can move each output: sum over spans of d / 2 * sum |w|."""
    m, k = x.shape
    d = x.abs().reshape(m, k // span, span).amax(-1) / 127.0  # [M, K/span]
    half = (d / 2).repeat_interleave(span, dim=1)  # [M, K]
    return (half.double() * 1.0001) @ w_abs.T


def check_matmul(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 exact_x: bool = False, span: int = 32, activations: str = "int8x2") -> None:
    """got is x @ w.T (+ bias) within the tolerance of the docstring for `activations`."""
    w64 = w.double()
    ref = x.double() @ w64.T + (0 if bias is None else bias.double())
    scale = x.double().abs() @ w64.abs().T  # [M, N]
    tol = FLOAT_RTOL * scale + 1e-30
    if not exact_x:
        tol = tol + rounding_bound(x, w64.abs(), span) / (X2_GAIN if activations == "int8x2" else 1.0)
    err = (got.double() - ref).abs()
    worst = (err / tol).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"error {worst:.3g} x the tolerance (max abs err {err.max().item():.3g})"


def _cols(type_name: str, blocks: int) -> int:
    return block_layout(type_name)[0] * blocks


# (rows N, blocks per row, activation rows M): one and three blocks, odd N, M across the kernels' tiles
# and blocks of activation rows; 40 / 5 blocks span two decode chunks.
SHAPES = [(1, 1, 1), (7, 3, 3), (33, 1, 17), (33, 3, 64), (7, 2, 130), (16, 3, 5)]


@pytest.mark.parametrize("activations", ACTS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_matmul_matches_the_float_reference(type_name: str, isa: str, activations: str) -> None:
    ops = _ops(isa, activations)
    gen = torch.Generator().manual_seed(7)
    long_blocks = 40 if block_layout(type_name)[0] == 32 else 5
    for i, (n, blocks, m) in enumerate([*SHAPES, (20, long_blocks, 9)]):
        k = _cols(type_name, blocks)
        qw = random_weight(type_name, n, k, seed=100 * i + len(type_name))
        w = qw.dequantize()
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
        check_matmul(ops.matmul(x, qw), x, w, span=block_layout(type_name)[0], activations=activations)


@pytest.mark.parametrize("activations", ACTS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_matmul_is_exact_up_to_float_rounding_on_8bit_activations(type_name: str, isa: str, activations: str) -> None:
    """Each activation group of 32 is 2^e times integers in [-127, 127] with one at +-127, e shared by
    its 256: the int8 rounding loses nothing in spans of 32 or 256, only float32 sums remain (no
    rounding_bound in the tolerance; int8x2's residuals are zeros). At 2 rows (the row kernels) and 9 (the
    panels)."""
    ops = _ops(isa, activations)
    gen = torch.Generator().manual_seed(3)
    n = 19
    k = _cols(type_name, 2 if block_layout(type_name)[0] == 256 else 16)
    qw = random_weight(type_name, n, k, seed=11)
    for m in (2, 9):
        ints = torch.randint(-127, 128, (m, k // 32, 32), generator=gen)
        ints[:, :, 0] = 127 * torch.where(torch.rand(m, k // 32, generator=gen) < 0.5, 1, -1)
        exps = torch.randint(-12, 4, (m, k // 256, 1, 1), generator=gen).expand(m, k // 256, 8, 1)
        x = (ints.double() * torch.pow(2.0, exps.reshape(m, k // 32, 1).double())).float().reshape(m, k)
        check_matmul(ops.matmul(x, qw), x, qw.dequantize(), exact_x=True)


@pytest.mark.parametrize("activations", ACTS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_row_kernels_up_to_their_limit(type_name: str, isa: str, activations: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The row kernels take up to 4 activation rows (8 with int8x2's residual rows; quant_ops serves only
    up to ROW_MAX_M with them)."""
    from pdserve.kernels import quant_ops

    monkeypatch.setattr(quant_ops, "ROW_MAX_M", 4)
    ops = _ops(isa, activations)
    k = _cols(type_name, 2 if block_layout(type_name)[0] == 256 else 12)
    qw = random_weight(type_name, 23, k, seed=8)
    bias = torch.randn(23)
    for m in (1, 2, 3, 4):
        x = torch.randn(m, k) * 3
        check_matmul(ops.matmul(x, qw, bias), x, qw.dequantize(), bias, span=block_layout(type_name)[0],
                     activations=activations)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", ("Q8_0", "Q4_0", "Q4_1", "Q5_0"))
def test_int16_row_kernels_keep_int8x2_precision(type_name: str, isa: str) -> None:
    """int8x2 at up to ROW_MAX_M rows of a 32-value type: each activation rounded to int16 (d = max|x| /
    32767 per 32, 258 times finer than int8's), within rounding_bound / X2_GAIN like the two int8 terms,
    also with a bias and with large values."""
    ops = _ops(isa, "int8x2")
    qw = random_weight(type_name, 29, _cols(type_name, 18), seed=12)
    bias = torch.randn(29)
    for m in (1, 2, 5, 8):
        for gain in (5.0, 3e4):
            x = torch.randn(m, qw.cols) * gain
            check_matmul(ops.matmul(x, qw, bias), x, qw.dequantize(), bias, activations="int8x2")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", ("Q8_0", "Q4_0", "Q4_1", "Q5_0"))
def test_int16_row_kernels_give_each_row_what_it_gets_alone(type_name: str, isa: str) -> None:
    """Up to WIDE_ROW_MAX_M rows the int16 row kernels compute each activation row exactly as they would
    for that row alone (bit for bit): a speculative step's 1 + d rows verify with one row's arithmetic."""
    from pdserve.kernels.quant_ops import WIDE_ROW_MAX_M

    ops = _ops(isa, "int8x2")
    qw = random_weight(type_name, 37, _cols(type_name, 14), seed=13)
    bias = torch.randn(37)
    x = torch.randn(WIDE_ROW_MAX_M, qw.cols) * 4
    alone = torch.cat([ops.matmul(x[i:i + 1], qw, bias) for i in range(WIDE_ROW_MAX_M)])
    for m in range(2, WIDE_ROW_MAX_M + 1):
        assert torch.equal(ops.matmul(x[:m], qw, bias), alone[:m]), m


@pytest.mark.parametrize("isa", ("portable", "avx2"))
@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_float_panels_round_nothing(type_name: str, isa: str) -> None:
    """int8x2 from FLOAT_MIN_M rows on the portable and AVX2 paths: the float panels take the float32
    activations against dequantize()'s weights, so only float32 sums remain (no rounding_bound), over
    odd widths, several tiles of packed rows, blocks of activation rows and a partial last panel."""
    ops = _ops(isa, "int8x2")
    assert load_quant_extension().FLOAT_MIN_M <= 8  # every shape below takes the float panels
    gen = torch.Generator().manual_seed(21)
    # From 9 rows: the 32-value types take the int16 row kernels up to WIDE_ROW_MAX_M (8) rows.
    for i, (n, blocks, m) in enumerate([(13, 3, 9), (33, 2, 10), (17, 5, 23), (9, 1, 64), (40, 2, 77), (7, 3, 130)]):
        k = _cols(type_name, blocks if block_layout(type_name)[0] == 256 else 8 * blocks + 1)
        qw = random_weight(type_name, n, k, seed=300 + i)
        bias = torch.randn(n, generator=gen) if i % 2 else None
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
        check_matmul(ops.matmul(x, qw, bias), x, qw.dequantize(), bias, exact_x=True)


@pytest.mark.parametrize("activations", ACTS)
@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_isa_paths_agree(type_name: str, activations: str) -> None:
    """Every path rounds the activations (and int8x2's residuals) alike and sums the same integers; only
    float sums may differ. But for the float panels (int8x2 from FLOAT_MIN_M rows), which the AVX-512 path
    does not take: there it keeps the two int8 terms and is held to the float reference's bound."""
    paths = available_isas()
    k = _cols(type_name, 4 if block_layout(type_name)[0] == 256 else 24)
    qw = random_weight(type_name, 45, k, seed=5)
    w = qw.dequantize()
    w_abs = w.double().abs()
    for m in (2, 5, 21):  # the row kernels, the int8x2 panels, the float panels
        x = torch.randn(m, k)
        results = {isa: _ops(isa, activations).matmul(x, qw) for isa in paths}
        scale = x.double().abs() @ w_abs.T
        for isa, y in results.items():
            if isa == "avx512_vnni" and activations == "int8x2" and m == 21:
                check_matmul(y, x, w, activations=activations)
                continue
            err = (y.double() - results["portable"].double()).abs()
            assert torch.all(err <= 2 * FLOAT_RTOL * scale + 1e-30), (isa, m, (err / scale).max().item())


@pytest.mark.parametrize("activations", ACTS)
@pytest.mark.parametrize("isa", ISAS)
def test_matmul_strided_x_bias_and_out(isa: str, activations: str) -> None:
    ops = _ops(isa, activations)
    qw = random_weight("Q4_K", 37, 512, seed=9)
    w = qw.dequantize()
    wide = torch.randn(6, 700)
    x = wide[:, 100:612]  # rows of a wider tensor: unit column stride, row stride 700
    bias = torch.randn(37)
    a = activations
    check_matmul(ops.matmul(x, qw, bias), x, w, bias, activations=a)
    xt = torch.randn(512, 6).T  # column-major: made contiguous
    check_matmul(ops.matmul(xt, qw), xt, w, activations=a)
    shuffled = wide[torch.tensor([4, 0]), 100:612]  # 2 rows: the row kernels, spans of 256
    check_matmul(ops.matmul(shuffled, qw), shuffled, w, span=256, activations=a)
    check_matmul(ops.matmul(shuffled, qw, bias), shuffled, w, bias, span=256, activations=a)
    out = torch.full((6, 50), 7.0)
    y = ops.matmul(x, qw, bias, out=out[:, 5:42])
    assert y.data_ptr() == out[:, 5:42].data_ptr()
    check_matmul(out[:, 5:42], x, w, bias, activations=a)
    ops.matmul(x[:2], qw, bias, out=out[:2, 5:42])
    check_matmul(out[:2, 5:42], x[:2], w, bias, span=256, activations=a)
    assert torch.all(out[:, :5] == 7) and torch.all(out[:, 42:] == 7)
    assert ops.matmul(x[:0], qw).shape == (0, 37)
    with pytest.raises(ValueError, match="x must be"):
        ops.matmul(torch.randn(2, 256), qw)
    with pytest.raises(ValueError, match="out must be"):
        ops.matmul(x, qw, out=torch.empty(6, 36))


@pytest.mark.parametrize("activations", ACTS)
@pytest.mark.parametrize("isa", ISAS)
def test_matmul_nan_and_tiny_activations(isa: str, activations: str) -> None:
    """A NaN activation makes its row's outputs NaN, as in F.linear; activation groups too small to scale
    (max below 1e-28) count as zeros instead of overflowing the scale."""
    ops = _ops(isa, activations)
    qw = quantize(torch.randn(9, 64), "Q8_0")
    x = torch.randn(3, 64)
    x[1, 40] = float("nan")
    x[2, :32] = 1e-35
    y = ops.matmul(x, qw)
    assert torch.all(torch.isnan(y[1])) and not torch.any(torch.isnan(y[[0, 2]]))
    tail = x[2:, 32:].expand(3, 32).contiguous()  # 3 rows: the same kernels (and roundings) as y's
    torch.testing.assert_close(y[2:], ops.matmul(tail, quantize(qw.dequantize()[:, 32:], "Q8_0"))[:1], rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_embedding_is_the_dequantized_rows(type_name: str) -> None:
    qw = random_weight(type_name, 11, _cols(type_name, 3), seed=2)
    ids = torch.tensor([3, 0, 10, 3, 7])
    ops = _ops(available_isas()[-1])
    assert torch.equal(ops.embedding(ids, qw), qw.dequantize()[ids])
    assert ops.embedding(ids.reshape(1, 5), qw).shape == (1, 5, qw.cols)
    with pytest.raises(IndexError, match="outside"):
        ops.embedding(torch.tensor([11]), qw)


def test_activations_default_env_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """int8x2 unless PDSERVE_QUANT_ACTIVATIONS or the caller says int8; an unknown name is refused; int8x2
    is far closer to the float product than int8 on ordinary activations."""
    monkeypatch.delenv(ACTIVATIONS_ENV, raising=False)
    assert choose_activations() == "int8x2" and QuantOps.create("portable").activations == "int8x2"
    monkeypatch.setenv(ACTIVATIONS_ENV, "int8")
    assert QuantOps.create("portable").activations == "int8"
    assert QuantOps.create("portable", "int8x2").activations == "int8x2"  # the caller wins
    monkeypatch.setenv(ACTIVATIONS_ENV, "fp8")
    with pytest.raises(ValueError, match="not a quant activation rounding"):
        choose_activations()
    with pytest.raises(ValueError, match="not a quant activation rounding"):
        QuantOps.create("portable", "int4")
    qw = random_weight("Q4_1", 64, 576, seed=4)
    errs = {}
    for act in ACTS:
        for m in (1, 40):  # row kernels and panels
            x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
            ref = x.double() @ qw.dequantize().double().T
            errs[act, m] = (_ops(available_isas()[-1], act).matmul(x, qw).double() - ref).abs().max().item()
    for m in (1, 40):
        assert errs["int8x2", m] * 50 < errs["int8", m], errs


def test_isa_choice_auto_env_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.kernels import quant_ops

    monkeypatch.delenv(ISA_ENV, raising=False)
    auto = choose_isa()
    assert auto.name == available_isas()[-1] and auto.reason.startswith(f"{auto.name}: ")
    monkeypatch.setenv(ISA_ENV, "portable")
    assert choose_isa() == quant_ops.IsaChoice("portable", f"portable: forced by {ISA_ENV}")
    assert QuantOps.create().isa.name == "portable"
    assert choose_isa("auto").name == auto.name  # an explicit request wins over the environment
    monkeypatch.setenv(ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="not a quant kernel path"):
        choose_isa()
    for isa in ISAS:
        if missing_flags(isa):  # a path this CPU really lacks
            with pytest.raises(ValueError, match=" ".join(missing_flags(isa))):
                choose_isa(isa)
    # A CPU with every flag of the avx512_vnni path but avx512_vnni (whatever this one has): auto falls
    # back, forcing it fails naming the one flag.
    lacking = (frozenset(quant_ops.ISA_FLAGS["avx512_vnni"]) | frozenset(quant_ops.ISA_FLAGS["avx2"])) - {"avx512_vnni"}
    monkeypatch.setattr(quant_ops, "cpu_flags", lambda: lacking)
    with pytest.raises(ValueError, match="needs CPU flags avx512_vnni, which this CPU lacks"):
        choose_isa("avx512_vnni")
    assert choose_isa("auto").name == "avx2"
    assert os.environ[ISA_ENV] == "sse9"


def test_bench_smoke_reports_every_path(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/quant_kernels.py --smoke: seconds, so the bench cannot rot unnoticed."""
    from bench.quant_kernels import main

    results = main(["--smoke"])
    printed = capsys.readouterr().out
    assert "CPU ISA " in printed and f"quant path: {results['path']}" in printed
    assert results["copy_gb_s"] > 0 and {r["type"] for r in results["results"]} == {"Q4_K", "Q8_0"}
    for r in results["results"]:
        assert r["flinear_ms"] > 0 and set(r["paths"]) == set(available_isas())
        assert all(p["ms"] > 0 and p["weight_gb_s"] > 0 for p in r["paths"].values())
