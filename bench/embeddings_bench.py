"""Embeddings throughput: pdserve's engine path (`LLMEngine.embed_tensor`, what a prefill node's Embed RPC
runs) against transformers (AutoModel, float32, padded batches with an attention mask) in the same run, on
the same inputs and threads, with the largest difference between their vectors.

    .venv/bin/python bench/embeddings_bench.py [--model DIR|tiny] [--inputs 32] [--min-len 16] [--max-len 128]
        [--batch 16] [--pooling last|mean] [--threads N] [--seconds 3] [--smoke]

Default model: the default model (SmolLM2-135M-Instruct) in float32. Prints the CPU ISA line, then
inputs/s and tokens/s of each path (best of runs interleaved over `--seconds` each, so both see the same
load on a shared machine). --smoke: the tiny llama model,
a few short inputs, seconds (tests/test_embeddings.py runs it so it cannot rot).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.default_model import resolve_model
from pdserve.engine.llm_engine import LLMEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cpu_isa import isa_summary  # noqa: E402


def inputs(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 8) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def best_rates(fns: dict[str, Callable[[], object]], seconds: float) -> dict[str, float]:
    """Runs each `fn` in turn (interleaved, so both see the same load on a shared machine) until each has
    run for about `seconds`, at least twice; returns each one's best runs per second."""
    best = dict.fromkeys(fns, 0.0)
    spent = dict.fromkeys(fns, 0.0)
    runs = 0
    while runs < 2 or min(spent.values()) < seconds:
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            spent[name] += dt
            best[name] = max(best[name], 1.0 / dt)
        runs += 1
    return best


def transformers_embed(model: torch.nn.Module, prompts: list[list[int]], batch: int, pooling: str) -> torch.Tensor:
    """Right-padded batches through AutoModel; pooled over each input's own tokens, L2-normalized."""
    out = []
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            group = prompts[i:i + batch]
            width = max(len(p) for p in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for r, p in enumerate(group):
                ids[r, :len(p)] = torch.tensor(p)
                mask[r, :len(p)] = 1
            h = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()  # [B, W, H]
            lens = mask.sum(1)
            if pooling == "last":
                v = h[torch.arange(len(group)), lens - 1]
            else:
                v = (h * mask[:, :, None]).sum(1) / lens[:, None]
            out.append(torch.nn.functional.normalize(v, dim=-1))
    return torch.cat(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model directory, or tiny (default: the default model)")
    ap.add_argument("--inputs", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="inputs per transformers batch")
    ap.add_argument("--pooling", default="last", choices=("last", "mean"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="seconds: the tiny model, a few short inputs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.inputs, args.min_len, args.max_len, args.seconds = "tiny", 8, 4, 40, 0.2
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model).path
    print(f"CPU ISA {isa_summary()}; torch threads {torch.get_num_threads()}")
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=16, num_threads=args.threads))
    mc = engine.model_config
    prompts = inputs(args.inputs, args.min_len, args.max_len, mc.vocab_size, args.seed)
    tokens = sum(len(p) for p in prompts)
    print(f"model {model_dir} ({mc.arch}, {mc.num_layers} layers, hidden {mc.hidden_size}); {len(prompts)} inputs "
          f"of {args.min_len}-{args.max_len} tokens ({tokens} in all), pooling {args.pooling}, normalized, float32")

    from transformers import AutoModel

    hf = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ours = engine.embed_tensor(prompts, args.pooling, True)
    theirs = transformers_embed(hf, prompts, args.batch, args.pooling)
    diff = float((ours - theirs).abs().max())
    cos = float(torch.nn.functional.cosine_similarity(ours, theirs, dim=-1).min())
    rates = best_rates({
        "pdserve engine (embed_tensor)": lambda: engine.embed_tensor(prompts, args.pooling, True),
        f"transformers AutoModel (batch {args.batch})": lambda: transformers_embed(hf, prompts, args.batch,
                                                                                   args.pooling),
    }, args.seconds)
    for name, rate in rates.items():
        print(f"{name:42s} {rate * len(prompts):9.1f} inputs/s {rate * tokens:11.0f} tokens/s")
    first, second = rates.values()
    print(f"pdserve / transformers: {first / second:.2f}x; max abs diff {diff:.2e}, min cosine {cos:.7f}")
    assert engine.load().kv_blocks_used == 0


if __name__ == "__main__":
    main()
