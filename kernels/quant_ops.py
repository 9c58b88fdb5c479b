"""Matmuls and embedding lookups against GGUF block-quantized weights on the CPU, the weights read in place.

A decode step reads every weight once, so at 1-64 activation rows its time is the weight bytes read and
the integer dot-product rate: `QuantOps.matmul` reads a Q4_K weight's 4.5 bits per value where float32
F.linear reads 32. The kernels (csrc/cpu_quant.cpp) quantize the activation rows to int8 once per call
(per 32 values; per 256 for the K types at up to ROW_MAX_M rows) and take integer multiply-adds per group
against the weight quants, scaled into float32. By default ("int8x2", ACTIVATIONS) each activation is two
int8 terms, its rounding and the rounding of what that lost, taken by the same kernels as twice the rows
and summed: about 15 bits, 254 times closer to the float product than int8 alone, at the cost of twice
the integer work (the weight bytes are still read and decoded once per call), except that at up to
WIDE_ROW_MAX_M (8) rows the 32-value types (Q8_0, Q4_0, Q4_1, Q5_0) round each activation to one int16 term
instead (max |x| / 32767 per 32: the same precision, half the vector work of the two int8 terms, and
about twice as fast as decoding each weight to float32; each row's sums are those it gets alone), and that
from 8 rows (the extension's FLOAT_MIN_M; 9 for the 32-value types) the portable and AVX2 paths take the activations as float32, unrounded, against the panel's weights
decoded to float32 (on AVX2 FMA's rate matches the two int8 terms', so exact is also 5-30% faster; the
AVX-512 VNNI panels keep the two int8 terms); "int8" keeps one int8
term everywhere (llama.cpp's rounding, the fastest). At 1-2 activation rows (1-8 for the int16 rows) one
weight row at a time decoded in registers, at more in panels of 16 (8) rows decoded into vector lanes; see the source for the method. One binary serves every x86-64 CPU (compiled for the baseline ISA, no
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
# The same for the int16 row kernels (int8x2 activations, the 32-value types): up to 8 (the extension's
# limit). Each row's sums there are those it gets alone, so a speculative step's 1 + d rows cost little
# more than one row's weight pass and verify with one row's arithmetic.
WIDE_ROW_MAX_M = 8
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
        plus float32 rounding; with "int8x2" d is the residual's scale, at most the first's / 254 (at up
        to ROW_MAX_M rows of a 32-value type the int16 scale, max |x| / 32767; from FLOAT_MIN_M rows on
        the portable and AVX2 paths no rounding at all: the float panels).
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
                         n, k, bias_ptr, out.data_ptr(), ldo, torch.get_num_threads(), ROW_MAX_M, self._act_index, WIDE_ROW_MAX_M)
        return out

    def embedding(self, ids: torch.Tensor, w: QuantWeight) -> torch.Tensor:  # [T, K] float32
        """Rows `ids` ([T] int64) of w as float32, exactly dequantize()'s values. IndexError for an id
        outside the rows."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), w.cols, dtype=torch.float32)
        self._ext.embedding(_TYPE_INDEX[w.type_name], flat.data_ptr(), flat.numel(), w.data.data_ptr(), w.rows,
                            w.cols, out.data_ptr(), torch.get_num_threads())
        return out.reshape(*ids.shape, w.cols)


@dataclass(frozen=True)
class StackProjection:
    """One projection of a decoder layer as the fused decode step reads it: its row groups in output
    order (each of one block type) and its float32 bias."""

    groups: tuple[QuantWeight, ...]
    bias: torch.Tensor | None  # [N] float32, contiguous


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer: the norms' float32 weights and the four projections."""

    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    q_norm: torch.Tensor | None  # [D] (Qwen3's QK norms), else None
    k_norm: torch.Tensor | None
    qkv: StackProjection  # rows q | k | v
    o: StackProjection
    gate_up: StackProjection  # rows gate | up
    down: StackProjection


# Row groups one projection of the fused step may have (the extension's MAX_GROUPS).
STACK_MAX_GROUPS = 8
# KV cache dtypes the fused step reads and writes (element bytes for the extension).
STACK_KV_DTYPES = {torch.float32: 4, torch.bfloat16: 2}


