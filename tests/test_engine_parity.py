"""Greedy parity: the engine's tokens equal transformers' generate(do_sample=False), through batching,
prefix-cache hits, chunked prefill and preemption, for every tiny architecture and five weight seeds.
fp32 logits lie as close to transformers' float64 logits as transformers' own fp32 generate does (within
FP32_ERROR_FACTOR, see tests/logit_reference.py), not within a fixed atol that holds for some weights only."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tiny import default_model_dir
from tests.logit_reference import assert_fp32_close, forward_logits, load_float64_reference

DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")
ARCHS = ["llama", "qwen2", "qwen3"]
SEEDS = range(5)


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request) -> str:
    return str(default_model_dir(request.param))


@dataclass
class Reference:
    """transformers' model in fp32 (greedy tokens, fp32 error) and in float64 (the reference logits)."""

    fp32: Any
    fp64: Any


def load_reference(model_dir: str) -> Reference:
    from transformers import AutoModelForCausalLM

    fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    return Reference(fp32, load_float64_reference(model_dir, DEVICE))


@pytest.fixture(scope="module")
def hf_model(model_dir) -> Reference:
    return load_reference(model_dir)


def hf_greedy(hf_model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    ids = torch.tensor([prompt], device=DEVICE)
    out = hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=0, do_sample=False,
        eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [lg[0].float().cpu() for lg in out.logits]


def random_prompts(vocab: int, lens: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 8) for _ in range(n)] for n in lens]


def make_engine(model_dir: str, **kw) -> LLMEngine:
    cfg = EngineConfig(model=model_dir, device=DEVICE, dtype="float32", **kw)
    return LLMEngine(cfg, capture_logits=True)


def assert_clean(engine: LLMEngine) -> None:
    """Integrity holds and every block outside the prefix cache is free."""
    bm = engine.block_manager
    bm.check_integrity()
    assert not engine.has_unfinished()
    assert bm.num_used_blocks == 0, f"{bm.num_used_blocks} blocks still held"


def check_parity(engine: LLMEngine, ref: Reference, prompts: list[list[int]], n: int) -> list:
    """Generates n greedy tokens per prompt; asserts they are transformers' fp32 greedy tokens and that
    every step's logits are within the fp32 tolerance of float64 logits teacher-forced on the same tokens
    (transformers' fp32 generate logits give the fp32 error that sets the tolerance)."""
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    results = engine.generate(prompts, params)
    for prompt, res in zip(prompts, results, strict=True):
        ref_tokens, ref_logits = hf_greedy(ref.fp32, prompt, n)
        assert res.token_ids == ref_tokens, f"prompt len {len(prompt)}: {res.token_ids} != {ref_tokens}"
        assert len(res.logits) == n
        ref64 = forward_logits(ref.fp64, prompt + ref_tokens[:-1])[len(prompt) - 1 :]
        assert_fp32_close(torch.stack([lg.cpu() for lg in res.logits]), torch.stack(ref_logits), ref64,
                          f"prompt len {len(prompt)}")
    assert_clean(engine)
    return results


def test_ragged_batch(model_dir, hf_model):
    engine = make_engine(model_dir, enable_prefix_caching=False)
    prompts = random_prompts(engine.model_config.vocab_size, [1, 7, 16, 33, 50, 64], seed=1)
    check_parity(engine, hf_model, prompts, n=10)


def test_prefix_cache_hits(model_dir, hf_model):
    engine = make_engine(model_dir, block_size=16)
    vocab = engine.model_config.vocab_size
    shared = random_prompts(vocab, [48], seed=2)[0]
    tails = random_prompts(vocab, [5, 16, 9], seed=3)
    check_parity(engine, hf_model, [shared + tails[0]], n=6)
    results = check_parity(engine, hf_model, [shared + t for t in tails[1:]] + [shared], n=6)
    assert all(r.num_cached_tokens >= 32 for r in results), [r.num_cached_tokens for r in results]
    assert engine.block_manager.num_cached_blocks > 0


def test_chunked_long_prompt(model_dir, hf_model):
    engine = make_engine(model_dir, max_num_batched_tokens=64, enable_prefix_caching=False)
    prompts = random_prompts(engine.model_config.vocab_size, [300, 20], seed=4)
    check_parity(engine, hf_model, prompts, n=8)


def test_preemption_under_tiny_pool(model_dir, hf_model):
    # 8 requests that each need 5 blocks, with 14 blocks in the pool: decodes must preempt.
    engine = make_engine(model_dir, block_size=8, num_kv_blocks=14, max_num_batched_tokens=64)
    prompts = random_prompts(engine.model_config.vocab_size, [20, 24, 28, 22, 26, 30, 21, 25], seed=5)
    seqs_before = engine.scheduler.num_preemptions if hasattr(engine.scheduler, "num_preemptions") else None
    check_parity(engine, hf_model, prompts, n=12)
    assert engine.scheduler.num_preemptions > (seqs_before or 0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_weight_seeds(arch: str, seed: int) -> None:
    """The tolerances hold for other weights, not just the seed-0 models the tests above use: a small
    ragged batch (prefill, then batched decode) for five weight seeds of each architecture. Teacher-forced
    references (one forward per prompt rather than generate's one per token) keep it cheap."""
    model_dir = str(default_model_dir(arch, seed))
    engine = make_engine(model_dir, enable_prefix_caching=False)
    prompts = random_prompts(engine.model_config.vocab_size, [4, 29], seed=100 + seed)
    results = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    ref = load_reference(model_dir)
    for prompt, res in zip(prompts, results, strict=True):
        tokens = prompt + res.token_ids[:-1]
        hf32 = forward_logits(ref.fp32, tokens)[len(prompt) - 1 :]
        ref64 = forward_logits(ref.fp64, tokens)[len(prompt) - 1 :]
        assert res.token_ids == hf32.argmax(-1).tolist(), f"{arch} seed {seed}: greedy tokens differ"
        assert_fp32_close(torch.stack([lg.cpu() for lg in res.logits]), hf32, ref64,
                          f"{arch} seed {seed} prompt len {len(prompt)}")
    assert_clean(engine)
