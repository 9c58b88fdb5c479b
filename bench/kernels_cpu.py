"""CPU timings of the torch kernel path against its first version, on the engine benchmark's shapes.

    .venv/bin/python bench/kernels_cpu.py [--reps 20] [--seqs 64] [--threads N]

Decode: 64 sequences with contexts of 100-800 tokens, 6 query / 2 KV heads, head dim 64, block size 16,
float32, shuffled block tables. Prefill: a batch of prompts, some after a cached prefix. Also store_kv
and KV block pack/unpack against a plain copy of the same bytes. Prints min/median milliseconds and
the speed-up over the first version (a copy of it lives below, for comparison only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.kernels.testing import PagedProblem, make_paged_problem  # noqa: E402
from pdserve.kernels.torch_ops import TorchOps  # noqa: E402


class FirstVersion:
    """The torch path as first written (padded gather of the whole table, then masked SDPA with GQA)."""

    @staticmethod
    def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        b, mb = tables.shape
        g = cache.index_select(0, tables.reshape(-1).long())  # [B*MB, BS, H, D]
        return g.view(b, mb * cache.shape[1], cache.shape[2], cache.shape[3])

    def decode_attention(self, q, k_cache, v_cache, block_tables, context_lens, scale):
        b, hq, d = q.shape
        k = self._gather(k_cache, block_tables)  # [B, S, Hkv, D]
        v = self._gather(v_cache, block_tables)
        pos = torch.arange(k.shape[1])
        mask = pos[None, :] < context_lens[:, None].to(pos.dtype)  # [B, S]
        out = F.scaled_dot_product_attention(
            q.view(b, hq, 1, d), k.permute(0, 2, 1, 3).to(q.dtype), v.permute(0, 2, 1, 3).to(q.dtype),
            attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=hq != k_cache.shape[2],
        )
        return out.view(b, hq, d)

    def prefill_attention(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):
        t, hq, d = q.shape
        b = block_tables.shape[0]
        cu = cu_seqlens_q.long()
        q_lens = cu[1:] - cu[:-1]
        max_q = int(q_lens.max())
        seq_idx = torch.repeat_interleave(torch.arange(b), q_lens)
        local = torch.arange(t) - cu[:-1][seq_idx]
        qp = q.new_zeros(b, max_q, hq, d)
        qp[seq_idx, local] = q
        k = self._gather(k_cache, block_tables)
        v = self._gather(v_cache, block_tables)
        qpos = (context_lens.long() - q_lens)[:, None] + torch.arange(max_q)[None, :]
        mask = torch.arange(k.shape[1])[None, None, :] <= qpos[:, :, None]
        out = F.scaled_dot_product_attention(
            qp.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3).to(q.dtype), v.permute(0, 2, 1, 3).to(q.dtype),
            attn_mask=mask[:, None], scale=scale, enable_gqa=hq != k_cache.shape[2],
        )
        return out.permute(0, 2, 1, 3)[seq_idx, local]


@dataclass
class Timing:
    min_ms: float
    median_ms: float


def time_it(fn: Callable[[], object], reps: int) -> Timing:
    """Wall-clock of `fn` after two warm-up calls; min is the least disturbed by other processes."""
    fn()
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return Timing(min(samples), statistics.median(samples))


def compare(label: str, first: Callable[[], torch.Tensor], new: Callable[[], torch.Tensor], reps: int) -> None:
    """Times both with their runs interleaved, so load from other processes hits both alike, and prints
    their ratio and agreement."""
    diff = (first().float() - new().float()).abs().max().item()
    samples: dict[str, list[float]] = {"first": [], "now": []}
    for _ in range(reps):
        for name, fn in (("first", first), ("now", new)):
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    t_first = Timing(min(samples["first"]), statistics.median(samples["first"]))
    t_new = Timing(min(samples["now"]), statistics.median(samples["now"]))
    print(f"{label:<46} first {t_first.min_ms:7.2f} ms (med {t_first.median_ms:7.2f})  "
          f"now {t_new.min_ms:7.2f} ms (med {t_new.median_ms:7.2f})  "
          f"x{t_first.min_ms / t_new.min_ms:5.2f} (med x{t_first.median_ms / t_new.median_ms:5.2f})  "
          f"max|diff| {diff:.1e}")


def decode_case(problem: PagedProblem, ops: object) -> Callable[[], torch.Tensor]:
    p = problem
    return lambda: ops.decode_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale)


def prefill_case(problem: PagedProblem, ops: object) -> Callable[[], torch.Tensor]:
    p = problem
    return lambda: ops.prefill_attention(p.q, p.k_cache, p.v_cache, p.block_tables, p.cu_seqlens_q,
                                         p.context_lens, p.scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    first, now = FirstVersion(), TorchOps()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; min over {args.reps} runs")

    hq, hkv, d, bs = 6, 2, 64, 16
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(100, 801, (args.seqs,), generator=gen).tolist()
    # poison_unused=False: the first version reads padded slots and would propagate NaN.
    dec = make_paged_problem(lens, hq, hkv, d, bs, torch.float32, seed=2, poison_unused=False)
    compare(f"decode B={args.seqs} ctx 100-800 fp32", decode_case(dec, first), decode_case(dec, now), args.reps)
    dec16 = make_paged_problem(lens, hq, hkv, d, bs, torch.bfloat16, seed=2, poison_unused=False)
    compare(f"decode B={args.seqs} ctx 100-800 bf16", decode_case(dec16, first), decode_case(dec16, now),
            args.reps)
    short = make_paged_problem([int(n) // 8 + 1 for n in lens], hq, hkv, d, bs, torch.float32, seed=3,
                               poison_unused=False)
    compare(f"decode B={args.seqs} ctx 13-101 fp32", decode_case(short, first), decode_case(short, now),
            args.reps)

    pre = make_paged_problem([300, 520, 180, 700], hq, hkv, d, bs, torch.float32, q_lens=[300, 256, 180, 64],
                             seed=4, poison_unused=False)
    compare("prefill 4 prompts (800 new, 2 after prefix)", prefill_case(pre, first), prefill_case(pre, now),
            max(3, args.reps // 4))
    long_chunk = make_paged_problem([1536], hq, hkv, d, bs, torch.float32, q_lens=[512], seed=5,
                                    poison_unused=False)
    compare("prefill chunk of 512 after 1024 cached", prefill_case(long_chunk, first),
            prefill_case(long_chunk, now), max(3, args.reps // 4))
    mixed = make_paged_problem([1, *lens[:15]], hq, hkv, d, bs, torch.float32, q_lens=[1, *[1] * 14, 90],
                               seed=6, poison_unused=False)
    compare("prefill 15 single tokens + one 200-token chunk", prefill_case(mixed, first), prefill_case(mixed, now),
            max(3, args.reps // 4))

    n_tok = args.seqs
    slots = torch.randperm(dec.k_cache.shape[0] * bs, generator=gen)[:n_tok]
    key = torch.randn(n_tok, hkv, d)
    t = time_it(lambda: now.store_kv(key, key, dec.k_cache, dec.v_cache, slots), args.reps)
    print(f"{'store_kv ' + str(n_tok) + ' tokens':<46} now {t.min_ms:8.3f} ms")

    layers, nb = 8, 512
    pool = torch.randn(layers, 2, nb, bs, hkv, d)  # [L, 2, NB, BS, Hkv, D]
    other = torch.empty_like(pool)
    ids = torch.randperm(nb, generator=gen)[:50]
    dst_ids = torch.randperm(nb, generator=gen)[:50]
    buf = now.pack_blocks(pool, ids)
    nbytes = buf.numel() * buf.element_size()
    dense = torch.empty_like(buf)
    t_copy = time_it(lambda: dense.copy_(pool[:, :, :50]), args.reps)
    t_pack = time_it(lambda: now.pack_blocks(pool, ids, out=buf), args.reps)
    t_unpack = time_it(lambda: now.unpack_blocks(buf, other, dst_ids), args.reps)
    t_layer = time_it(lambda: now.pack_blocks(pool, ids, layer=3), args.reps)
    for label, tm, size in (("dense copy", t_copy, nbytes), ("pack 50 blocks x 8 layers", t_pack, nbytes),
                            ("unpack 50 blocks x 8 layers", t_unpack, nbytes),
                            ("pack 50 blocks, one layer", t_layer, nbytes // layers)):
        print(f"{label:<46} now {tm.min_ms:8.3f} ms  {size / tm.min_ms / 1e6:6.2f} GB/s ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
