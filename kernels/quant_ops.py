"""Matmuls and embedding lookups against GGUF block-quantized weights on the CPU, the weights read in place.

A decode step reads every weight once, so at 1-64 activation rows its time is the weight bytes read and
the integer dot-product rate: `QuantOps.matmul` reads a Q4_K weight's 4.5 bits per value where float32
F.linear reads 32. The kernels (csrc/cpu_quant.cpp) quantize the activation rows to int8 once per call
(per 32 values; per 256 for the K types at up to ROW_MAX_M rows) and take integer multiply-adds per group
against the weight quants, scaled into float32. By default ("int8x2", ACTIVATIONS) each activation is two
int8 terms, its rounding and the rounding of what that lost, taken by the same kernels as twice the rows
and summed: about 15 bits, 254 times closer to the float product than int8 alone, at the cost of twice
the integer work (the weight bytes are still read and decoded once per call), except that at up to
ROW_MAX_M rows the 32-value types (Q8_0, Q4_0, Q4_1, Q5_0) take the float32 activations as they are,
each weight block decoded to float32 in registers (exact up to summation order); "int8" keeps one int8
term everywhere (llama.cpp's rounding, the fastest). At 1-2 activation rows one weight row at a time decoded in
registers, at more in panels of 16 (8) rows decoded into vector lanes; see the source for the method. One binary serves every x86-64 CPU (compiled for the baseline ISA, no
-march=native); its AVX2 and AVX-512 VNNI functions carry their own target attributes, and `choose_isa`
picks the widest path this CPU has (PDSERVE_QUANT_ISA forces one). The extension is compiled on first use
(cached in cpu_ops.extension_dir(), keyed by source and flags) and loads in well under a second after.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from pdserve.kernels.cpu_ops import OnceExtension
from pdserve.kernels.quant_format import QUANT_TYPES, QuantWeight

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_quant.cpp"
# No -march=native: the binary must run on every CPU the cache may be shared with; the ISA paths carry
# their target attributes. No fused multiply-adds the source did not ask for: embedding rows must equal
# gguf's float32 roundings bit for bit.
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")

# The kernel paths, widest last (the index is the extension's ISA number).
ISAS = ("portable", "avx2", "avx512_vnni")
ISA_ENV = "PDSERVE_QUANT_ISA"
# The /proc/cpuinfo flags each path needs.
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "portable": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512_vnni": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "f16c"),
}


@dataclass(frozen=True)
class IsaChoice:
    name: str  # one of ISAS
    reason: str  # one line: why this path


def cpu_flags() -> frozenset[str]:
    """This CPU's flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def missing_flags(isa: str, flags: frozenset[str] | None = None) -> list[str]:
    """The CPU flags path `isa` needs that this CPU (or `flags`) lacks; every one off x86-64."""
    need = ISA_FLAGS[isa]
    if isa != "portable" and platform.machine().lower() not in ("x86_64", "amd64"):
        return list(need)
    have = cpu_flags() if flags is None else flags
    return [f for f in need if f not in have]


def available_isas() -> tuple[str, ...]:
    """The paths this CPU can run, widest last."""
    return tuple(isa for isa in ISAS if not missing_flags(isa))


def choose_isa(requested: str | None = None) -> IsaChoice:
    """The kernel path: `requested`, else $PDSERVE_QUANT_ISA, else "auto" (the widest this CPU has).
    Raises ValueError for an unknown name or a path whose CPU flags this CPU lacks (naming them)."""
    source = "the caller"
    if requested is None:
        requested = os.environ.get(ISA_ENV) or "auto"
        source = ISA_ENV
    requested = requested.strip().lower()
    if requested == "auto":
        best = available_isas()[-1]
        if best == "portable":
            return IsaChoice(best, f"portable: this CPU lacks {' '.join(missing_flags('avx2'))} for the avx2 path")
        wider = [isa for isa in ISAS if ISAS.index(isa) > ISAS.index(best)]
        lacks = f"; lacks {' '.join(missing_flags(wider[0]))} for {wider[0]}" if wider else ""
        return IsaChoice(best, f"{best}: this CPU has {' '.join(ISA_FLAGS[best])}{lacks}")
    if requested not in ISAS:
        raise ValueError(f"{ISA_ENV if source == ISA_ENV else 'isa'}={requested!r} is not a quant kernel path "
                         f"(auto, {', '.join(ISAS)})")
    lacking = missing_flags(requested)
    if lacking:
        raise ValueError(f"the {requested} quant kernel path needs CPU flags {' '.join(lacking)}, which this CPU "
                         f"lacks (it can run: {', '.join(available_isas())}); set {ISA_ENV}=auto")
    return IsaChoice(requested, f"{requested}: forced by {source}")


QUANT_EXTENSION = OnceExtension("CPU quant extension", SOURCE, "pdserve_cpu_quant", CFLAGS)


def load_extension() -> ModuleType:
    """Builds (first use) or loads the quant extension (see kernels.cpu_ops.OnceExtension)."""
    return QUANT_EXTENSION.load()


