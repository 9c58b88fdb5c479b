"""The vector instruction sets of the CPU a benchmark ran on, for its report: figures from an AVX2-only
machine and from one with AVX-512 or AMX are not comparable, so every bench prints this line."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

# The flags that change how fast the project's CPU paths run, widest last.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8")


def cpu_flags() -> set[str]:
    """The CPU's flags as lscpu reports them (/proc/cpuinfo when lscpu is missing; empty when neither is)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        try:
            out = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in out.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() == "flags":
            return set(value.split())
    return set()


def isa_summary(flags: set[str] | None = None) -> str:
    """One line such as "x86_64: avx2 avx512f avx512_bf16 amx_bf16" (or "x86_64: none of ..." )."""
    have = cpu_flags() if flags is None else flags
    present = [f for f in ISA_FLAGS if f in have]
    return f"{platform.machine()}: {' '.join(present) if present else 'none of ' + ' '.join(ISA_FLAGS)}"


if __name__ == "__main__":
    print(isa_summary())