class DecodeStack:
    """A Llama-style decoder stack whose decode-only steps run in one call of the extension
    (`decode_layers`): each layer's norms, projections, RoPE, K/V stores, paged attention and gated MLP
    with no Python or op dispatch between them, on one team of threads. Built once from the weights; the
    tensors it was built from must stay alive and unchanged (it keeps references to them). Numerics:
    float32 throughout, the projections by the same kernels as `QuantOps.matmul`; norms, softmax and
    SiLU in their own vector code (equal to the unfused ops up to float32 rounding order)."""

    def __init__(self, qops: QuantOps, layers: list[StackLayer], final_norm: torch.Tensor, *, num_heads: int,
                 num_kv_heads: int, head_dim: int, intermediate_size: int, eps: float, scale: float) -> None:
        self.qops = qops
        self.num_layers = len(layers)
        self.hidden = final_norm.shape[0]
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.intermediate_size, self.eps, self.scale = intermediate_size, eps, scale
        keep: list[torch.Tensor] = [final_norm]
        words: list[int] = []

        def addr(t: torch.Tensor | None) -> int:
            if t is None:
                return 0
            if t.dtype is not torch.float32 or not t.is_contiguous() or not t.is_cpu:
                raise ValueError(f"the fused decode step takes contiguous float32 CPU tensors, got {t.dtype}")
            keep.append(t)
            return t.data_ptr()

        for layer in layers:
            words += [addr(layer.input_norm), addr(layer.post_norm), addr(layer.q_norm), addr(layer.k_norm)]
            for proj in (layer.qkv, layer.o, layer.gate_up, layer.down):
                if not 1 <= len(proj.groups) <= STACK_MAX_GROUPS:
                    raise ValueError(f"a projection has {len(proj.groups)} row groups (1 to {STACK_MAX_GROUPS})")
                words += [len(proj.groups), addr(proj.bias)]
                for g in proj.groups:
                    keep.append(g.data)
                    words += [_TYPE_INDEX[g.type_name], g.data.data_ptr(), g.rows]
        self._final_norm = addr(final_norm)
        self._plan = torch.tensor(words, dtype=torch.int64)
        self._keep = keep

    def run(
        self,
        h: torch.Tensor,  # [B, H] float32: the tokens' embeddings; becomes the residual stream
        positions: torch.Tensor,  # [B] int64
        slot_mapping: torch.Tensor,  # [B] int64, -1: not stored
        block_tables: torch.Tensor,  # [B, MB] int32
        context_lens: torch.Tensor,  # [B] int32, including the new token
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D] float32 or bfloat16
        cos: torch.Tensor,  # [P, D] float32 RoPE table
        sin: torch.Tensor,  # [P, D] float32, first half negated
    ) -> torch.Tensor:  # [B, H] float32: the final norm of the residual stream
        """One decode step of B sequences through every layer. Changes h, and the KV cache only at the
        slots given; raises ValueError / IndexError for inputs out of range (checked in the extension
        before any write)."""
        if kv_cache.dtype not in STACK_KV_DTYPES or not kv_cache.is_contiguous():
            raise ValueError(f"the fused decode step takes a contiguous float32 or bfloat16 KV cache, got {kv_cache.dtype}")
        nl, two, nb, bs, hkv, d = kv_cache.shape
        if (nl, two, hkv, d) != (self.num_layers, 2, self.num_kv_heads, self.head_dim):
            raise ValueError(f"KV cache {tuple(kv_cache.shape)} does not fit the stack")
        b = h.shape[0]
        if h.dtype is not torch.float32 or h.shape != (b, self.hidden) or not h.is_contiguous():
            raise ValueError(f"h must be contiguous float32 [B, {self.hidden}], got {h.dtype} {tuple(h.shape)}")
        pos = positions.to(torch.int64).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        ctx = context_lens.to(torch.int32).contiguous()
        if pos.shape != (b,) or slots.shape != (b,) or ctx.shape != (b,) or tables.dim() != 2 or tables.shape[0] != b:
            raise ValueError("positions, slot_mapping, context_lens [B] and block_tables [B, MB] must match h")
        cos, sin = cos.contiguous(), sin.contiguous()
        if cos.dtype is not torch.float32 or sin.dtype is not torch.float32 or cos.shape[1] != d or sin.shape != cos.shape:
            raise ValueError("the RoPE tables must be float32 [P, D]")
        out = torch.empty_like(h)
        q = self.qops
        q._ext.decode_layers(
            q._isa_index, q._act_index, torch.get_num_threads(), self._plan.data_ptr(), self._plan.numel(),
            self.num_layers, self.hidden, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size,
            self.eps, self.scale, self._final_norm, h.data_ptr(), out.data_ptr(), b, pos.data_ptr(),
            slots.data_ptr(), tables.data_ptr(), tables.shape[1], ctx.data_ptr(), kv_cache.data_ptr(),
            STACK_KV_DTYPES[kv_cache.dtype], nb, bs, cos.data_ptr(), sin.data_ptr(), cos.shape[0], ROW_MAX_M,
            WIDE_ROW_MAX_M)
        return out
