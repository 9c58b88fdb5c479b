"""GPU check of the Triton kernels: compile and run each, compare with the float32 references at real
sizes, and time them against the card's own copy bandwidth.

    python bench/gpu_check.py --out DIR            # on a CUDA machine (what bench/gpu_check.sh runs)
    TRITON_INTERPRET=1 python bench/gpu_check.py --quick --device cpu --out /tmp/x   # smoke test on CPU

Each phase runs on its own: a failure is recorded (with its traceback) and the next phase still runs.
Writes DIR/kernels.md (a report section) and DIR/kernels.json, and exits non-zero if any phase failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.kernels import reference as ref  # noqa: E402
from pdserve.kernels.testing import PagedProblem, make_paged_problem, tolerance  # noqa: E402
from pdserve.kernels.torch_ops import TorchOps  # noqa: E402


@dataclass
class Phase:
    name: str
    ok: bool = True
    seconds: float = 0.0
    lines: list[str] = field(default_factory=list)  # markdown, one table row or sentence each
    error: str | None = None


@dataclass(frozen=True)
class AttnCase:
    label: str
    lens: list[int]
    hq: int
    hkv: int
    d: int
    bs: int
    dtype: torch.dtype
    q_lens: list[int] | None = None  # None: decode
    splits: tuple[int | None, ...] = (None,)


@dataclass(frozen=True)
class Sizes:
    decode_checks: list[AttnCase]
    prefill_checks: list[AttnCase]
    decode_timings: list[AttnCase]
    prefill_timings: list[AttnCase]
    pool: tuple[int, int, int, int, int]  # L, NB, BS, Hkv, D of the pack/unpack timing pool
    pack_blocks: int
    copy_bytes: int
    reps: int


def _ragged(n: int, lo: int, hi: int, bs: int, seed: int) -> list[int]:
    """n lengths in [lo, hi], always including 1 and one ending exactly on a block boundary."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    lens[0] = 1
    if n > 1:
        lens[1] = max(bs, (hi // bs) * bs)
    return lens


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

REAL = Sizes(
    decode_checks=[
        AttnCase("bf16 Hq32/Hkv8 D128 BS16, 48 seqs to 4k", _ragged(48, 1, 4096, 16, 1), 32, 8, 128, 16, BF16,
                 splits=(None, 7)),
        AttnCase("fp16 Hq16/Hkv2 D64 BS32, to 20k", [20000, 9000, 1, 3200], 16, 2, 64, 32, FP16, splits=(None, 1)),
        AttnCase("fp32 Hq12/Hkv12 D80 BS8, 16 seqs to 1k", _ragged(16, 1, 1000, 8, 2), 12, 12, 80, 8, FP32),
        AttnCase("fp32 engine shape Hq6/Hkv2 D64 BS16", _ragged(64, 100, 800, 16, 3), 6, 2, 64, 16, FP32),
    ],
    prefill_checks=[
        AttnCase("bf16 Hq32/Hkv8 D128 BS16", [1500, 700, 33, 1, 64], 32, 8, 128, 16, BF16,
                 q_lens=[1500, 200, 33, 1, 17]),
        AttnCase("fp16 Hq16/Hkv2 D80 BS32", [900, 300], 16, 2, 80, 32, FP16, q_lens=[400, 300]),
        AttnCase("fp32 Hq6/Hkv2 D64 BS16", [517, 64, 2], 6, 2, 64, 16, FP32, q_lens=[517, 1, 2]),
    ],
    decode_timings=[
        AttnCase("B=64 ctx 1k-4k Hq32/Hkv8 D128 bf16", _ragged(64, 1024, 4096, 16, 4), 32, 8, 128, 16, BF16,
                 splits=(None, 1, 2, 4)),
        AttnCase("B=256 ctx 512-2k Hq32/Hkv8 D128 bf16", _ragged(256, 512, 2048, 16, 5), 32, 8, 128, 16, BF16),
        AttnCase("B=4 ctx 32k Hq32/Hkv8 D128 bf16", [32768] * 4, 32, 8, 128, 16, BF16, splits=(None, 1, 64)),
        AttnCase("B=64 ctx 100-800 Hq6/Hkv2 D64 bf16 (engine)", _ragged(64, 100, 800, 16, 6), 6, 2, 64, 16, BF16),
    ],
    prefill_timings=[
        AttnCase("4 prompts x 2048 new, Hq32/Hkv8 D128 bf16", [2048] * 4, 32, 8, 128, 16, BF16, q_lens=[2048] * 4),
        AttnCase("2048 new after 6144 cached, bf16", [8192], 32, 8, 128, 16, BF16, q_lens=[2048]),
    ],
    pool=(32, 2048, 16, 8, 128),
    pack_blocks=512,
    copy_bytes=1 << 30,
    reps=20,
)

QUICK = Sizes(
    decode_checks=[
        AttnCase("bf16 Hq4/Hkv2 D32 BS8", [1, 16, 37], 4, 2, 32, 8, BF16, splits=(None, 3)),
        AttnCase("fp32 Hq3/Hkv1 D40 BS16", [5, 33], 3, 1, 40, 16, FP32),
    ],
    prefill_checks=[AttnCase("fp16 Hq4/Hkv2 D32 BS8", [20, 9], 4, 2, 32, 8, FP16, q_lens=[20, 3])],
    decode_timings=[AttnCase("tiny decode", [40, 70], 4, 2, 32, 16, FP32, splits=(None, 1))],
    prefill_timings=[AttnCase("tiny prefill", [40], 4, 2, 32, 16, FP32, q_lens=[40])],
    pool=(2, 40, 8, 2, 32),
    pack_blocks=6,
    copy_bytes=1 << 20,
    reps=2,
)


class Timer:
    """Median milliseconds of a callable: CUDA events on a GPU, wall clock elsewhere."""

    def __init__(self, device: torch.device, reps: int) -> None:
        self.device = device
        self.reps = reps

    def __call__(self, fn: Callable[[], object]) -> float:
        fn()
        self._sync()
        samples = []
        for _ in range(self.reps):
            if self.device.type == "cuda":
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                stop.record()
                stop.synchronize()
                samples.append(start.elapsed_time(stop))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _problem(case: AttnCase, device: torch.device, seed: int, poison: bool = True) -> PagedProblem:
    return make_paged_problem(case.lens, case.hq, case.hkv, case.d, case.bs, case.dtype, device=device,
                              q_lens=case.q_lens, seed=seed, poison_unused=poison)


def _kv_bytes(case: AttnCase) -> int:
    """Bytes a decode step must read: each context's keys and values once (queries/outputs are tiny)."""
    elt = torch.empty(0, dtype=case.dtype).element_size()
    return sum(case.lens) * case.hkv * case.d * 2 * elt


class Check:
    """Runs the phases and collects the report."""

    def __init__(self, device: torch.device, sizes: Sizes) -> None:
        self.device = device
        self.sizes = sizes
        self.timer = Timer(device, sizes.reps)
        self.phases: list[Phase] = []
        self.copy_gbps: float | None = None
        self.triton = None  # kernels.triton_ops.TritonOps, set by the compile phase

    def run(self, name: str, fn: Callable[[Phase], None]) -> None:
        phase = Phase(name)
        print(f"=== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            fn(phase)
        except Exception:  # a phase failure is data for the report, not the end of the check
            phase.ok = False
            phase.error = traceback.format_exc()
            print(phase.error, flush=True)
        phase.seconds = time.perf_counter() - t0
        for line in phase.lines:
            print("   ", line, flush=True)
        print(f"--- {name}: {'ok' if phase.ok else 'FAILED'} in {phase.seconds:.1f} s", flush=True)
        self.phases.append(phase)

    # -- phases ---------------------------------------------------------------------------------
    def environment(self, phase: Phase) -> None:
        import triton

        phase.lines.append(f"torch {torch.__version__}, triton {triton.__version__}, python {sys.version.split()[0]}")
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            phase.lines.append(f"{props.name}: {props.multi_processor_count} SMs, "
                               f"{props.total_memory / 2**30:.0f} GiB")
        n = self.sizes.copy_bytes // 2
        src = torch.ones(n, dtype=torch.bfloat16, device=self.device)
        dst = torch.empty_like(src)
        ms = self.timer(lambda: dst.copy_(src))
        self.copy_gbps = 2 * self.sizes.copy_bytes / ms / 1e6  # read + write
        phase.lines.append(f"device copy of {self.sizes.copy_bytes / 2**30:.2f} GiB: {ms:.3f} ms = "
                           f"{self.copy_gbps:.0f} GB/s (read + write)")

    def compile(self, phase: Phase) -> None:
        from pdserve.kernels import get_kernel_ops

        ops = get_kernel_ops("triton", self.device)
        self.triton = ops
        case = AttnCase("warm-up", [3, 40], 8, 2, 128, 16, BF16, q_lens=[3, 9])
        p = _problem(case, self.device, seed=0)
        calls: dict[str, Callable[[], object]] = {
            "store_kv": lambda: ops.store_kv(p.q[:, :2], p.q[:, :2], p.k_cache, p.v_cache,
                                             torch.full((p.q.shape[0],), -1, device=self.device)),
            "decode (1 split)": lambda: ops.decode_attention(p.q[:2].contiguous(), p.k_cache, p.v_cache,
                                                             p.block_tables, p.context_lens, p.scale),
            "prefill": lambda: ops.prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.cu_seqlens_q,
                                                     p.context_lens, p.scale),
        }
        from pdserve.kernels.triton_decode import paged_decode_attention

        calls["decode (split + merge)"] = lambda: paged_decode_attention(
            p.q[:2].contiguous(), p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale, num_splits=2)
        pool = torch.zeros(1, 2, 4, 16, 2, 128, dtype=BF16, device=self.device)  # [L, 2, NB, BS, Hkv, D]
        calls["pack"] = lambda: ops.pack_blocks(pool, torch.tensor([2, 0], device=self.device))
        calls["unpack"] = lambda: ops.unpack_blocks(torch.ones(1, 2, 2, 16, 2, 128, dtype=BF16, device=self.device),
                                                    pool, torch.tensor([3, 1], device=self.device))
        phase.lines.append("| kernel | first call (compile + run) |")
        phase.lines.append("| --- | --- |")
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            phase.lines.append(f"| {name} | {time.perf_counter() - t0:.2f} s |")

    def correctness(self, phase: Phase) -> None:
        ops = self._ops()
        from pdserve.kernels.triton_decode import paged_decode_attention

        phase.lines.append("| case | path | max abs err | tolerance (atol, rtol) | result |")
        phase.lines.append("| --- | --- | --- | --- | --- |")

        def record(label: str, path: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
            tol = tolerance(dtype)
            err = (got.float() - want).abs().max().item() if got.numel() else 0.0
            ok = bool(torch.isfinite(got.float()).all()) and torch.allclose(got.float(), want, **tol)
            phase.ok &= ok
            phase.lines.append(f"| {label} | {path} | {err:.2e} | {tol['atol']:.1e}, {tol['rtol']:.1e} | "
                               f"{'pass' if ok else 'FAIL'} |")

        for i, case in enumerate(self.sizes.decode_checks):
            p = _problem(case, self.device, seed=10 + i)
            want = ref.decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)
            for splits in case.splits:
                got = paged_decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale,
                                             num_splits=splits)
                record(case.label, f"decode splits={splits or 'auto'}", got, want, case.dtype)
            if i == len(self.sizes.decode_checks) - 1:
                got = TorchOps().decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens,
                                                  p.scale)
                record(case.label, "torch path on this device", got, want, case.dtype)
        for i, case in enumerate(self.sizes.prefill_checks):
            p = _problem(case, self.device, seed=20 + i)
            want = ref.prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.cu_seqlens_q, p.context_lens,
                                         p.scale)
            got = ops.prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.cu_seqlens_q, p.context_lens,
                                        p.scale)
            record(case.label, "prefill", got, want, case.dtype)

        self._check_store(phase, ops)
        self._check_blocks(phase, ops)

    def _check_store(self, phase: Phase, ops: object) -> None:
        gen = torch.Generator(device=self.device).manual_seed(30)
        nb, bs, h, d = 64, 16, 8, 128
        for key_dtype in (BF16, FP32):
            k_cache = torch.randn(nb, bs, h, d, generator=gen, device=self.device).to(BF16)
            v_cache = torch.randn(nb, bs, h, d, generator=gen, device=self.device).to(BF16)
            n = 700
            slots = torch.randperm(nb * bs, generator=gen, device=self.device)[:n]
            slots[::7] = -1
            key = torch.randn(n, h, d, generator=gen, device=self.device).to(key_dtype)
            value = torch.randn(n, h, d, generator=gen, device=self.device).to(key_dtype)
            k_want, v_want = k_cache.clone(), v_cache.clone()
            ref.store_kv(key, value, k_want, v_want, slots.cpu())
            ops.store_kv(key, value, k_cache, v_cache, slots)  # type: ignore[attr-defined]
            if self.device.type == "cpu" and key_dtype != BF16:
                # Triton's CPU interpreter rounds float32 -> bfloat16 toward zero; GPUs round to nearest.
                ok = torch.allclose(k_cache, k_want, atol=0, rtol=2**-7) and torch.allclose(
                    v_cache, v_want, atol=0, rtol=2**-7)
            else:
                ok = torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)
            phase.ok &= ok
            phase.lines.append(f"| store_kv {n} tokens ({str(key_dtype)[6:]} into bf16) | triton | exact | - | "
                               f"{'pass' if ok else 'FAIL'} |")

    def _check_blocks(self, phase: Phase, ops: object) -> None:
        gen = torch.Generator(device=self.device).manual_seed(31)
        src = torch.randn(4, 2, 300, 16, 8, 128, generator=gen, device=self.device).to(BF16)
        dst = torch.randn(4, 2, 500, 16, 8, 128, generator=gen, device=self.device).to(BF16)
        src_ids = torch.randperm(300, generator=gen, device=self.device)[:40]
        dst_ids = torch.randperm(500, generator=gen, device=self.device)[:40]
        for layer in (None, 2):
            buf = ops.pack_blocks(src, src_ids, layer)  # type: ignore[attr-defined]
            want = ref.pack_blocks(src, src_ids.tolist(), layer)
            expected = dst.clone()
            ref.unpack_blocks(want, expected, dst_ids.tolist(), layer)
            ops.unpack_blocks(buf, dst, dst_ids, layer)  # type: ignore[attr-defined]
            back = ops.pack_blocks(dst, dst_ids, layer)  # type: ignore[attr-defined]
            ok = torch.equal(buf, want) and torch.equal(dst, expected) and torch.equal(back, want)
            phase.ok &= ok
            phase.lines.append(f"| pack -> unpack -> pack, 40 blocks, layer={layer} | triton | exact | - | "
                               f"{'pass' if ok else 'FAIL'} |")

    def decode_bandwidth(self, phase: Phase) -> None:
        phase.lines.append("| case | splits | time | KV read | achieved | of copy bandwidth |")
        phase.lines.append("| --- | --- | --- | --- | --- | --- |")
        for i, case in enumerate(self.sizes.decode_timings):
            self._time_decode(phase, case, seed=40 + i, with_torch=i == 0)

    def _time_decode(self, phase: Phase, case: AttnCase, seed: int, with_torch: bool) -> None:
        from pdserve.kernels.triton_decode import paged_decode_attention

        p = _problem(case, self.device, seed=seed, poison=False)
        nbytes = _kv_bytes(case)
        for splits in case.splits:
            ms = self.timer(lambda s=splits: paged_decode_attention(
                p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale, num_splits=s))
            gbps = nbytes / ms / 1e6
            share = f"{100 * gbps / self.copy_gbps:.0f}%" if self.copy_gbps else "-"
            phase.lines.append(f"| {case.label} | {splits or 'auto'} | {ms:.3f} ms | {nbytes / 1e6:.0f} MB | "
                               f"{gbps:.0f} GB/s | {share} |")
        if with_torch:
            torch_ops = TorchOps()
            ms = self.timer(lambda: torch_ops.decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables,
                                                               p.context_lens, p.scale))
            phase.lines.append(f"| {case.label} | torch path (gather + SDPA) | {ms:.3f} ms | "
                               f"{nbytes / 1e6:.0f} MB | {nbytes / ms / 1e6:.0f} GB/s | - |")

    def prefill_throughput(self, phase: Phase) -> None:
        ops = self._ops()
        phase.lines.append("| case | time | attention TFLOP/s |")
        phase.lines.append("| --- | --- | --- |")
        for i, case in enumerate(self.sizes.prefill_timings):
            p = _problem(case, self.device, seed=50 + i, poison=False)
            assert case.q_lens is not None
            # pairs (query, visible key) summed over sequences; 2 matmuls x 2 flops per multiply-add
            pairs = sum(ql * (n - ql) + ql * (ql + 1) // 2 for n, ql in zip(case.lens, case.q_lens, strict=True))
            flops = 4 * pairs * case.hq * case.d
            ms = self.timer(lambda p=p: ops.prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables,
                                                              p.cu_seqlens_q, p.context_lens, p.scale))
            phase.lines.append(f"| {case.label} | {ms:.3f} ms | {flops / ms / 1e9:.1f} |")

    def pack_unpack(self, phase: Phase) -> None:
        ops = self._ops()
        layers, nb, bs, h, d = self.sizes.pool
        pool = torch.zeros(layers, 2, nb, bs, h, d, dtype=BF16, device=self.device)
        other = torch.zeros_like(pool)
        gen = torch.Generator(device=self.device).manual_seed(60)
        n = self.sizes.pack_blocks
        ids = torch.randperm(nb, generator=gen, device=self.device)[:n]
        dst_ids = torch.randperm(nb, generator=gen, device=self.device)[:n]
        buf = ops.pack_blocks(pool, ids)  # type: ignore[attr-defined]
        size = buf.numel() * buf.element_size()
        flat = torch.empty_like(buf)
        dense_src = pool[:, :, :n]
        torch_ops = TorchOps()
        one = layers // 2
        layer_buf = ops.pack_blocks(pool, ids, one)  # type: ignore[attr-defined]
        rows: list[tuple[str, Callable[[], object], int]] = [
            ("plain device copy (same bytes, contiguous)", lambda: flat.copy_(buf), size),
            ("plain copy of the first n blocks (strided view)", lambda: flat.copy_(dense_src), size),
            ("triton pack, all layers", lambda: ops.pack_blocks(pool, ids, out=buf), size),  # type: ignore
            ("triton unpack, all layers", lambda: ops.unpack_blocks(buf, other, dst_ids), size),  # type: ignore
            ("torch path pack (index_select), all layers", lambda: torch_ops.pack_blocks(pool, ids, out=flat), size),
            ("triton pack, one layer", lambda: ops.pack_blocks(pool, ids, one, out=layer_buf),  # type: ignore
             size // layers),
        ]
        phase.lines.append(f"pool [L={layers}, 2, NB={nb}, BS={bs}, Hkv={h}, D={d}] bf16, {n} random blocks "
                           f"({size / 2**20:.0f} MiB for all layers); GB/s counts bytes read + written")
        phase.lines.append("")
        phase.lines.append("| operation | time | GB/s | of copy bandwidth |")
        phase.lines.append("| --- | --- | --- | --- |")
        for label, fn, nbytes in rows:
            ms = self.timer(fn)
            gbps = 2 * nbytes / ms / 1e6
            share = f"{100 * gbps / self.copy_gbps:.0f}%" if self.copy_gbps else "-"
            phase.lines.append(f"| {label} | {ms:.3f} ms | {gbps:.0f} | {share} |")

    def _ops(self) -> object:
        if self.triton is None:
            from pdserve.kernels import get_kernel_ops

            self.triton = get_kernel_ops("triton", self.device)
        return self.triton

    # -- output ---------------------------------------------------------------------------------
    def markdown(self) -> str:
        out = ["## Kernels (bench/gpu_check.py)", ""]
        out.append("| phase | result | seconds |")
        out.append("| --- | --- | --- |")
        for ph in self.phases:
            out.append(f"| {ph.name} | {'ok' if ph.ok else '**FAILED**'} | {ph.seconds:.1f} |")
        for ph in self.phases:
            out += ["", f"### {ph.name}", "", *ph.lines]
            if ph.error:
                out += ["", "```", ph.error.strip()[-3000:], "```"]
        return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test of this script")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible to this python", flush=True)
        return 2
    check = Check(device, QUICK if args.quick else REAL)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, fn in (
        ("environment and copy bandwidth", check.environment),
        ("compile and run every kernel", check.compile),
        ("correctness against the references", check.correctness),
        ("decode attention bandwidth", check.decode_bandwidth),
        ("prefill attention throughput", check.prefill_throughput),
        ("KV pack/unpack against a plain copy", check.pack_unpack),
    ):
        check.run(name, fn)
        # Written after every phase, so a run stopped by its time limit still leaves what it measured.
        (args.out / "kernels.md").write_text(check.markdown())
        (args.out / "kernels.json").write_text(json.dumps(
            {"copy_gbps": check.copy_gbps, "phases": [asdict(ph) for ph in check.phases]}, indent=1))
    failed = [ph.name for ph in check.phases if not ph.ok]
    print(f"wrote {args.out / 'kernels.md'}; failed phases: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
