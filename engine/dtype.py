"""Which dtype the engine holds weights and KV in when asked for "auto".

On a CPU with AVX512-BF16 or AMX, bfloat16 GEMMs run about 2-3x as fast as float32 ones and the KV pool
(and every KV transfer) is half the bytes, so an fp32 checkpoint is served in bfloat16 there; norms,
softmax, attention arithmetic and logits stay float32. Elsewhere "auto" keeps the checkpoint's dtype.
Ask for "float32" explicitly for bit-level parity with an fp32 reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

FAST_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_bf16_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The fast-bf16 instruction sets this CPU reports (empty when none, or when /proc is unreadable)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
            break
    return tuple(f for f in FAST_BF16_CPU_FLAGS if f in flags)


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # one line for the start-up log


def resolve_dtype(requested: str, checkpoint: torch.dtype, device: str, cpuinfo: str | None = None) -> DtypeChoice:
    """Maps the configured dtype ("auto" or a name) to the one to serve in, with the reason."""
    if requested != "auto":
        return DtypeChoice(getattr(torch, requested), f"{requested} as configured")
    if torch.device(device).type == "cpu" and checkpoint == torch.float32:
        flags = cpu_bf16_flags(cpuinfo)
        if flags:
            return DtypeChoice(torch.bfloat16, f"bfloat16: this CPU has {', '.join(flags)} (--dtype float32 to keep fp32)")
        return DtypeChoice(checkpoint, "float32: the checkpoint's dtype (this CPU has no AVX512-BF16 or AMX)")
    return DtypeChoice(checkpoint, f"{str(checkpoint).removeprefix('torch.')}: the checkpoint's dtype")