_TYPE_INDEX = {name: i for i, name in enumerate(QUANT_TYPES)}
# Activation rows up to which a matmul takes the row kernels (each weight row decoded in registers, in its
# own order); more take the panels (16 / 8 rows decoded into lanes, then dotted with every activation row).
# Measured crossover on Zen 4 (AVX2 and AVX-512 paths alike); at most 4 (the extension's limit).
ROW_MAX_M = 2
# How the activations are rounded (the extension's numbering): "int8x2" (default) or "int8".
ACTIVATIONS = ("int8", "int8x2")
ACTIVATIONS_ENV = "PDSERVE_QUANT_ACTIVATIONS"


def choose_activations(requested: str | None = None) -> str:
    """The activation rounding: `requested`, else $PDSERVE_QUANT_ACTIVATIONS, else "int8x2". ValueError
    for an unknown name."""
    name = (requested if requested is not None else os.environ.get(ACTIVATIONS_ENV) or "int8x2").strip().lower()
    if name not in ACTIVATIONS:
        raise ValueError(f"activations={name!r} is not a quant activation rounding ({', '.join(ACTIVATIONS)}; "
                         f"{ACTIVATIONS_ENV} sets the default)")
    return name


class QuantOps:
    """The quantized kernels on one ISA path. Construct through `create`."""

    def __init__(self, ext: ModuleType, isa: IsaChoice, activations: str = "int8x2") -> None:
        if not ext.isa_supported(ISAS.index(isa.name)):
            raise ValueError(f"the extension reports this CPU cannot run the {isa.name} path")
        self._ext = ext
        self.isa = isa
        self._isa_index = ISAS.index(isa.name)
        self.activations = choose_activations(activations)
        self._act_index = ACTIVATIONS.index(self.activations)

    @classmethod
    def create(cls, isa: str | None = None, activations: str | None = None) -> QuantOps:
        """Chooses the path (choose_isa(isa)) and the activation rounding (choose_activations) and builds
        or loads the extension: ValueError for a path this CPU lacks or an unknown rounding,
        ExtensionUnavailable when the extension can't be built."""
        choice = choose_isa(isa)
        rounding = choose_activations(activations)
        return cls(load_extension(), choice, rounding)

    def matmul(self, x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:  # [M, N] float32
        """x [M, K] float32 @ w.dequantize().T (+ bias [N]), into `out` ([M, N] float32 with unit column
        stride, e.g. a column slice of a wider output) when given. The activations are rounded to int8
        per span of 32 (256 for the K types at up to ROW_MAX_M rows), so the result differs from the
        float product by at most sum over spans of d / 2 * sum |w| (d the span's scale, max |x| / 127),
        plus float32 rounding; with "int8x2" d is the residual's scale, at most the first's / 254 (and
        at up to ROW_MAX_M rows of a 32-value type only the float32 rounding remains).
        Called for every projection of every layer at each step: the checks are few attribute reads."""
        if x.dtype is not torch.float32 or not x.is_cpu or x.dim() != 2 or x.shape[1] != w.cols:
            raise ValueError(f"x must be float32 [M, {w.cols}] on the CPU for a {w.type_name} weight "
                             f"[{w.rows}, {w.cols}], got {x.dtype} {tuple(x.shape)} on {x.device}")
        m, k = x.shape
        sx = x.stride()
        if sx[1] != 1 or sx[0] < k:
            x = x.contiguous()
            sx = (k, 1)
        n = w.rows
        if out is None:
            out = torch.empty((m, n), dtype=torch.float32)
            ldo = n
        else:
            so = out.stride()
            if (out.dtype is not torch.float32 or not out.is_cpu or out.shape != (m, n)
                    or (m and n and (so[1] != 1 or so[0] < n))):
                raise ValueError(f"out must be float32 [{m}, {n}] on the CPU with unit column stride, got "
                                 f"{out.dtype} {tuple(out.shape)} strides {so}")
            ldo = so[0]
        bias_ptr = 0
        if bias is not None:
            if bias.shape != (n,):
                raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
            if bias.dtype is not torch.float32 or not bias.is_contiguous():
                bias = bias.to(torch.float32).contiguous()
            bias_ptr = bias.data_ptr()
        self._ext.matmul(self._isa_index, _TYPE_INDEX[w.type_name], x.data_ptr(), m, sx[0], w.data.data_ptr(),
                         n, k, bias_ptr, out.data_ptr(), ldo, torch.get_num_threads(), ROW_MAX_M, self._act_index)
        return out

    def embedding(self, ids: torch.Tensor, w: QuantWeight) -> torch.Tensor:  # [T, K] float32
        """Rows `ids` ([T] int64) of w as float32, exactly dequantize()'s values. IndexError for an id
        outside the rows."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), w.cols, dtype=torch.float32)
        self._ext.embedding(_TYPE_INDEX[w.type_name], flat.data_ptr(), flat.numel(), w.data.data_ptr(), w.rows,
                            w.cols, out.data_ptr(), torch.get_num_threads())
        return out.reshape(*ids.shape, w.cols)
