"""GGUF block-quantized weights (`kernels.quant_format`): the checked constructor from a file's bytes,
the float reference, row selection and stacking, and the quantizers' error and stability."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.kernels.quant_format import QUANT_TYPES, QuantFormatError, QuantWeight, block_layout, quantize

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
