"""One projection y = x @ W.T + b, whatever form its weight is held in.

The model's forward calls `Linear(x)` and does not know which of three forms serves it:
- a float parameter (the checkpoint's dtype), read by F.linear;
- the same, packed once into oneDNN's blocked layout (`pack`; bfloat16 on CPUs where the packed GEMM gives
  the same bits, see `cpu_weight_packing`);
- quantized GGUF blocks (`set_quantized`), run by the quantized kernels (kernels.quant_ops) on float32
  activations, the blocks read as the file stores them.
A fused projection (q|k|v, gate|up) is one Linear; when its sources differ in type (a GGUF mixing Q4_K and
Q6_K rows) it holds one group per run of rows of one type and concatenates their outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.quant_format import QuantWeight
from pdserve.kernels.quant_ops import QuantOps

# Batch size the CPU weight packing is tuned for (any batch size works; outputs do not depend on it).
PACK_BATCH_HINT = 32

# A group of output rows: quantized blocks, or a float32 [rows, in] tensor (a tensor the kernels don't run).
RowGroup = QuantWeight | torch.Tensor


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialized: every parameter is overwritten by the loader, so skip nn.Linear's random init.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def cpu_weight_packing(dtype: torch.dtype) -> bool:
    """Whether linear weights of `dtype` on this CPU can be packed once into oneDNN's blocked layout
    (bfloat16 with oneDNN: a plain bf16 GEMM repacks its weight on every call, at a decode step's small
    batch a large part of its time). Checked by packing one small weight and comparing with F.linear,
    which must agree bit for bit. Changes nothing."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.linspace(-1, 1, 24 * 40).reshape(24, 40).to(dtype)  # [out, in]
        x = torch.linspace(-2, 2, 3 * 40).reshape(3, 40).to(dtype)  # [M, in]
        b = torch.linspace(-3, 3, 24).to(dtype)  # [out]
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
        return all(
            torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""), F.linear(x, w, bias))
            for bias in (None, b)
        )
    except (RuntimeError, AttributeError):
        return False


class Linear(nn.Module):
    """x [T, in] -> [T, out]. Created with an uninitialized float weight (empty when `quantized`: the
    loader then calls `set_quantized`)."""

    def __init__(self, out_features: int, in_features: int, bias: bool, dtype: torch.dtype,
                 quantized: bool = False, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        if weight is not None:  # shared with another module (a tied LM head reads the embedding)
            self.weight = weight
        else:
            self.weight = empty_param(*((0,) if quantized else (out_features, in_features)), dtype=dtype)
        self.bias = empty_param(out_features, dtype=dtype) if bias else None
        self.packed: torch.Tensor | None = None
        self.groups: list[RowGroup] | None = None
        self.qops: QuantOps | None = None

    @property
    def format(self) -> str:
        """"Q4_K", "Q4_K+Q6_K" for mixed groups, "F32" for a float group, else the float weight's dtype."""
        if self.groups is None:
            return str(self.weight.dtype).removeprefix("torch.")
        return "+".join(dict.fromkeys(g.type_name if isinstance(g, QuantWeight) else "F32" for g in self.groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.groups is not None:
            return self._quantized(x)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        assert self.qops is not None and self.groups is not None
        x32 = x.float().contiguous()  # [T, in] the kernels take float32 activations
        if len(self.groups) == 1:
            y = self._group(x32, self.groups[0], self.bias)
        else:
            y = torch.cat([self._group(x32, g, None) for g in self.groups], dim=1)  # [T, out]
            if self.bias is not None:
                y.add_(self.bias)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _group(self, x32: torch.Tensor, group: RowGroup, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(group, QuantWeight):
            assert self.qops is not None
            return self.qops.matmul(x32, group, None if bias is None else bias.float())
        return F.linear(x32, group, None if bias is None else bias.float())

    @torch.no_grad()
    def set_quantized(self, parts: Sequence[RowGroup], qops: QuantOps) -> None:
        """Serves this projection from `parts` (row blocks in output order; adjacent quantized parts of one
        type are fused into one group). Frees the float weight unless it is shared."""
        groups: list[RowGroup] = []
        for part in parts:
            last = groups[-1] if groups else None
            if isinstance(part, QuantWeight) and isinstance(last, QuantWeight) and last.type_name == part.type_name:
                groups[-1] = QuantWeight.cat([last, part])
            elif isinstance(part, torch.Tensor) and isinstance(last, torch.Tensor):
                groups[-1] = torch.cat([last, part.float()])
            else:
                groups.append(part if isinstance(part, QuantWeight) else part.float().contiguous())
        rows = sum(g.rows if isinstance(g, QuantWeight) else g.shape[0] for g in groups)
        assert rows == self.out_features, (rows, self.out_features)
        self.groups, self.qops = groups, qops

    @torch.no_grad()
    def pack(self) -> None:
        """Packs the float weight for oneDNN (the caller checked `cpu_weight_packing`); the plain copy is
        freed unless another module shares it."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_BATCH_HINT)

    def nbytes(self) -> int:
        """Bytes of weight one forward reads (the packed copy or the quantized blocks, bias excluded)."""
        if self.groups is not None:
            return sum(g.nbytes if isinstance(g, QuantWeight) else g.numel() * 4 for g in self.groups)
        w = self.packed if self.packed is not None else self.weight
        return w.numel() * w.element_size()
