"""Machine identity: the CPU kind a profile was measured on, and whether this machine is the same kind.

A profile's step times hold only for the CPU kind that ran them: an AVX2-only core and one with AVX-512 or
AMX differ by whole factors (the quantized kernels take another path, float weights another dtype), so
`pdserve plan` refuses to size pools for one machine kind from a profile of another
(`--allow-other-machine` overrides it, loudly). Torch-free: read from /proc/cpuinfo (platform elsewhere).

The identity is the vendor, the model name, the architecture and the instruction-set flags that change
how fast the project's CPU paths run; the kernel ISA `pdserve profile` selected is recorded beside them
(it follows from the flags unless PDSERVE_QUANT_ISA forced one, which the comparison also notes).
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The flags that matter: each changes which kernel path or dtype the engine runs (widest last).
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8")
# The key under a profile's "machine" facts.
PROFILE_KEY = "cpu"
QUANT_ISA_ENV = "PDSERVE_QUANT_ISA"  # kernels.quant_ops.ISA_ENV (not imported: the planner runs no kernels)


@dataclass(frozen=True)
class MachineKind:
    """What makes two machines' step times comparable."""

    vendor: str
    model_name: str
    arch: str
    flags: tuple[str, ...]  # the ISA_FLAGS this CPU has, in ISA_FLAGS order
    kernel_isa: str = ""  # the kernels `pdserve profile` ran ("avx2", "avx512_vnni", "float32", ...); "" unknown
    forced_isa: str = ""  # $PDSERVE_QUANT_ISA when it was set

    @property
    def label(self) -> str:
        isa = " ".join(f for f in self.flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")) or "no avx2"
        kern = f", kernels {self.kernel_isa}" if self.kernel_isa else ""
        return f"{self.vendor} {self.model_name} ({self.arch}: {isa}{kern})"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["flags"] = list(self.flags)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MachineKind:
        """Raises ValueError for a malformed record."""
        try:
            return cls(str(d["vendor"]), str(d["model_name"]), str(d["arch"]), tuple(str(f) for f in d["flags"]),
                       str(d.get("kernel_isa", "")), str(d.get("forced_isa", "")))
        except (KeyError, TypeError) as err:
            raise ValueError(f"profile machine record {d!r} is malformed: {err}") from None


def _cpuinfo(text: str) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo text."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if out:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            out.setdefault(key.strip().lower(), value.strip())
    return out


def this_machine(kernel_isa: str = "", cpuinfo: str | None = None) -> MachineKind:
    """This machine's kind (`cpuinfo`: /proc/cpuinfo's text, read when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    info = _cpuinfo(cpuinfo)
    have = set((info.get("flags") or info.get("features") or "").split())
    vendor = info.get("vendor_id") or info.get("cpu implementer") or platform.processor() or "unknown"
    model = info.get("model name") or info.get("cpu part") or platform.processor() or "unknown"
    return MachineKind(vendor, " ".join(model.split()), platform.machine() or "unknown",
                       tuple(f for f in ISA_FLAGS if f in have), kernel_isa,
                       os.environ.get(QUANT_ISA_ENV, "").strip().lower())


def differences(profiled: MachineKind, here: MachineKind) -> list[str]:
    """How this machine differs from the profiled one (empty: the same kind)."""
    out = []
    for name in ("vendor", "model_name", "arch"):
        a, b = getattr(profiled, name), getattr(here, name)
        if a != b:
            out.append(f"{name.replace('_', ' ')} {a!r} here {b!r}")
    lost = [f for f in profiled.flags if f not in here.flags]
    gained = [f for f in here.flags if f not in profiled.flags]
    if lost:
        out.append(f"this CPU lacks {' '.join(lost)}")
    if gained:
        out.append(f"this CPU also has {' '.join(gained)}")
    if profiled.forced_isa != here.forced_isa:
        out.append(f"{QUANT_ISA_ENV} was {profiled.forced_isa or 'unset'} when profiled, here "
                   f"{here.forced_isa or 'unset'}")
    return out


def profile_machine(machine_facts: dict[str, Any]) -> MachineKind | None:
    """The machine kind a profile's "machine" facts record; None for a profile older than the record."""
    rec = machine_facts.get(PROFILE_KEY)
    return None if rec is None else MachineKind.from_dict(rec)


def check_profile_machine(machine_facts: dict[str, Any], allow_other: bool = False,
                          here: MachineKind | None = None) -> list[str]:
    """Whether a profile applies to this machine. Returns warnings to print (an old profile without the
    record; another kind allowed by `allow_other`); raises ValueError for another kind otherwise."""
    if machine_facts.get("synthetic"):
        return []  # a hand-made cost model describes no machine
    profiled = profile_machine(machine_facts)
    if profiled is None:
        return ["the profile records no CPU kind (measured by an older pdserve): its timings are assumed to hold "
                "here; run `pdserve profile` on this machine to be sure"]
    here = here or this_machine()
    diff = differences(profiled, here)
    if not diff:
        return []
    what = (f"the profile was measured on {profiled.label}, this machine is {here.label}: {'; '.join(diff)}")
    if not allow_other:
        raise ValueError(f"{what}. Its step times do not hold here: run `pdserve profile` on this machine kind, "
                         f"or pass --allow-other-machine to plan with it anyway")
    return [f"WARNING: --allow-other-machine: {what}. Every figure below is the other machine's, not this one's"]
