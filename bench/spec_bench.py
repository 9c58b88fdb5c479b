"""Speculative decoding against none, in one run: tokens/s per stream on the default model.

Two engines of the same model in this process, one with `--speculative` (ngram by default) and one
without, take turns on each workload (interleaved repetitions, the median kept):

  (a) code: a ~500-token Python file rewritten with one function renamed (target: at least 2x);
  (b) quote: a passage summarised, its statements quoted (target: at least 1.3x);
  (c) chat: ordinary short questions (target: at least 0.95x);

at concurrency 1 and 8 (8 different prompts of the workload at once). Tokens/s per stream is each
request's completion tokens over its time from arrival to its last token, averaged over the streams.
Greedy; the outputs of the two engines must be token-identical (reported). Also reports each workload's
acceptance rate (accepted / drafted tokens) and tokens per decode step.

    .venv/bin/python bench/spec_bench.py               # default model, its GGUF weights as served
    .venv/bin/python bench/spec_bench.py --quick       # the tiny model, seconds (the suite runs this)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cpu_isa import isa_summary  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.default_model import resolve_model  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402

TARGETS = {"code": 2.0, "quote": 1.3, "chat": 0.95}

_FUNCS = [
    ("subtotal", "items", "return sum(item.price * item.quantity for item in items)"),
    ("apply_discount", "price, percent", "if not 0 <= percent <= 100:\n        raise ValueError(f\"bad discount {percent}\")\n"
     "    return round(price * (100 - percent) / 100, 2)"),
    ("tax_for", "amount, region", "rate = TAX_RATES.get(region, DEFAULT_TAX)\n    return round(amount * rate, 2)"),
    ("shipping_cost", "weight_kg, express=False", "base = 4.99 if weight_kg < 2 else 9.99\n"
     "    return base * 2 if express else base"),
    ("format_money", "value, currency=\"EUR\"", "return f\"{value:,.2f} {currency}\""),
    ("find_item", "items, sku", "for item in items:\n        if item.sku == sku:\n            return item\n    return None"),
    ("restock", "inventory, sku, count", "if count <= 0:\n        raise ValueError(\"count must be positive\")\n"
     "    inventory[sku] = inventory.get(sku, 0) + count\n    return inventory[sku]"),
    ("remove_item", "items, sku", "return [item for item in items if item.sku != sku]"),
    ("cheapest", "items", "return min(items, key=lambda item: item.price) if items else None"),
    ("order_total", "items, region, percent=0", "net = apply_discount(subtotal(items), percent)\n"
     "    return net + tax_for(net, region)"),
    ("summary_line", "order", "total = order_total(order.items, order.region, order.discount)\n"
     "    return f\"Order {order.id}: {len(order.items)} items, {format_money(total)}\""),
]


def code_file() -> str:
    """A ~500-token module (SmolLM2's tokenizer) of small shop functions."""
    head = ('"""Prices, taxes and stock for the shop."""\n\nfrom dataclasses import dataclass\n\n'
            'TAX_RATES = {"fr": 0.2, "de": 0.19, "it": 0.22, "es": 0.21}\nDEFAULT_TAX = 0.2\n\n\n'
            '@dataclass\nclass Item:\n    sku: str\n    price: float\n    quantity: int = 1\n\n\n')
    return head + "\n\n".join(f"def {name}({args}):\n    {body}\n" for name, args, body in _FUNCS)


PASSAGE = (
    "At the council meeting on Tuesday, the mayor opened with a warning. \"The river has risen faster this "
    "spring than in any year since records began,\" she said. \"We will close the lower bridge on Friday "
    "and keep it closed until the water falls below the safety mark.\" The head of the fire service "
    "added that crews would stand by at both ends of the town. \"Nobody should try to cross the ford by "
    "car; the current there is strong enough to move a truck,\" he said. A local shop owner asked how "
    "long the closure would last. The mayor replied: \"Until the engineers tell us the bridge is safe, and "
    "not one day longer.\" The council then voted to fund sandbags for the houses nearest the bank."
)
CHATS = [
    "What is the capital of France?", "Give me one tip for learning to code.", "Why is the sky blue?",
    "Describe a cat in one sentence.", "What does a CPU do?", "Suggest a name for a goldfish.",
    "Explain recursion briefly.", "What is photosynthesis?",
]
RENAMES = [("apply_discount", "discounted_price"), ("subtotal", "items_subtotal"), ("tax_for", "tax_amount"),
           ("restock", "add_stock"), ("cheapest", "lowest_priced"), ("find_item", "lookup_item"),
           ("shipping_cost", "delivery_cost"), ("remove_item", "drop_item")]
QUOTE_TASKS = [
    "Summarise this passage in three sentences, quoting the mayor's statements exactly.",
    "Summarise this passage, quoting every statement exactly.",
    "Quote what the mayor said, word for word, then summarise the rest in one sentence.",
    "Write a short news summary of this passage that quotes the fire service exactly.",
    "Summarise this passage for a town newsletter, keeping the quotes exact.",
    "List each quoted statement in this passage exactly, with who said it.",
    "Summarise this passage, quoting the mayor's reply to the shop owner exactly.",
    "Rewrite this passage as a short report, keeping every quote word for word.",
]


def prompts(workload: str, n: int) -> list[str]:
    if workload == "code":
        code = code_file()
        return [f"Rename the function `{a}` to `{b}` everywhere in this file (the definition and every call) and "
                f"output the whole file, nothing else.\n\n```python\n{code}```" for a, b in RENAMES[:n]]
    if workload == "quote":
        return [f"{task}\n\n{PASSAGE}" for task in QUOTE_TASKS[:n]]
    return CHATS[:n]


@dataclass
class Run:
    per_stream: float  # mean over streams of completion tokens / seconds from arrival to the last token
    outputs: list[list[int]]
    drafted: int
    accepted: int
    steps: int
    tokens: int


def run(engine: LLMEngine, ids: list[list[int]], max_tokens: int) -> Run:
    stats = engine.spec_stats
    before = replace(stats)
    params = SamplingParams(max_tokens=max_tokens)
    start = time.perf_counter()
    seqs = [engine.add_request(f"r{i}-{time.monotonic_ns()}", p, params) for i, p in enumerate(ids)]
    done: dict[str, float] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = time.perf_counter()
    rates = [s.num_completion_tokens / (done[s.seq_id] - start) for s in seqs]
    return Run(statistics.mean(rates), [s.completion_token_ids for s in seqs],
               stats.drafted_tokens - before.drafted_tokens, stats.accepted_tokens - before.accepted_tokens,
               stats.decode_steps - before.decode_steps, stats.decode_tokens - before.decode_tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory or tiny (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--weights", default="gguf", choices=["gguf", "float"],
                    help="the default model's weights: its GGUF blocks as served (default) or dequantized")
    ap.add_argument("--method", default="ngram", choices=["ngram", "suffix"])
    ap.add_argument("--k", type=int, default=4, help="draft tokens a step at most")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions per engine (median kept)")
    ap.add_argument("--max-tokens", type=int, nargs=3, default=[600, 200, 96], metavar=("CODE", "QUOTE", "CHAT"))
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="the tiny model, a few tokens: seconds (the suite)")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.concurrency, args.reps, args.max_tokens = "tiny", [1, 2], 1, [12, 8, 8]
    from pdserve.kernels.quant_ops import choose_isa

    print(f"CPU ISA {isa_summary()}; quant kernels {choose_isa().reason}")
    model = resolve_model(args.model, weights=args.weights)
    base = EngineConfig(model=str(model.path), num_kv_blocks=2048, max_num_seqs=16, num_threads=args.num_threads)
    off = LLMEngine(base)
    on = LLMEngine(replace(base, speculative=args.method, num_speculative_tokens=args.k))
    print(f"model {model.name} ({off.model_config.arch}, weights {off.weights.describe()}); "
          f"speculative {args.method} k={args.k} against off; greedy; median of {args.reps} interleaved runs")
    print(f"{'workload':8} {'conc':>4} {'off tok/s':>10} {'on tok/s':>9} {'ratio':>6} {'target':>7} "
          f"{'accept':>7} {'tok/step':>8} identical")
    failed = []
    for workload, max_tokens in zip(("code", "quote", "chat"), args.max_tokens, strict=True):
        for conc in args.concurrency:
            ids = [off.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts(workload, conc)]
            runs: dict[str, list[Run]] = {"off": [], "on": []}
            run(on, ids[:1], 4)  # warm both (first-call allocations)
            run(off, ids[:1], 4)
            for _ in range(args.reps):
                runs["off"].append(run(off, ids, max_tokens))
                runs["on"].append(run(on, ids, max_tokens))
            off_rate = statistics.median(r.per_stream for r in runs["off"])
            on_rate = statistics.median(r.per_stream for r in runs["on"])
            same = all(a.outputs == runs["off"][0].outputs for a in runs["on"] + runs["off"])
            drafted = sum(r.drafted for r in runs["on"])
            accepted = sum(r.accepted for r in runs["on"])
            per_step = sum(r.tokens for r in runs["on"]) / max(1, sum(r.steps for r in runs["on"]))
            ratio = on_rate / off_rate
            target = TARGETS[workload]
            ok = ratio >= target
            if not ok or not same:
                failed.append(f"{workload}@{conc}")
            print(f"{workload:8} {conc:>4} {off_rate:>10.1f} {on_rate:>9.1f} {ratio:>5.2f}x {target:>6.2f}x "
                  f"{accepted / max(1, drafted):>7.2f} {per_step:>8.2f} {'yes' if same else 'NO'}"
                  f"{'' if ok else '  (below target)'}")
    for engine in (off, on):
        assert engine.block_manager.num_used_blocks == 0
        engine.scheduler.check_integrity()
    print("all targets met, outputs identical" if not failed else f"below target or not identical: {', '.join(failed)}")
    return 0 if args.quick or not failed else 1


if __name__ == "__main__":
    sys.exit(main())
