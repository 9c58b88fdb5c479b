"""The fused decode step of quantized models (kernels.quant_ops.DecodeStack, `decode_layers` in
csrc/cpu_quant.cpp) against the per-op step it replaces.

A batch of sequences with ragged contexts on shuffled blocks is prefilled by the per-op path; then one
decode step runs both ways over copies of the KV cache. The fused step must give the same final hidden
states up to float32 rounding order, write the same K/V rows into exactly the slots of the step, and
leave every other slot as it was: for every architecture's options (Qwen2's biases, Qwen3's QK norms),
block types, ISA paths, activation roundings, batch sizes on both kernel shapes (row kernels and
panels) and both KV dtypes it takes.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import LoadedModel, load_model
from pdserve.engine.model import FUSED_DECODE_ENV, CausalLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels.quant_ops import ACTIVATIONS_ENV, ISA_ENV, DecodeStack, available_isas

BLOCK = 8
NUM_BLOCKS = 40


def _prefill_meta(table: list[int], n: int) -> AttentionMetadata:
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), num_decode_tokens=0, decode_block_tables=None,
        decode_context_lens=None, prefill_block_tables=torch.tensor([table], dtype=torch.int32),
        prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        prefill_context_lens=torch.tensor([n], dtype=torch.int32))


def _decode_meta(tables: list[list[int]], lens: list[int]) -> AttentionMetadata:
    """One decode token per sequence at position lens[b] - 1 (its context includes it)."""
    width = max(len(t) for t in tables)
    slots = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lens, strict=True)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), num_decode_tokens=len(lens),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        decode_context_lens=torch.tensor(lens, dtype=torch.int32), prefill_block_tables=None,
        prefill_cu_seqlens_q=None, prefill_context_lens=None)


def _batch(model: CausalLM, lens: list[int], kv_dtype: torch.dtype, seed: int):
    """Sequences of `lens` tokens on shuffled blocks, all but the last token of each prefilled per op."""
    cfg = model.cfg
    rng = random.Random(seed)
    pool = list(range(1, NUM_BLOCKS))
    rng.shuffle(pool)
    kv = torch.zeros(cfg.kv_cache_shape(NUM_BLOCKS, BLOCK), dtype=kv_dtype)
    tables, last = [], []
    model.fused_decode = False
    with torch.inference_mode():
        for n in lens:
            table = [pool.pop() for _ in range(-(-n // BLOCK))]
            tokens = [rng.randrange(3, cfg.vocab_size - 3) for _ in range(n)]
            model(torch.tensor(tokens[:-1]), torch.arange(n - 1), _prefill_meta(table, n - 1), kv)
            tables.append(table)
            last.append(tokens[-1])
    return kv, tables, torch.tensor(last), torch.tensor([n - 1 for n in lens])


def _step(model: CausalLM, fused: bool, ids, positions, meta, kv) -> torch.Tensor:
    model.fused_decode, model._stack = fused, None
    with torch.inference_mode():
        out = model(ids, positions, meta, kv)
    assert isinstance(model._stack, DecodeStack) == fused, model.fused_decode_reason
    return out


def _compare(loaded: LoadedModel, lens: list[int], kv_dtype: torch.dtype = torch.float32, seed: int = 0,
             rel: float = 1e-3) -> None:
    model = loaded.model
    kv, tables, ids, positions = _batch(model, lens, kv_dtype, seed)
    meta = _decode_meta(tables, lens)
    kv_ref, kv_fused = kv.clone(), kv.clone()
    ref = _step(model, False, ids, positions, meta, kv_ref)
    got = _step(model, True, ids, positions, meta, kv_fused)
    assert got.shape == ref.shape and got.dtype == torch.float32
    scale = float(ref.abs().max())
    # Float32 rounding order alone, amplified through the layers: up to about 2e-4 of the largest value
    # where an activation's rounding (int16, int8x2) flips with it; one int8's flip moves its value by
    # 1/127 of its group's largest, amplified by the random tiny models (rel 5e-2 for int8 activations).
    torch.testing.assert_close(got, ref, rtol=0, atol=rel * scale)
    # [L, 2, NB*BS, Hkv*D]: the step's slots hold close rows, every other slot is untouched
    flat = lambda t: t.float().flatten(2, 3).flatten(3)  # noqa: E731
    written = torch.zeros(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    written[meta.slot_mapping] = True
    assert torch.equal(flat(kv_fused)[:, :, ~written], flat(kv)[:, :, ~written])
    assert not torch.equal(flat(kv_fused)[:, :, written], flat(kv)[:, :, written])
    kv_scale = float(flat(kv_ref)[:, :, written].abs().max())
    tol = rel if kv_dtype == torch.float32 else max(rel, 1e-2)  # bfloat16: one rounding of 8 bits may flip
    torch.testing.assert_close(flat(kv_fused)[:, :, written], flat(kv_ref)[:, :, written], rtol=0, atol=tol * kv_scale)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q4_1"])
def test_fused_step_matches_the_per_op_step(quantized_dirs: Callable[[str, str], Path], arch: str, kind: str) -> None:
    """Qwen2's q/k/v biases, Qwen3's QK norms, mixed row groups (Q4_K's 384-wide rows fall back to Q8_0);
    three sequences: the panel kernels."""
    _compare(load_model(quantized_dirs(arch, kind)), [5, 17, 11])


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("activations", ["int8x2", "int8"])
@pytest.mark.parametrize("lens", [[9], [3, 30], [7, 2, 25, 16, 1 + BLOCK]], ids=["B1", "B2", "B5"])
def test_fused_step_on_every_isa_path_activation_and_batch(quantized_dirs: Callable[[str, str], Path],
                                                           monkeypatch: pytest.MonkeyPatch, isa: str,
                                                           activations: str, lens: list[int]) -> None:
    """One and two sequences take the row kernels (float rows for the 32-value types under int8x2),
    five the panels; contexts ending on a block boundary and one token past it."""
    monkeypatch.setenv(ISA_ENV, isa)
    monkeypatch.setenv(ACTIVATIONS_ENV, activations)
    for kind in ("Q4_K", "Q4_0"):
        loaded = load_model(quantized_dirs("llama", kind))
        assert loaded.model.qops is not None and loaded.model.qops.isa.name == isa
        _compare(loaded, lens, seed=len(lens), rel=5e-2 if activations == "int8" else 1e-3)


def test_fused_step_on_a_bfloat16_kv_cache(quantized_dirs: Callable[[str, str], Path]) -> None:
    """K/V stored rounded to bfloat16 (nearest even) and read back widened."""
    _compare(load_model(quantized_dirs("qwen3", "Q8_0")), [4, 19], kv_dtype=torch.bfloat16)


def _drafting_batch(model: CausalLM, kv_dtype: torch.dtype, seed: int):
    """A drafting sequence's 1 + 3 decode rows (one block table, contexts n .. n + 3, K/V slots at positions
    n - 1 .. n + 2) between two ordinary sequences: the step a speculative verification runs."""
    n = 13
    kv, tables, last, _ = _batch(model, [6, n + 3, 11], kv_dtype, seed)  # room for the drafts' K/V
    rng = random.Random(seed)
    drafts = [rng.randrange(3, model.cfg.vocab_size - 3) for _ in range(3)]
    rows = [(tables[0], 6), *((tables[1], n + i) for i in range(4)), (tables[2], 11)]
    ids = torch.tensor([int(last[0]), rng.randrange(3, model.cfg.vocab_size - 3), *drafts, int(last[2])])
    # The middle sequence was prefilled with n + 2 tokens by _batch; its rows re-store positions n - 1.. n + 2.
    meta = _decode_meta([t for t, _ in rows], [length for _, length in rows])
    positions = torch.tensor([length - 1 for _, length in rows])
    return kv, ids, positions, meta


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_drafting_sequences_rows_attend_together_as_each_would_alone(
        quantized_dirs: Callable[[str, str], Path], monkeypatch: pytest.MonkeyPatch, isa: str,
        kv_dtype: torch.dtype) -> None:
    """Rows sharing a block table are attended as one group (each K/V row read once): the result is the
    per-op step's, and bit for bit the one the same rows give with the group split (each row on a block
    table of its own holding the same K/V)."""
    monkeypatch.setenv(ISA_ENV, isa)
    model = load_model(quantized_dirs("llama", "Q8_0")).model
    kv, ids, positions, meta = _drafting_batch(model, kv_dtype, seed=3)
    ref = _step(model, False, ids, positions, meta, kv.clone())
    got = _step(model, True, ids, positions, meta, kv.clone())
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-3 * float(ref.abs().max()))
    # The same rows with the group split: one row (the last draft) on a copy of the table's blocks.
    tables = meta.decode_block_tables.clone()
    used = set(tables.flatten().tolist())
    spare = [b for b in range(1, NUM_BLOCKS) if b not in used]
    row = 4
    # The copy holds the K/V the grouped step leaves (the drafts' rows included); the split step stores the
    # same rows at the original slots again.
    kv_grouped, kv_split = kv.clone(), kv.clone()
    grouped = _step(model, True, ids, positions, meta, kv_grouped)
    for j in range(-(-int(meta.decode_context_lens[row]) // BLOCK)):
        kv_split[:, :, spare[j]] = kv_grouped[:, :, int(tables[row, j])]
        tables[row, j] = spare[j]
    split = AttentionMetadata(**{**meta.__dict__, "decode_block_tables": tables})
    alone = _step(model, True, ids, positions, split, kv_split)
    assert torch.equal(alone, grouped), "grouping the rows changed a value"


def test_fused_step_refuses_out_of_range_inputs_before_writing(quantized_dirs: Callable[[str, str], Path]) -> None:
    model = load_model(quantized_dirs("llama", "Q8_0")).model
    kv, tables, ids, positions = _batch(model, [6, 10], torch.float32, seed=1)
    model.fused_decode, model._stack = True, None
    good = _decode_meta(tables, [6, 10])
    before = kv.clone()
    for field, bad, match in (
        ("slot_mapping", torch.tensor([3, NUM_BLOCKS * BLOCK]), "KV slot"),
        ("decode_block_tables", torch.tensor([[NUM_BLOCKS, 0], [1, 2]], dtype=torch.int32), "block table entry"),
        ("decode_context_lens", torch.tensor([6, 3 * BLOCK], dtype=torch.int32), "context length"),
    ):
        meta = AttentionMetadata(**{**good.__dict__, field: bad})
        with pytest.raises(IndexError, match=match), torch.inference_mode():
            model(ids, positions, meta, kv)
        assert torch.equal(kv, before)


def test_engine_decodes_fused_and_says_why_not(quantized_dirs: Callable[[str, str], Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's decode steps go through the stack; the greedy tokens equal the per-op engine's, and
    with PDSERVE_FUSED_DECODE=0 the model says it was turned off."""
    model_dir = quantized_dirs("qwen2", "Q4_K")
    outputs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(FUSED_DECODE_ENV, flag)
        engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, block_size=8))
        for i, prompt in enumerate(([5, 9, 13, 200, 31], [7] * 12)):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=16, ignore_eos=True))
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        outputs[flag] = tokens
        engine.block_manager.check_integrity()
        assert engine.block_manager.num_used_blocks == 0  # every KV block back in the pool
        model = engine.model
        if flag == "1":
            assert isinstance(model._stack, DecodeStack) and model.fused_decode_reason == ""
        else:
            assert model._stack is False and FUSED_DECODE_ENV in model.fused_decode_reason
    assert outputs["1"] == outputs["0"] and all(len(t) == 16 for t in outputs["1"].values())
