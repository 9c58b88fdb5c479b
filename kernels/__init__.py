"""Paged-attention and KV-movement kernels: Triton on CUDA, a vectorized torch path on CPU."""

from __future__ import annotations

import torch

from kernels.interface import KV_LAYOUT_VERSION, KernelOps

__all__ = ["BACKENDS", "KV_LAYOUT_VERSION", "KernelOps", "get_kernel_ops"]

BACKENDS = ("auto", "torch", "triton")


def get_kernel_ops(backend: str = "auto", device: str | torch.device = "cpu") -> KernelOps:
    """Returns the ops for `backend`: "auto" picks Triton on CUDA devices and torch elsewhere.
    Asking for an unavailable path raises a clear error instead of silently falling back: "triton"
    needs an importable Triton and either a usable CUDA device or TRITON_INTERPRET=1 (CPU interpreter,
    for tests). "torch" runs anywhere."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    dev = torch.device(device)
    if backend == "auto":
        backend = "triton" if dev.type == "cuda" else "torch"
    if backend == "torch":
        from kernels.torch_ops import TorchOps

        return TorchOps()
    try:
        from kernels.triton_ops import TritonOps, cuda_ready, interpreter_active
    except ImportError as e:  # triton missing or not built for this platform
        raise RuntimeError(f"kernel backend 'triton' is unavailable: {e}") from e
    if interpreter_active():
        if dev.type != "cpu":
            raise RuntimeError(f"kernel backend 'triton' was loaded for the CPU interpreter (TRITON_INTERPRET=1); "
                               f"it cannot run on {dev}")
    elif not cuda_ready(dev):
        raise RuntimeError(f"kernel backend 'triton' needs a usable CUDA device, got {dev!s} "
                           f"(cuda available: {torch.cuda.is_available()}); use backend='torch', or set "
                           "TRITON_INTERPRET=1 before importing kernels to run Triton's CPU interpreter")
    return TritonOps()
