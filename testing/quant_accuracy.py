"""How closely a model served from GGUF blocks follows the float model of the same blocks.

The reference is the dequantized model: the same GGUF read through `GGUFWeights.get` (every tensor
dequantized to float32) into a float `CausalLM`. Both see the same token sequences (teacher forcing: the
reference's own greedy continuation of each prompt), so each position compares one prediction, not a
drifting text. Used by bench/quant_accuracy.py and tests/test_quantized_model.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.gguf_weights import GGUFWeights
from pdserve.engine.loader import LoadedModel, load_model
from pdserve.engine.model import CausalLM
from pdserve.engine.model_config import GGUF_WEIGHTS
from pdserve.kernels import get_kernel_ops

BLOCK = 16


def dequantized_model(loaded: LoadedModel) -> CausalLM:
    """The float32 model whose weights are `loaded`'s GGUF blocks dequantized (the accuracy reference)."""
    cfg = loaded.config
    model = CausalLM(cfg, loaded.model.ops)
    reader = GGUFWeights(loaded.path / GGUF_WEIGHTS, cfg)
    model.load_hf_weights(reader.get)
    return model.eval()


def _meta(start: int, n: int, blocks: int) -> AttentionMetadata:
    """One sequence on blocks 0..blocks-1: a prefill chunk of n tokens at `start`, or (n == 1, start > 0)
    a decode step, as the runner packs them."""
    table = torch.arange(blocks, dtype=torch.int32)[None]  # [1, MB]
    slots = torch.arange(start, start + n, dtype=torch.int64)
    if n == 1 and start > 0:
        return AttentionMetadata(slot_mapping=slots, num_decode_tokens=1, decode_block_tables=table,
                                 decode_context_lens=torch.tensor([start + 1], dtype=torch.int32),
                                 prefill_block_tables=None, prefill_cu_seqlens_q=None, prefill_context_lens=None)
    return AttentionMetadata(slot_mapping=slots, num_decode_tokens=0, decode_block_tables=None, decode_context_lens=None,
                             prefill_block_tables=table, prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                             prefill_context_lens=torch.tensor([start + n], dtype=torch.int32))


@torch.inference_mode()
def teacher_forced_logits(model: CausalLM, tokens: list[int], prompt_len: int | None = None) -> torch.Tensor:
    """Logits [n, V] float32 at every position of `tokens` over a fresh KV cache: the first `prompt_len`
    tokens (default: all) in one prefill, then the rest one decode step each, as served."""
    cfg = model.cfg
    n = len(tokens)
    first = n if prompt_len is None else prompt_len
    blocks = -(-n // BLOCK)
    kv = torch.zeros(cfg.kv_cache_shape(blocks, BLOCK), dtype=model.act_dtype)
    ids = torch.tensor(tokens, dtype=torch.int64)
    out = []
    for start, size in [(0, first)] + [(p, 1) for p in range(first, n)]:
        meta = _meta(start, size, blocks)
        hidden = model(ids[start : start + size], torch.arange(start, start + size, dtype=torch.int64), meta, kv)
        out.append(model.compute_logits(hidden))
    return torch.cat(out)


@torch.inference_mode()
def greedy_continuation(model: CausalLM, prompt: list[int], steps: int) -> list[int]:
    """`steps` greedy tokens after `prompt`: one prefill, then a decode step per token."""
    cfg = model.cfg
    blocks = -(-(len(prompt) + steps) // BLOCK)
    kv = torch.zeros(cfg.kv_cache_shape(blocks, BLOCK), dtype=model.act_dtype)
    tokens = list(prompt)
    start, size = 0, len(prompt)
    for _ in range(steps):
        ids = torch.tensor(tokens[start : start + size], dtype=torch.int64)
        hidden = model(ids, torch.arange(start, start + size, dtype=torch.int64), _meta(start, size, blocks), kv)
        tokens.append(int(model.compute_logits(hidden[-1:])[0].argmax()))
        start, size = len(tokens) - 1, 1
    return tokens[len(prompt):]


@dataclass
class Agreement:
    positions: int = 0
    same_top1: int = 0
    # (quantized's pick, reference's pick, the reference's logit gap between them) where they differ
    # and the largest |logit difference| between the two models at that position
    misses: list[tuple[int, int, float, float]] = field(default_factory=list)
    top2_gaps: list[float] = field(default_factory=list)  # the reference's top-1 - top-2 gap, every position
    nll_quant: float = 0.0  # summed negative log-likelihood of the next token
    nll_ref: float = 0.0

    @property
    def rate(self) -> float:
        return self.same_top1 / max(self.positions, 1)

    def perplexity(self, which: str) -> float:
        return math.exp((self.nll_quant if which == "quant" else self.nll_ref) / max(self.positions, 1))

    def add(self, quant: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> None:
        """quant, ref: [n, V] logits at n positions; targets [n]: the tokens that followed."""
        q_top, r_top = quant.argmax(-1), ref.argmax(-1)
        top2 = ref.topk(2, dim=-1).values  # [n, 2]
        self.top2_gaps += (top2[:, 0] - top2[:, 1]).tolist()
        for i in torch.nonzero(q_top != r_top).flatten().tolist():
            gap = float(ref[i, r_top[i]] - ref[i, q_top[i]])
            self.misses.append((int(q_top[i]), int(r_top[i]), gap, float((quant[i] - ref[i]).abs().max())))
        self.positions += int(targets.numel())
        self.same_top1 += int((q_top == r_top).sum())
        self.nll_quant -= float(torch.log_softmax(quant.double(), -1).gather(1, targets[:, None]).sum())
        self.nll_ref -= float(torch.log_softmax(ref.double(), -1).gather(1, targets[:, None]).sum())


def measure(model_dir: Path, prompts: list[list[int]], steps: int) -> Agreement:
    """Teacher-forced agreement of the quantized model of `model_dir` with its dequantized model over
    each prompt followed by the reference's own `steps` greedy tokens, the continuation fed one decode
    step at a time (the kernels' decode path, as served)."""
    loaded = load_model(model_dir, ops=get_kernel_ops())
    ref = dequantized_model(loaded)
    out = Agreement()
    for prompt in prompts:
        tokens = prompt + greedy_continuation(ref, prompt, steps)
        span = slice(len(prompt) - 1, len(tokens) - 1)  # positions predicting the continuation
        targets = torch.tensor(tokens[len(prompt):])
        quant = teacher_forced_logits(loaded.model, tokens, len(prompt))[span]
        out.add(quant, teacher_forced_logits(ref, tokens, len(prompt))[span], targets)
    return out
