"""The CPU fast path: paged decode attention in a small C++/OpenMP extension that reads K/V blocks in place.

`TorchOps` gathers each chunk of sequences' K/V into a contiguous float32 copy before the fused attention
kernel reads it; at decode, where every step reads the whole context once, that copy (and the float32
conversion of a half-precision KV cache) costs more than the attention itself. `CpuOps` keeps TorchOps for
prefill (dominated by its matmuls) and the KV movement, and attends decode batches with
`csrc/cpu_attention.cpp`: one work item per (sequence, KV head, context split) walks the block table,
converts each K/V row to float32 once for the G query heads of its KV head, and keeps an online softmax
in float32. bfloat16 and fp8 pools at head dims 64 and 128 on AVX512-BF16 CPUs take 16 tokens at a time
(VDPBF16PS scores reduced by one transpose-and-add tree, fp8 rows widened to bfloat16 by table lookup);
other AVX-512 builds hold head dims 64 and 128 in registers; other head dims and machines take a
compiler-vectorized loop. Pools may be float32, bfloat16, float16, float8_e5m2 or float8_e4m3fn (one byte
per element, half the DRAM traffic of bf16; widened exactly, see the source). `build_extension` also
builds other versions of the source (the benches time an earlier revision's kernel against this one).

The extension is compiled on first use with `torch.utils.cpp_extension` (g++ and ninja, about 30 s) for
this machine's instruction set, and cached (`extension_dir`) keyed by source, flags and CPU; later loads
take well under a second.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from pdserve.kernels.checks import KV_DTYPES, check_cache_pair, check_dim, check_dtype, check_gqa, check_rank
from pdserve.kernels.torch_ops import TorchOps

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_attention.cpp"
CFLAGS = ("-O3", "-march=native", "-fopenmp")
# Work items per thread below which a decode batch's contexts are split (and merged by log-sum-exp),
# so a few long sequences still keep every core busy.
MIN_ITEMS_PER_THREAD = 4


class ExtensionUnavailable(RuntimeError):
    """The C++ extension could not be built or loaded here (no compiler, no ninja, a build error)."""


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags (a shared cache must not serve a build
    for another CPU)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def extension_dir() -> Path:
    """$TORCH_EXTENSIONS_DIR, else torch_extensions/ under $PDSERVE_CACHE_DIR or ~/.cache/pdserve."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve") / "torch_extensions"


class OnceExtension:
    """One C++ extension of this package, built (or loaded from the cache) at first use; the outcome, the
    module or the build's complaint, is remembered for the process, so a machine without a compiler
    pays for one failed build, not one per call."""

    def __init__(self, what: str, source: Path, prefix: str, cflags: tuple[str, ...] = CFLAGS) -> None:
        self.what, self.source, self.prefix, self.cflags = what, source, prefix, cflags
        self._lock = threading.Lock()
        self._loaded: ModuleType | None = None
        self._error: ExtensionUnavailable | None = None

    def load(self) -> ModuleType:
        """The module; raises ExtensionUnavailable with the compiler's complaint when it can't be built."""
        with self._lock:
            if self._loaded is not None:
                return self._loaded
            if self._error is not None:
                raise self._error
            try:
                self._loaded = build_extension(self.source.read_bytes(), self.prefix, self.cflags, self.source.name)
            except Exception as e:  # noqa: BLE001 - any build failure means "not here"; keep the reason
                self._error = ExtensionUnavailable(f"the {self.what} could not be built in {extension_dir()}: "
                                                   f"{type(e).__name__}: {str(e)[-600:]}")
                raise self._error from e
            return self._loaded


ATTENTION_EXTENSION = OnceExtension("CPU attention extension", SOURCE, "pdserve_cpu_attention")


def load_extension() -> ModuleType:
    """Builds (first use on this machine) or loads the attention extension (see OnceExtension)."""
    return ATTENTION_EXTENSION.load()


def build_extension(source: bytes, prefix: str, cflags: tuple[str, ...] = CFLAGS,
                    filename: str = "cpu_attention.cpp") -> ModuleType:
    """Builds (or loads the cached build of) the extension from `source` (the C++ text, written to
    `filename`) with `cflags` in a directory of extension_dir() named by `prefix` and a digest of source,
    flags and CPU. Raises what the build raises."""
    from torch.utils.cpp_extension import load

    key = hashlib.sha256(source + " ".join(cflags).encode() + _cpu_signature().encode())
    name = f"{prefix}_{key.hexdigest()[:12]}"
    build = extension_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    src = build / filename
    if not src.exists() or src.read_bytes() != source:
        src.write_bytes(source)
    # torch's own build lock is a plain file its waiters poll: a builder killed mid-build (a node
    # SIGKILLed, Ctrl-C during the first start) leaves it behind and every later start waits
    # forever. An flock, which the kernel releases with its holder, guards the build instead,
    # and under it a leftover torch lock can only be a dead builder's.
    with open(build / "pdserve-build.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        return load(name=name, sources=[str(src)], extra_cflags=list(cflags), extra_ldflags=["-fopenmp"],
                    build_directory=str(build), verbose=False)


