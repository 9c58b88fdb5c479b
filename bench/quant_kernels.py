"""Quantized matmul (kernels.quant_ops) against float32 F.linear, per GGUF type, shape and ISA path.

    .venv/bin/python bench/quant_kernels.py [--models smollm,1.1b,8b] [--types Q4_K,Q8_0,...] [--m 1,32,512]
        [--isas avx2,avx512_vnni] [--activations int8|int8x2] [--threads N] [--min-time S] [--json FILE] [--smoke]

For each type and weight shape [N, K] of the models' projections (the default model's qkv, o, gate_up,
down and LM head; TinyLlama-1.1B's and Llama-3-8B's), and each activation row count M: the time per call
of every ISA path this CPU has, of float32 F.linear on a float32 weight of the same shape (its time does
not depend on the values), the speed-up over F.linear, and the effective weight-read rate (the weight's
GGUF bytes / time) beside the memory copy rate measured in the same run (a 256 MB tensor copied into a
preallocated one: bytes copied per second). K types skip shapes whose K is not a multiple of 256 (a GGUF
stores those tensors in another type). Times are the best of several rounds (of this thread's CPU time
with --threads 1, else of wall time): on a shared machine the other load only ever adds.

Weights are random GGUF blocks with sane fp16 scales (the kernels' time does not depend on the values);
`--smoke` runs one small shape in a few seconds (tests/test_kernels_quant.py runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu_isa import isa_summary  # noqa: E402
from pdserve.kernels.quant_format import QUANT_TYPES, QuantWeight, block_layout  # noqa: E402
from pdserve.kernels.quant_ops import QuantOps, available_isas, choose_activations, choose_isa  # noqa: E402

# (label, N, K) of each model's projections (q|k|v and gate|up fused, as the engine serves them).
MODELS: dict[str, list[tuple[str, int, int]]] = {
    "smollm": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
               ("lm_head", 49152, 576)],
    "1.1b": [("qkv", 2560, 2048), ("o", 2048, 2048), ("gate_up", 11264, 2048), ("down", 2048, 5632)],
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
}
SMOKE_SHAPE = ("smoke", 256, 512)


def random_weight(type_name: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    """Random blocks of `type_name` [n, k] whose fp16 scales are ordinary numbers (no inf / nan)."""
    values, size = block_layout(type_name)
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * k // values, size), dtype=torch.uint8, generator=gen)
    half = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)  # [2] uint8
    scale_at = {"Q6_K": (208,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2)}.get(type_name, (0,))
    for off in scale_at:
        raw[:, off:off + 2] = half
    return QuantWeight.from_raw(f"{type_name}[{n}, {k}]", type_name, (n, k), raw.reshape(-1))


def best_time(fn: Callable[[], object], min_time: float, rounds: int = 5) -> float:
    """Seconds per call: the best round of `rounds`, each at least `min_time` / rounds long. With one
    torch thread every kernel runs on this thread, and its CPU time is counted (what other load on the
    machine cannot inflate); with more, wall time."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()
    t0 = clock()
    fn()
    once = max(clock() - t0, 1e-6)
    reps = max(1, int(min_time / rounds / once))
    best = float("inf")
    for _ in range(rounds):
        t0 = clock()
        for _ in range(reps):
            fn()
        best = min(best, (clock() - t0) / reps)
    return best


def copy_rate(mbytes: int = 256) -> float:
    """Bytes per second torch copies a `mbytes` MB float32 tensor into a preallocated one."""
    src = torch.ones(mbytes * (1 << 20) // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return src.numel() * 4 / best_time(lambda: dst.copy_(src), 0.5, rounds=3)


def run(models: list[str], types: list[str], ms: list[int], min_time: float, smoke: bool,
        isas: tuple[str, ...] | None = None, activations: str | None = None) -> dict:
    isas = available_isas() if isas is None else isas
    ops = {isa: QuantOps.create(isa, activations) for isa in isas}
    rounding = choose_activations(activations)
    chosen = choose_isa()
    rate = copy_rate(64 if smoke else 256)
    print(f"CPU ISA {isa_summary()}; {torch.get_num_threads()} threads")
    print(f"quant path: {chosen.name} ({chosen.reason}); activations {rounding}")
    print(f"memory copy rate: {rate / 1e9:.1f} GB/s")
    shapes = [SMOKE_SHAPE] if smoke else [s for m in models for s in MODELS[m]]
    rows: list[dict] = []
    flinear: dict[tuple[int, int, int], float] = {}  # (N, K, M) -> seconds: the same for every type
    head = f"{'type':5} {'shape':>16} {'M':>4} {'F.linear ms':>11}" + "".join(
        f" | {isa + ' ms':>15} {'xF.lin':>6} {'GB/s':>6}" for isa in isas)
    print(head)
    for type_name in types:
        values, _ = block_layout(type_name)
        for label, n, k in shapes:
            if k % values:
                continue
            w = random_weight(type_name, n, k)
            wf = None
            for m in ms:
                if m >= 256 and n * k > 64 << 20:  # prefill on the 8B MLP: minutes of F.linear, skipped
                    continue
                x = torch.randn(m, k)  # [M, K] float32
                out = torch.empty(m, n)
                if (n, k, m) not in flinear:
                    wf = torch.randn(n, k) if wf is None else wf  # float32 [N, K]
                    flinear[(n, k, m)] = best_time(lambda: F.linear(x, wf, out=out), min_time)  # noqa: B023
                t_lin = flinear[(n, k, m)]
                rec = {"type": type_name, "shape": label, "n": n, "k": k, "m": m, "weight_bytes": w.nbytes,
                       "flinear_ms": t_lin * 1e3, "paths": {}}
                line = f"{type_name:5} {f'{label} {n}x{k}':>16} {m:>4} {t_lin * 1e3:>11.3f}"
                for isa, op in ops.items():
                    t = best_time(lambda: op.matmul(x, w, out=out), min_time)  # noqa: B023
                    rec["paths"][isa] = {"ms": t * 1e3, "speedup": t_lin / t, "weight_gb_s": w.nbytes / t / 1e9}
                    line += f" | {t * 1e3:>15.3f} {t_lin / t:>6.2f} {w.nbytes / t / 1e9:>6.1f}"
                print(line, flush=True)
                rows.append(rec)
    return {"isa": isa_summary(), "threads": torch.get_num_threads(), "path": chosen.name,
            "reason": chosen.reason, "activations": rounding, "copy_gb_s": rate / 1e9, "results": rows}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm,1.1b,8b", help="comma list of: " + ", ".join(MODELS))
    ap.add_argument("--types", default=",".join(QUANT_TYPES))
    ap.add_argument("--m", default="1,32,512", help="activation row counts")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds of calls per timing")
    ap.add_argument("--isas", default="", help="comma list of ISA paths to time (default: every one this CPU has)")
    ap.add_argument("--activations", default=None, help="int8 or int8x2 (default: $PDSERVE_QUANT_ACTIVATIONS, "
                    "else int8x2)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--smoke", action="store_true", help="one small shape, two types, in seconds")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    types = ["Q4_K", "Q8_0"] if args.smoke else args.types.split(",")
    ms = [1, 4] if args.smoke else [int(v) for v in args.m.split(",")]
    isas = tuple(args.isas.split(",")) if args.isas else None
    results = run(args.models.split(","), types, ms, 0.02 if args.smoke else args.min_time, args.smoke, isas,
                  args.activations)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
