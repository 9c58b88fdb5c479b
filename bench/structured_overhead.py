"""What structured output costs a decode step: the step time of N requests each constrained by a JSON
schema of its own (distinct schemas, so no grammar is shared) against the same N requests unconstrained,
on the same engine, in the same run. Target: under 10% added.

Each schema asks for one string property of its own name with a minimum length longer than the
generation, so every constrained request runs all `--max-tokens` steps, as the unconstrained ones do
with ignore_eos; only steps that decode all N sequences are compared. The two conditions alternate
`--rounds` times (A B A B ...) so drift on a noisy machine falls on both; the figure is the ratio of
their median step times.

    .venv/bin/python bench/structured_overhead.py [--model DIR|tiny] [--dtype auto|float32|bfloat16]
        [--requests 32] [--max-tokens 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.default_model import resolve_model  # noqa: E402
from pdserve.engine.dtype import resolve_dtype  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.model_config import load_model_config  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.engine.structured_spec import StructuredSpec  # noqa: E402


def schema(i: int, chars: int) -> str:
    """A schema of its own for request i: one required string property named after it."""
    return json.dumps({"type": "object", "properties": {f"note_{i}": {"type": "string", "minLength": chars}},
                       "required": [f"note_{i}"], "additionalProperties": False})


def decode_step_times(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams],
                      tag: str) -> list[float]:
    """Runs the requests to the end; returns the times of the steps that decoded every one of them."""
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"{tag}-{i}", p, sp)
    times: list[float] = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        took = time.perf_counter() - start
        if engine.last_step.num_decode_tokens == len(prompts) and engine.last_step.num_prefill_tokens == 0:
            times.append(took)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or tiny (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    model = resolve_model(args.model)
    checkpoint = load_model_config(model.path).dtype_name
    dtype = resolve_dtype(args.dtype, checkpoint, "cpu")
    engine = LLMEngine(EngineConfig(model=str(model.path), dtype=dtype.name, max_num_seqs=args.requests,
                                    enable_prefix_caching=False))
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, min(vocab, 20000)) for _ in range(args.prompt_tokens)]
               for _ in range(args.requests)]
    free = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True) for _ in prompts]
    chars = args.max_tokens * 16  # longer than any generation: no constrained request ends early
    constrained = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                  structured=StructuredSpec("json_schema", schema(i, chars)))
                   for i in range(len(prompts))]
    print(f"{model.name} ({dtype.name}), {args.requests} requests x {args.max_tokens} tokens, "
          f"prompts of {args.prompt_tokens} tokens, {args.rounds} rounds", flush=True)
    decode_step_times(engine, prompts[:2], free[:2], "warm")
    decode_step_times(engine, prompts[:2], constrained[:2], "warm-c")
    runs: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    for r in range(args.rounds):
        runs["unconstrained"] += decode_step_times(engine, prompts, free, f"u{r}")
        runs["constrained"] += decode_step_times(engine, prompts, constrained, f"c{r}")
    base = statistics.median(runs["unconstrained"])
    for name, times in runs.items():
        med = statistics.median(times)
        print(f"{name:>14}: median decode step {med * 1e3:7.2f} ms over {len(times)} steps "
              f"(p10 {sorted(times)[len(times) // 10] * 1e3:.2f}, p90 {sorted(times)[len(times) * 9 // 10] * 1e3:.2f})")
    added = statistics.median(runs["constrained"]) / base - 1
    print(f"structured output adds {added * 100:+.1f}% to a decode step of {args.requests} "
          f"(target under 10%: {'met' if added < 0.10 else 'NOT met'})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
