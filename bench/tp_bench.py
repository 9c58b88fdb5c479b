"""Tensor parallelism on the same cores, in one run: TP = 2 (two rank processes, one thread each) against
TP = 1 (one process, two threads, and one thread for the per-core rate).

Prints, each against its baseline measured in this run:
- prefill tokens/s at TP 2 and TP 1 and the scaling efficiency (TP 2's rate over twice TP 1's one-thread
  rate; 1.0 = the second core fully used);
- a decode step at TP 2: its time, and the share of it rank 0 spends in all-reduces (o_proj and down_proj
  of every layer, waiting for the other rank included) and in the logits gather;
- KV transfer of a 1k- and a 4k-token prompt over a real channel on loopback: TP 2 -> TP 1 and
  TP 1 -> TP 2 (heads resharded on the way, `kv_transfer.sharded`) against TP 1 -> TP 1.

    .venv/bin/python bench/tp_bench.py [--layers 8 --hidden 1024 --heads 16 --kv-heads 4] [--smoke] [--device cuda]

--device cuda (bench/gpu_check.sh, 2 GPUs or more) runs the ranks over NCCL, a GPU each; the KV channel's
decode side is the second GPU. There the collectives are timed between device synchronisations.

The model is a synthetic llama checkpoint of the given shape (random weights, the tiny model's tokenizer);
--smoke uses the tiny model and a few steps (seconds; the suite runs it so the bench cannot rot).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cpu_isa import isa_summary  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.engine.tiny import TinyShape, default_model_dir, tiny_weights  # noqa: E402


def synthetic_model(out: Path, layers: int, hidden: int, heads: int, kv_heads: int, inter: int) -> Path:
    """A llama checkpoint of real-model shape with the tiny model's tokenizer and random weights."""
    from safetensors.torch import save_file

    tiny = default_model_dir("llama")
    cfg = json.loads((tiny / "config.json").read_text())
    shape = dataclasses.replace(TinyShape(), hidden_size=hidden, num_layers=layers, num_heads=heads,
                                num_kv_heads=kv_heads, head_dim=hidden // heads, intermediate_size=inter,
                                linear_std=0.02, embed_std=0.1, lm_head_std=0.05)
    out.mkdir(parents=True)
    for f in tiny.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    new = dict(cfg)  # the tiny model's token ids and vocabulary
    new.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
               head_dim=hidden // heads, intermediate_size=inter)
    (out / "config.json").write_text(json.dumps(new))
    save_file(tiny_weights("llama", shape, cfg["vocab_size"], 0), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


DEVICE = "cpu"  # set by --device


def engine(model: Path, tp: int, threads: int, blocks: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), device=DEVICE, dtype="float32", num_kv_blocks=blocks, block_size=16,
                                  num_threads=threads, tensor_parallel_size=tp, max_num_batched_tokens=2048))


