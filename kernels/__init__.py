"""Paged-attention and KV-movement kernels: Triton on CUDA; on CPU a C++ decode kernel over a vectorized torch path."""

from __future__ import annotations

import logging

import torch

from pdserve.kernels.interface import KV_LAYOUT_VERSION, KernelOps

__all__ = ["BACKENDS", "KV_LAYOUT_VERSION", "KernelOps", "get_kernel_ops"]

BACKENDS = ("auto", "cpu", "torch", "triton")


def get_kernel_ops(backend: str = "auto", device: str | torch.device = "cpu") -> KernelOps:
    """Returns the ops for `backend`: "auto" picks Triton on CUDA devices, and on CPU the C++ decode
    kernel ("cpu"), or the torch path with a logged warning when the extension can't be built here.
    Asking for an unavailable path by name raises a clear error instead of silently falling back: "cpu"
    needs a C++ compiler and ninja; "triton"
    needs an importable Triton and either a usable CUDA device or TRITON_INTERPRET=1 (CPU interpreter,
    for tests). "torch" runs anywhere."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    dev = torch.device(device)
    if backend == "auto":
        backend = "triton" if dev.type == "cuda" else "cpu"
        if backend == "cpu":
            from pdserve.kernels.cpu_ops import CpuOps, ExtensionUnavailable

            try:
                return CpuOps.create()
            except ExtensionUnavailable as e:
                logging.getLogger(__name__).warning("%s; using the torch path", e)
                backend = "torch"
    if backend == "cpu":
        from pdserve.kernels.cpu_ops import CpuOps, ExtensionUnavailable

        if dev.type != "cpu":
            raise RuntimeError(f"kernel backend 'cpu' runs on CPU pools only, got {dev!s}")
        try:
            return CpuOps.create()
        except ExtensionUnavailable as e:
            raise RuntimeError(f"kernel backend 'cpu' is unavailable: {e}") from e
    if backend == "torch":
        from pdserve.kernels.torch_ops import TorchOps

        return TorchOps()
    try:
        from pdserve.kernels.triton_ops import TritonOps, cuda_ready, interpreter_active
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
