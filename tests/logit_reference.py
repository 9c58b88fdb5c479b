"""fp32 logits checked against a float64 reference, with a tolerance that holds for any weights.

Why not a fixed atol: fp32 rounding error grows with the size of the activations and logits, and those
depend on the weights. The tiny models used to be trained on the local Python's stdlib, so each machine
had other weights, and an atol of 1e-4 that held for one set failed for another (1.097e-4). Scaling the
atol with max|logits| alone would still guess at how error accumulates through the layers.

Instead the same checkpoint runs in transformers in float64 (RMSNorm patched to stay in float64; RoPE
tables stay the float32 values both implementations use, as part of the model). Transformers' own fp32
forward measures how far fp32 arithmetic on these weights and inputs lands from the float64 logits;
pdserve's fp32 logits must land no further than FP32_ERROR_FACTOR times that (a different summation
order gives a different but equally sized error), with a small floor in units of fp32 resolution for
inputs where transformers happens to be unusually accurate. Greedy tokens are compared exactly elsewhere.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch

# pdserve's error over transformers' error, in 134 comparisons (3 archs x 5 weight seeds, prefill,
# decode, chunking, preemption): 0.8 to 1.7. A factor of 3 leaves room; a real bug (a wrong position,
# mask or scale) is off by 1e-2 or more, far beyond the resulting 6e-5..5e-4.
FP32_ERROR_FACTOR = 3.0
# Floor: 8 fp32 ulps of the largest logit (about 4e-5 for logits of magnitude 40), for inputs where
# transformers' fp32 error happens to be small.
FP32_FLOOR_ULPS = 8.0
FP32_EPS = torch.finfo(torch.float32).eps


def _float64_rms_norm(self: Any, hidden: torch.Tensor) -> torch.Tensor:
    return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def load_float64_reference(path: str | Path, device: str = "cpu") -> Any:
    """transformers' model of `path` in float64, SDPA attention (float64 softmax), and every RMSNorm
    replaced by one computing in float64 (transformers' rounds its input to float32 first)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa")
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(hasattr(m, "variance_epsilon") and hasattr(m, "weight") for m in norms), \
        "transformers' RMSNorm changed: update _float64_rms_norm"
    for m in norms:
        m.forward = types.MethodType(_float64_rms_norm, m)
    return model.to(device).eval()


def forward_logits(hf: Any, tokens: list[int]) -> torch.Tensor:  # [n, V] in the model's dtype, on the CPU
    """Teacher-forced logits of `hf` at every position of `tokens`."""
    device = next(hf.parameters()).device
    with torch.no_grad():
        return hf(torch.tensor([tokens], device=device)).logits[0].cpu()


def fp32_tolerance(hf32: torch.Tensor, ref64: torch.Tensor) -> float:
    """The largest error allowed for fp32 logits of this input: FP32_ERROR_FACTOR times transformers'
    own fp32 error `hf32` vs `ref64`, at least FP32_FLOOR_ULPS fp32 ulps of the largest logit."""
    hf_error = float((hf32.double() - ref64.double()).abs().max())
    floor = FP32_FLOOR_ULPS * FP32_EPS * float(ref64.abs().max())
    return FP32_ERROR_FACTOR * max(hf_error, floor)


def assert_fp32_close(got: torch.Tensor, hf32: torch.Tensor, ref64: torch.Tensor, what: str = "") -> float:
    """Asserts pdserve's fp32 logits `got` are within fp32_tolerance of the float64 reference; returns
    the error as a fraction of the tolerance (for reports). Shapes must match: [n, V]."""
    assert got.shape == ref64.shape == hf32.shape, (got.shape, hf32.shape, ref64.shape)
    tol = fp32_tolerance(hf32, ref64)
    err = float((got.double().cpu() - ref64.double()).abs().max())
    hf_error = float((hf32.double() - ref64.double()).abs().max())
    assert err <= tol, (f"{what}: |pdserve fp32 - float64| = {err:.3e} > tolerance {tol:.3e} "
                        f"(transformers fp32 is {hf_error:.3e} from float64)")
    return err / tol