def _sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def prefill_rate(model: Path, tp: int, threads: int, prompts: list[list[int]], reps: int) -> float:
    """Prompt tokens/s of prefill-only requests (max_tokens 1), best of `reps` after a warm-up."""
    eng = engine(model, tp, threads, blocks=sum(-(-len(p) // 16) for p in prompts) + 8)
    try:
        params = SamplingParams(max_tokens=1, temperature=0)
        eng.generate(prompts[:1], params)
        best = 0.0
        for r in range(reps):
            shifted = [[(t + r + 1) % 4000 for t in p] for p in prompts]  # no prefix-cache hits
            t0 = time.perf_counter()
            eng.generate(shifted, params)
            best = max(best, sum(map(len, prompts)) / (time.perf_counter() - t0))
        return best
    finally:
        eng.close()


def decode_collectives(model: Path, batch: int, context: int, steps: int) -> tuple[float, float, float]:
    """TP 2 steady decode: (step ms, all-reduce share, gather share) on rank 0."""
    import torch.distributed as dist

    spent = {"all_reduce": 0.0, "gather": 0.0}
    originals = {name: getattr(dist, name) for name in spent}

    def timed(name: str):
        def call(*args, **kwargs):
            _sync()
            t0 = time.perf_counter()
            try:
                return originals[name](*args, **kwargs)
            finally:
                _sync()
                spent[name] += time.perf_counter() - t0
        return call

    eng = engine(model, 2, 1, blocks=batch * (-(-(context + steps + 4) // 16)) + 8)
    try:
        for i in range(batch):
            eng.add_request(f"r{i}", [(7 * i + j) % 4000 for j in range(context)],
                            SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True))
        while eng.scheduler.num_waiting:  # prefill every prompt first
            eng.step()
        eng.step()
        for name in spent:
            setattr(dist, name, timed(name))
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        total = time.perf_counter() - t0
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        eng.close()
    return total / steps * 1000, spent["all_reduce"] / total, spent["gather"] / total


def transfer_times(layers: int, kv_heads: int, head_dim: int, tokens: int, reps: int) -> dict[str, float]:
    """Median ms of shipping `tokens` tokens of KV blocks: TP1 -> TP1, TP2 -> TP1, TP1 -> TP2."""
    from pdserve.engine.parallel import head_shard
    from pdserve.kernels import get_kernel_ops
    from pdserve.kv_transfer import KVReceiver, KVSender, TransferMeta
    from pdserve.kv_transfer.sharded import HeadShardedKV
    from testing.kv_pair import loopback_pair

    n = -(-tokens // 16)
    shape = (layers, 2, n + 8, 16, kv_heads, head_dim)
    # on CUDA: the prefill side's rank 0 and the decode side on two GPUs, a TP 2 side over both
    p_dev, d_dev = ("cuda:0", "cuda:1") if DEVICE.startswith("cuda") else ("cpu", "cpu")
    whole = torch.randn(shape, device=p_dev)

    def shards(first: str) -> HeadShardedKV:
        parts = []
        for r, dev in enumerate((first, d_dev if first == p_dev else p_dev)):
            h = head_shard(kv_heads * 2, kv_heads, r, 2)
            parts.append((whole[:, :, :, :, h.kv_start : h.kv_start + h.num_kv_heads].to(dev, copy=True), h.kv_start))
        return HeadShardedKV(parts, kv_heads)

    src_ids, dst_ids = list(range(n)), list(range(8, n + 8))
    ops = get_kernel_ops("auto", DEVICE)
    out: dict[str, float] = {}
    with loopback_pair("p-bench", "d-bench", p_dev, d_dev) as (ch, peer):
        cases = {"tp1->tp1": (whole, torch.zeros_like(whole, device=d_dev)),
                 "tp2->tp1": (shards(p_dev), torch.zeros_like(whole, device=d_dev)),
                 "tp1->tp2": (whole, shards(d_dev))}
        for name, (src, dst) in cases.items():
            times = []
            for i in range(reps + 1):
                _sync()
                t0 = time.perf_counter()
                handle = KVSender(ops).send(ch, src, src_ids, request_id=f"{name}-{i}", num_tokens=tokens, timeout_s=60)
                got = KVReceiver(ops).recv(peer, dst, dst_ids, TransferMeta.from_dict(handle.meta.to_dict()),
                                           timeout_s=60).result(120)
                assert handle.result(120).ok and got.ok, got.error
                if i:  # the first one grows the staging buffers
                    times.append((time.perf_counter() - t0) * 1000)
            out[name] = statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, a GPU a rank; 2 GPUs or more)")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    print(f"CPU ISA {isa_summary()}")
    if DEVICE.startswith("cuda"):
        if torch.cuda.device_count() < 2:
            print(f"TP 2 on CUDA needs 2 GPUs; {torch.cuda.device_count()} visible: nothing to measure")
            return 0
        print(f"devices: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    with tempfile.TemporaryDirectory(prefix="pdserve-tp-bench-") as tmp:
        if args.smoke:
            model = default_model_dir("llama")
            cfg = json.loads((model / "config.json").read_text())
            layers, kv, d = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
        else:
            model = synthetic_model(Path(tmp) / "model", args.layers, args.hidden, args.heads, args.kv_heads,
                                    args.intermediate)
            layers, kv, d = args.layers, args.kv_heads, args.hidden // args.heads
        print(f"model: llama, {layers} layers, {kv} KV heads of {d}, float32")
        n_prompts, plen, reps = (2, 64, 1) if args.smoke else (4, 512, 3)
        prompts = [[(11 * i + j) % 4000 for j in range(plen)] for i in range(n_prompts)]
        one = prefill_rate(model, 1, 1, prompts, reps)
        two_threads = prefill_rate(model, 1, 2, prompts, reps)
        tp2 = prefill_rate(model, 2, 1, prompts, reps)
        print(f"prefill ({n_prompts} x {plen} tokens): TP 1 x 1 thread {one:,.0f} tok/s, TP 1 x 2 threads "
              f"{two_threads:,.0f} tok/s, TP 2 x 1 thread {tp2:,.0f} tok/s")
        print(f"  TP 2 / TP 1 (2 threads) = {tp2 / two_threads:.2f}x; scaling efficiency TP 2 / (2 x TP 1 one thread) "
              f"= {tp2 / (2 * one):.2f}")
        batch, ctx, steps = (2, 32, 3) if args.smoke else (8, 512, 20)
        step_ms, ar, gather = decode_collectives(model, batch, ctx, steps)
        print(f"decode step at TP 2 ({batch} seqs x {ctx} context): {step_ms:.2f} ms; all-reduce {ar:.1%} of it, "
              f"logits gather {gather:.1%} (rank 0, waiting for the other rank included)")
        for tokens in ((64,) if args.smoke else (1024, 4096)):
            t = transfer_times(layers, kv, d, tokens, 1 if args.smoke else 5)
            base = t["tp1->tp1"]
            print(f"KV transfer of {tokens} tokens: TP 1 -> TP 1 {base:.2f} ms; TP 2 -> TP 1 {t['tp2->tp1']:.2f} ms "
                  f"({t['tp2->tp1'] / base:.2f}x); TP 1 -> TP 2 {t['tp1->tp2']:.2f} ms ({t['tp1->tp2'] / base:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
