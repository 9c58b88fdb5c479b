"""The C++ CPU decode kernel alone, at a steady decode step of the default model: every layer's K/V pool
read once per step, as the engine does.

    .venv/bin/python bench/decode_kernel_cpu.py [--baseline REV] [--reps 8] [--dtypes bf16,fp8_e5m2,fp8_e4m3]

Shapes: 30 layers (each its own pool, so a step streams the whole cache from DRAM) of 32 sequences x 512
tokens of context, 9 query / 3 KV heads, head dim 64, block size 16, shuffled block tables; q rounded to
bfloat16 as a bfloat16 model produces it (--fp32-q keeps it float32, which costs the kernel a second
bfloat16 part of q). A "step" is the 30 layers' calls of `paged_decode`; min and median over --reps.

--baseline REV also builds the kernel source as of git revision REV and times it interleaved with the
current one (each rep runs both, so load from other processes hits both alike), with the largest
difference between their outputs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.kernels.cpu_ops import SOURCE, build_extension, load_extension  # noqa: E402
from pdserve.kernels.testing import make_paged_problem  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn,
          "fp16": torch.float16, "fp32": torch.float32}


def load_revision(rev: str) -> ModuleType:
    """The kernel as of git revision `rev`, built in its own extension directory."""
    repo = SOURCE.parents[2]
    text = subprocess.run(["git", "show", f"{rev}:{SOURCE.relative_to(repo)}"], cwd=repo, check=True,
                          capture_output=True).stdout
    return build_extension(text, "pdserve_cpu_attention_rev")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=None, help="git revision whose kernel is timed alongside")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--dtypes", default="bf16,fp8_e5m2,fp8_e4m3")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--fp32-q", action="store_true", help="q not rounded to bfloat16")
    args = ap.parse_args()
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    impls: dict[str, ModuleType] = {"now": load_extension()}
    if args.baseline:
        impls = {"base": load_revision(args.baseline), **impls}
    lens = [args.context] * args.seqs
    shape_p = make_paged_problem(lens, hq, hkv, d, args.block_size, torch.float32, seed=0, spare_blocks=3, poison_unused=False)
    tables, ctx, scale = shape_p.block_tables, shape_p.context_lens, shape_p.scale
    pool_shape = shape_p.k_cache.shape  # [NB, BS, Hkv, D]
    del shape_p
    gen = torch.Generator().manual_seed(1)
    qs = [torch.randn(args.seqs, hq, d, generator=gen) for _ in range(args.layers)]  # [B, Hq, D] per layer
    if not args.fp32_q:
        qs = [q.bfloat16().float() for q in qs]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.layers} layers of {args.seqs} x "
          f"{args.context}, {hq}/{hkv} heads, D {d}, block size {args.block_size}; q {'float32' if args.fp32_q else 'bfloat16-exact'}; "
          f"min/median of {args.reps}")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        pools = [(torch.randn(pool_shape, generator=gen).to(dtype), torch.randn(pool_shape, generator=gen).to(dtype))
                 for _ in range(args.layers)]

        def step(ext: ModuleType, pools: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
            return [ext.paged_decode(q, k, v, tables, ctx, scale, 1) for q, (k, v) in zip(qs, pools, strict=True)]

        outs = {k: step(ext, pools) for k, ext in impls.items()}  # warm-up, and the outputs compared
        samples: dict[str, list[float]] = {k: [] for k in impls}
        for _ in range(args.reps):
            for k, ext in impls.items():
                t0 = time.perf_counter()
                step(ext, pools)
                samples[k].append((time.perf_counter() - t0) * 1e3)
        line = f"KV {name:<9}"
        for k, s in samples.items():
            line += f"  {k} {min(s):6.2f} ms (med {statistics.median(s):6.2f})"
        if "base" in impls:
            diff = max((a - b).abs().max().item() for a, b in zip(outs["base"], outs["now"], strict=True))
            line += f"  x{min(samples['base']) / min(samples['now']):4.2f}  max|diff| {diff:.1e}"
        print(line, flush=True)
        del pools


if __name__ == "__main__":
    main()