@dataclass(frozen=True)
class DecodePlan:
    """A decode batch as the extension reads it: int32 tables and lengths, and how many splits per
    sequence."""

    geometry: tuple[int, int, int, int, torch.dtype, torch.device]  # (NB, BS, Hkv, D, dtype, device)
    block_tables: torch.Tensor  # [B, MB] int32, contiguous
    context_lens: torch.Tensor  # [B] int32, contiguous
    splits: int
    q_shape: tuple[int, int, int]  # [B, Hq, D] of the queries the plan was made for (checked then)


def _pool_rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [N, Hkv, D]
    """`t` in the KV cache's dtype with each token's Hkv * D elements contiguous, as the extension's store reads
    them; no copy when it already is (the model's K/V: strided views of the fused projection)."""
    t = t.to(dtype)
    return t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()


class CpuOps(TorchOps):
    """TorchOps with decode attention in the C++ extension (TorchOps.decode_attention reaches it through
    `plan` / `attend_planned`). Construct through `create`, which builds or loads the extension first."""

    name = "cpu"

    def __init__(self, ext: ModuleType, **torch_ops_args: object) -> None:
        super().__init__(**torch_ops_args)  # type: ignore[arg-type]
        self._ext = ext
        self._norm_lanes = _torch_sum_lanes(ext)

    @classmethod
    def create(cls) -> CpuOps:
        return cls(load_extension())

    def store_kv(
        self,
        key: torch.Tensor,  # [N, Hkv, D]
        value: torch.Tensor,  # [N, Hkv, D]
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        slot_mapping: torch.Tensor,  # [N]; -1 = skip
    ) -> None:
        """As TorchOps.store_kv (fp8 pools: rounded by torch's conversion, then copied as bytes), in one
        extension call: writes only the slots' rows of both caches. The extension checks every argument
        (a slot outside the KV cache: RuntimeError) before it writes; a malformed cache pair or slot mapping
        is then named by the ValueError of the shared checks."""
        if k_cache.device.type != "cpu":
            return super().store_kv(key, value, k_cache, v_cache, slot_mapping)
        try:
            self._ext.store_kv(_pool_rows(key, k_cache.dtype), _pool_rows(value, k_cache.dtype), k_cache, v_cache,
                               slot_mapping.contiguous())
        except RuntimeError:
            check_cache_pair(k_cache, v_cache)
            check_rank("slot_mapping", slot_mapping, 1, "[N]")
            raise

    def plan(
        self,
        q: torch.Tensor,  # [T, Hq, D]; only its shape is read
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]; only its geometry is read
        block_tables: torch.Tensor,  # [B, MB]
        context_lens: torch.Tensor,  # [B]
        cu_seqlens_q: torch.Tensor | None = None,
    ) -> object:
        """Decode batches get a DecodePlan (int32 views and the split count), prefill batches TorchOps'
        AttentionPlan. Changes nothing."""
        if cu_seqlens_q is not None or k_cache.device.type != "cpu":
            return super().plan(q, k_cache, block_tables, context_lens, cu_seqlens_q)
        check_rank("k_cache", k_cache, 4, "[NB, BS, Hkv, D]")
        check_dtype("k_cache", k_cache, KV_DTYPES)
        nb, bs, hkv, d = k_cache.shape
        check_rank("q", q, 3, "[B, Hq, D]")
        check_gqa(q.shape[1], hkv)
        check_dim("q", q, 2, d, "head dim of the cache")
        b = block_tables.shape[0]
        check_dim("q", q, 0, b, "sequences of the block tables")
        items = max(1, b * hkv)
        want = MIN_ITEMS_PER_THREAD * torch.get_num_threads()
        splits = max(1, min(-(-want // items), block_tables.shape[1])) if items < want else 1
        return DecodePlan((nb, bs, hkv, d, k_cache.dtype, k_cache.device),
                          block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous(),
                          splits, tuple(q.shape))

    def attend_planned(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        plan: object,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D] in q.dtype
        """Decode plans run in the extension, others in TorchOps. Changes nothing outside the result.
        Called once per layer: the plan checked q and the cache geometry when it was made, so here a few
        comparisons with the plan stand for those checks (the full ones run only to name a mismatch), and
        the extension takes q in its own dtype and returns the result in it (the same conversions)."""
        if not isinstance(plan, DecodePlan):
            return super().attend_planned(q, k_cache, v_cache, plan, scale)  # type: ignore[arg-type]
        if (q.shape != plan.q_shape or k_cache.shape != plan.geometry[:4] or k_cache.dtype != plan.geometry[4]
                or k_cache.device != plan.geometry[5] or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype):
            _explain_plan_mismatch(q, k_cache, v_cache, plan)
        if q.shape[0] == 0:
            return torch.empty_like(q)
        return self._ext.paged_decode(q, k_cache, v_cache, plan.block_tables, plan.context_lens, float(scale),
                                      plan.splits)  # [B, Hq, D] in q.dtype

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """As KernelOps.rotary (the same bits), in one extension call for float32 and bfloat16 on a CPU."""
        if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.stride(-1) != 1:
            return super().rotary(x, cos, sin)
        return self._ext.rotary(x, cos, sin)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 add: torch.Tensor | None = None) -> torch.Tensor:
        """As KernelOps.rms_norm (the same bits), in one extension call for float32 rows [T, H] and float32,
        bfloat16 or float16 weights on a CPU: the add, the sum of squares in the order torch's sum kernel
        takes (see `_torch_sum_lanes`), the scale and the roundings in one pass over each row. Other shapes
        take the torch ops."""
        if (self._norm_lanes is None or x.device.type != "cpu"
                or weight.dtype not in (torch.bfloat16, torch.float16, torch.float32)
                or x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1):
            return super().rms_norm(x, weight, eps, add)
        if add is not None and (add.dim() != 2 or add.stride(-1) != 1 or add.dtype not in (torch.float32, weight.dtype)):
            add = add.to(torch.float32).contiguous()
        return self._ext.rms_norm_half(x, add, weight, float(eps), self._norm_lanes)  # checks weight's layout

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """As KernelOps.silu_mul, in one extension call for bfloat16 / float16 rows [T, 2I] on a CPU."""
        if (gate_up.device.type != "cpu" or gate_up.dtype not in (torch.bfloat16, torch.float16) or gate_up.dim() != 2
                or gate_up.stride(-1) != 1):
            return super().silu_mul(gate_up)
        return self._ext.silu_mul(gate_up)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """As KernelOps.argmax (the same indices), rows in parallel, for float32 rows on a CPU."""
        if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0:
            return super().argmax(x)
        return self._ext.argmax_rows(x.contiguous())

    def topk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As KernelOps.topk (the same values; of equal values at the k-th place the lowest index), for
        float32 rows on a CPU: one pass per row that skips, 16 at a time, values below the current k-th.
        Rows holding a NaN go to torch.topk."""
        if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or not 1 <= k <= x.shape[1]:
            return super().topk(x, k)
        values, indices = self._ext.topk_rows(x.contiguous(), k)
        return (values, indices) if values.numel() else super().topk(x, k)


def _torch_sum_lanes(ext: ModuleType) -> int | None:
    """The vector width (8 or 16 lanes) at which the extension's sums of squares equal torch's
    x.pow(2).sum(-1) bit for bit on this CPU (torch's reduction kernels pick their width when they load),
    checked over rows of several widths; None if neither does, and the norm then takes the torch ops."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(4, n, generator=gen) * 3 for n in (576, 2048, 64, 100, 960, 7, 33)]  # [4, n] float32
    for lanes in (8, 16):
        if all(torch.equal(ext.sum_sq_rows(x, lanes), x.pow(2).sum(-1)) for x in rows):
            return lanes
    log.info("the CPU extension's row sums do not match torch's on this CPU; RMSNorm takes the torch ops")
    return None


def _explain_plan_mismatch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan) -> None:
    """Raises the ValueError that says how q or the caches differ from what `plan` was made for."""
    check_cache_pair(k_cache, v_cache)
    check_rank("q", q, 3, "[B, Hq, D]")
    nb, bs, hkv, d = k_cache.shape
    check_gqa(q.shape[1], hkv)
    check_dim("q", q, 2, d, "head dim of the cache")
    check_dim("q", q, 0, plan.block_tables.shape[0], "sequences of the plan")
    if plan.geometry != (nb, bs, hkv, d, k_cache.dtype, k_cache.device):
        raise ValueError(f"the plan was made for a cache of (NB, BS, Hkv, D, dtype, device) {plan.geometry}, "
                         f"got {(nb, bs, hkv, d, k_cache.dtype, k_cache.device)}")
    raise ValueError(f"the plan was made for queries of shape {plan.q_shape}, got {tuple(q.shape)}")
