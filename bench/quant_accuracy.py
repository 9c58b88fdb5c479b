"""Quantized weights against the dequantized float model of the same GGUF: top-1 agreement and perplexity.

    .venv/bin/python bench/quant_accuracy.py [--model DIR] [--steps 64] [--smoke]

DIR is a quantized model directory (model.gguf; default: the default model's Q4_1 GGUF, served as it is).
The reference is the same blocks dequantized to float32 (testing.quant_accuracy.dequantized_model), so
only the kernels' arithmetic differs: the activations rounded per block (by default int8x2: an int8 value
plus the int8 rounding of its residual, about 15 bits; PDSERVE_QUANT_ACTIVATIONS=int8 for llama.cpp's
8 bits), integer dot products; at decode the 32-value types take each activation as one int16 term.
- Teacher-forced top-1 agreement over 8 chat prompts: each prompt, then the reference's own `--steps`
  greedy tokens fed one decode step at a time to both models; every disagreement is listed with the
  reference's logit gap between the two picks and the two models' largest logit difference there; the
  distribution of the reference's top-1 - top-2 gaps says how close the near-ties are.
- Perplexity of both on a fixed English text (the first 512 tokens of PERPLEXITY_TEXT, repeated), and
  their ratio.
`--smoke` runs the tiny model quantized to Q8_0 with 2 prompts x 4 steps (seconds; the suite runs it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu_isa import isa_summary  # noqa: E402
from pdserve.engine.default_model import fetch_default_model  # noqa: E402
from pdserve.engine.loader import load_model  # noqa: E402
from pdserve.engine.model_config import load_model_config  # noqa: E402
from pdserve.engine.tokenizer import Tokenizer  # noqa: E402
from pdserve.kernels import get_kernel_ops  # noqa: E402
from testing.quant_accuracy import Agreement, dequantized_model, measure, teacher_forced_logits  # noqa: E402

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for learning to cook.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23? Show your work.",
    "Summarize the plot of Romeo and Juliet.",
    "Write a Python function that reverses a string.",
)
PERPLEXITY_TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable metal type made it "
    "possible to reproduce books far faster than scribes could copy them by hand. Within a few decades, "
    "printing shops had spread across Europe, and the price of books fell sharply. Scholars could compare "
    "identical copies of a text, errors could be corrected in later editions, and ideas travelled between "
    "cities in weeks rather than years. Historians still debate how much the press changed the course of "
    "the Reformation, the scientific revolution and the growth of literacy, but few doubt that it altered "
    "how knowledge was stored and shared. "
)


def perplexities(model_dir: Path, tokens: list[int]) -> tuple[float, float]:
    """(quantized, dequantized reference) perplexity of `tokens` in one prefill each."""
    loaded = load_model(model_dir, ops=get_kernel_ops())
    ref = dequantized_model(loaded)
    out = []
    target = torch.tensor(tokens[1:])
    for model in (loaded.model, ref):
        logits = teacher_forced_logits(model, tokens)[:-1].double()
        nll = -torch.log_softmax(logits, -1).gather(1, target[:, None]).mean()
        out.append(float(torch.exp(nll)))
    return out[0], out[1]


def report(agreement: Agreement, ppl: tuple[float, float]) -> None:
    gaps = sorted(agreement.top2_gaps)
    print(f"teacher-forced top-1 agreement: {agreement.same_top1}/{agreement.positions} = {agreement.rate:.2%}")
    print(f"reference top-1 - top-2 gap: min {gaps[0]:.3f}, p10 {gaps[len(gaps) // 10]:.3f}, "
          f"median {statistics.median(gaps):.3f}")
    for q, r, gap, diff in agreement.misses:
        print(f"  disagreement: quantized picks {q}, reference {r}: reference gap {gap:.3f} "
              f"(largest logit difference there {diff:.3f})")
    print(f"perplexity on the fixed text: quantized {ppl[0]:.4f}, dequantized {ppl[1]:.4f}, "
          f"ratio {ppl[0] / ppl[1]:.4f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a quantized model directory (default: the default model's Q4_1)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    print(f"ISA: {isa_summary()}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            from pdserve.engine.quantize import quantize_model
            from pdserve.engine.tiny import default_model_dir

            model_dir = quantize_model(default_model_dir("llama"), Path(tmp) / "q", "Q8_0", log=False)
            prompts, steps, text_tokens = PROMPTS[:2], 4, 64
        else:
            model_dir = Path(args.model) if args.model else fetch_default_model(weights="gguf")
            prompts, steps, text_tokens = PROMPTS, args.steps, 512
        cfg = load_model_config(model_dir)
        tok = Tokenizer(str(model_dir))
        print(f"model: {model_dir} ({cfg.weight_format}), {len(prompts)} prompts x {steps} steps")
        encoded = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
        agreement = measure(model_dir, encoded, steps)
        text = tok.encode(PERPLEXITY_TEXT * 8)[:text_tokens]
        report(agreement, perplexities(model_dir, text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
