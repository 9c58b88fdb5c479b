"""Launch-side helpers shared by the Triton kernel files."""

from __future__ import annotations

import torch
import triton


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` was built by Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_launchable(kernel: object, device: torch.device) -> None:
    """Requires tensors on CUDA, or CPU tensors when the kernel runs in the interpreter. Changes nothing."""
    if device.type == "cuda":
        if is_interpreted(kernel):
            raise RuntimeError("Triton kernels were built for the CPU interpreter (TRITON_INTERPRET=1) "
                               "but got CUDA tensors")
        return
    if not is_interpreted(kernel):
        raise RuntimeError(f"Triton kernels need CUDA tensors, got {device}; use the torch backend on CPU, or "
                           "set TRITON_INTERPRET=1 before importing the kernels to run Triton's interpreter")


def pow2_at_least(n: int, floor: int = 16) -> int:
    """Next power of two >= max(n, floor): tl.arange needs powers of two and tl.dot needs >= 16."""
    return max(floor, triton.next_power_of_2(n))


def dot_precisions(dtype: torch.dtype) -> tuple[str, str]:
    """(score precision, value precision) for tl.dot on float32-cast tiles.

    fp16/bf16 values cast to float32 are exact in TF32, so the score product runs on TF32 tensor cores
    without losing anything; the probabilities are full float32, so the value product uses the 3-pass
    TF32 split, which keeps float32 accuracy. float32 inputs use the 3-pass split for both: plain IEEE
    float32 dots fall off the tensor cores and spill registers at these tile sizes."""
    if dtype == torch.float32:
        return "tf32x3", "tf32x3"
    return "tf32", "tf32x3"


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 for the interpreter, where it does not matter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
