"""The K/V read floor of a steady decode step: how fast this machine can read the step's K/V pool at all.

A scratch loop (built here with torch.utils.cpp_extension) reads every layer's K/V blocks of a 32 x 512 decode
batch at the default model's geometry (30 layers, 3 KV heads, D 64, bf16, 16-token blocks at shuffled pool
positions) with no compute, in two orders: one KV head at a time (the decode kernel's items: 128-byte pieces
at a 384-byte stride) and whole token rows (each block's K and V as one contiguous run), each with no
prefetch and with prefetches two blocks ahead into L2. It prints each order's time and rate against the
copy bandwidth measured in the same run, and what share of a step at the target rate the best of them
leaves for attention: if even a compute-free read exceeds that share, the attention target cannot be met
at this K/V size on this machine.

    .venv/bin/python bench/kv_read_floor.py [--seqs 32] [--context 512] [--target-tok-s 600] [--share 0.15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench import copy_bandwidth  # noqa: E402 - after the path insert
from pdserve.kernels.cpu_ops import CFLAGS, extension_dir  # noqa: E402

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>

// Reads (xor-folds) the rows of every listed block of k and v once. whole: items are sequences reading
// whole rows; else items are (sequence, KV head) reading that head's D elements per row. pf: prefetch the
// same rows two blocks ahead into L2, a few lines per token.
int64_t read_pool(torch::Tensor k, torch::Tensor v, torch::Tensor tables, int64_t ctx, bool whole, bool pf) {
  const int64_t BS = k.size(1), H = k.size(2), D = k.size(3), B = tables.size(0), MB = tables.size(1);
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t row = H * D * 2, nblocks = (ctx + BS - 1) / BS;
  const int64_t items = whole ? B : B * H, piece = whole ? row : D * 2;
  int64_t total = 0;
#pragma omp parallel reduction(+ : total)
  {
    __m512i acc = _mm512_setzero_si512();
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t b = whole ? it : it / H, off = whole ? 0 : (it % H) * D * 2;
      const int32_t* tb = tp + b * MB;
      for (int64_t j = 0; j < nblocks; ++j) {
        const int64_t base = tb[j] * BS * row + off;
        const int64_t ahead = pf && j + 2 < nblocks ? tb[j + 2] * BS * row + off : -1;
        for (int64_t t = 0; t < BS; ++t) {
          for (int64_t c = 0; c < piece; c += 64) {
            if (ahead >= 0) {
              _mm_prefetch(kp + ahead + t * row + c, _MM_HINT_T1);
              _mm_prefetch(vp + ahead + t * row + c, _MM_HINT_T1);
            }
            acc = _mm512_xor_si512(acc, _mm512_loadu_si512(kp + base + t * row + c));
            acc = _mm512_xor_si512(acc, _mm512_loadu_si512(vp + base + t * row + c));
          }
        }
      }
    }
    total += _mm512_reduce_add_epi32(acc);
  }
  return total;
}
"""


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--target-tok-s", type=float, default=600.0, help="steady decode rate the step must reach")
    ap.add_argument("--share", type=float, default=0.15, help="share of that step allowed for attention")
    args = ap.parse_args()
    if "avx512f" not in open("/proc/cpuinfo").read():
        raise SystemExit("this scratch loop uses AVX-512 loads; this CPU has none")

    from torch.utils.cpp_extension import load_inline

    build = extension_dir() / "kv_read_floor"
    build.mkdir(parents=True, exist_ok=True)
    ext = load_inline("kv_read_floor", cpp_sources=SOURCE, functions=["read_pool"], extra_cflags=list(CFLAGS),
                      extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)

    bs, seqs, ctx = args.block_size, args.seqs, args.context
    per_seq = -(-ctx // bs)
    nb = seqs * per_seq + 8
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(nb, generator=gen)[: seqs * per_seq].to(torch.int32).reshape(seqs, per_seq)  # [B, MB]
    shape = (nb, bs, args.kv_heads, args.head_dim)  # [NB, BS, Hkv, D] per layer
    pools = [(torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16())
             for _ in range(args.layers)]
    kv_bytes = 2 * args.layers * seqs * ctx * args.kv_heads * args.head_dim * 2
    bw = copy_bandwidth()
    step_s = seqs / args.target_tok_s
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.layers} layers of {seqs} x {ctx}, "
          f"{args.kv_heads} KV heads x {args.head_dim}, bf16, block {bs}: {kv_bytes / 1e6:.0f} MB of K/V a step")
    print(f"copy bandwidth (read + write) {bw / 1e9:.1f} GB/s: the K/V at that rate {1e3 * kv_bytes / bw:.1f} ms")
    best = float("inf")
    for whole in (False, True):
        for pf in (False, True):
            def read_all(whole: bool = whole, pf: bool = pf) -> None:
                for k, v in pools:
                    ext.read_pool(k, v, tables, ctx, whole, pf)

            times = [_timed(read_all) for _ in range(args.reps)]
            t = min(times)
            best = min(best, t)
            print(f"  {'whole rows' if whole else 'per KV head'}, {'L2 prefetch 2 blocks ahead' if pf else 'no prefetch'}: "
                  f"{1e3 * t:6.2f} ms (median {1e3 * statistics.median(times):.2f}) = {kv_bytes / t / 1e9:5.1f} GB/s")
    allowed = args.share * step_s
    print(f"at {args.target_tok_s:.0f} tok/s a step is {1e3 * step_s:.1f} ms; {100 * args.share:.0f}% of it is "
          f"{1e3 * allowed:.1f} ms, which needs {kv_bytes / allowed / 1e9:.1f} GB/s of K/V reads; the fastest read "
          f"with no compute takes {1e3 * best:.1f} ms = {100 * best / step_s:.1f}% of that step "
          f"({'within' if best <= allowed else 'above'} the share)")


if __name__ == "__main__":
    main()
