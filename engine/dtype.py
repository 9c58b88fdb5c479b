"""Which dtype the engine holds weights and KV in when asked for "auto" (no torch: the launcher prints it).

On a CPU with AVX512-BF16 or AMX, bfloat16 GEMMs run about 2-3x as fast as float32 ones and the KV cache
(and every KV transfer) is half the bytes, so an fp32 checkpoint is served in bfloat16 there; the residual
stream, norms, softmax, attention arithmetic and the best logits stay float32 (engine/model.py).
Elsewhere "auto" keeps the checkpoint's dtype. Ask for "float32" for parity with an fp32 reference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.model_config import dtype_name

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


def checkpoint_dtype_name(model_dir: str | Path) -> str:
    """The dtype a Hugging Face directory's config.json declares ("float32" when it declares none); raises
    ValueError for one the engine does not serve."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    return dtype_name(raw.get("dtype") or raw.get("torch_dtype") or "float32")


@dataclass(frozen=True)
class DtypeChoice:
    name: str  # "float32" | "bfloat16" | "float16"
    reason: str  # one line for the start-up log


def resolve_dtype(requested: str, checkpoint: str, device: str, cpuinfo: str | None = None,
                  quantized: bool = False) -> DtypeChoice:
    """Maps the configured dtype ("auto" or a name) and the checkpoint's dtype name to the one to serve in.
    `quantized`: the weights stay in GGUF blocks, whose kernels take float32 activations."""
    if requested != "auto":
        return DtypeChoice(requested, f"{requested} as configured")
    if quantized:
        return DtypeChoice("float32", "float32 activations: the weights stay quantized (GGUF blocks)")
    if device.split(":")[0] == "cpu" and checkpoint == "float32":
        flags = cpu_bf16_flags(cpuinfo)
        if flags:
            return DtypeChoice("bfloat16", f"bfloat16: this CPU has {', '.join(flags)} (--dtype float32 to keep fp32)")
        return DtypeChoice(checkpoint, "float32: the checkpoint's dtype (this CPU has no AVX512-BF16 or AMX)")
    return DtypeChoice(checkpoint, f"{checkpoint}: the checkpoint's dtype")
