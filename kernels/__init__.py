"""Paged-attention and KV-movement kernels: Triton on CUDA, a vectorized torch path on CPU."""

from __future__ import annotations

from kernels.interface import KV_LAYOUT_VERSION, KernelOps

__all__ = ["KV_LAYOUT_VERSION", "KernelOps", "get_kernel_ops"]

BACKENDS = ("auto", "torch", "triton")


def get_kernel_ops(backend: str = "auto", device: str = "cpu") -> KernelOps:
    """Returns the ops for `backend`: "auto" picks Triton on CUDA devices and torch elsewhere.
    Asking for an unavailable path raises a clear error instead of silently falling back."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if str(device).startswith("cuda") else "torch"
    if backend == "torch":
        from kernels.torch_ops import TorchOps

        return TorchOps()
    try:
        from kernels.triton_ops import TritonOps
    except ImportError as e:  # triton missing or not yet built for this platform
        raise RuntimeError(f"kernel backend 'triton' is unavailable: {e}") from e
    return TritonOps()
