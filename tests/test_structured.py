"""Structured output and logit_bias in the engine: constrained greedy decoding equals transformers' greedy
decoding under the same llguidance mask (built here independently, from tokenizer.json), output that
parses and validates, the grammar state rebuilt from generated tokens (resume) equal to the live one,
the compiled-grammar cache, and logit_bias forcing and banning tokens."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import numpy as np
import pytest
import torch

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Resume
from pdserve.engine.structured import (
    GrammarCompiler,
    GrammarState,
    allow_tokens,
    apply_grammar_masks,
    batch_bitmask,
    unpack_bitmask,
)
from pdserve.engine.structured_spec import JSON_OPTIONS, GrammarError, StructuredSpec, check_spec
from pdserve.engine.tokenizer import Tokenizer
from testing.cluster import reference_engine

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 20},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "count", "ok"],
    "additionalProperties": False,
}
SCHEMA_SPEC = StructuredSpec("json_schema", json.dumps(SCHEMA))
OBJECT_SPEC = StructuredSpec("json_object")
PROMPTS = ["Give me JSON:", "config =", "The answer is", "hello world"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> LLMEngine:
    return reference_engine(tiny_llama_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def reference_matcher(model_dir: Path, tok: Tokenizer, vocab: int, schema: dict[str, Any]) -> llguidance.LLMatcher:
    """A matcher built straight from llguidance (not through engine.structured)."""
    lltok = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=vocab,
                                   eos_token=sorted(tok.eos_token_ids))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    return llguidance.LLMatcher(lltok, grammar)


def hf_constrained_greedy(hf: torch.nn.Module, matcher: llguidance.LLMatcher, prompt: list[int],
                          eos: frozenset[int], max_tokens: int) -> tuple[list[int], str]:
    """Greedy decoding of transformers' logits with llguidance's mask applied: stops on EOS, when the
    matcher has stopped (the output is complete), or after max_tokens."""
    ids = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()  # [V]
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: logits.shape[0]].astype(bool))
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        out.append(token)
        ids.append(token)
        if token in eos:
            return out, "stop"
        assert matcher.consume_token(token), matcher.get_error()
        if matcher.is_stopped():
            return out, "stop"
    return out, "length"


@pytest.mark.parametrize("schema", [{"type": "object"}, SCHEMA], ids=["json_object", "json_schema"])
def test_constrained_greedy_matches_transformers_under_the_same_mask(
    engine: LLMEngine, hf_model: torch.nn.Module, tiny_llama_dir: Path, schema: dict[str, Any]
) -> None:
    spec = OBJECT_SPEC if schema == {"type": "object"} else SCHEMA_SPEC
    params = SamplingParams(max_tokens=MAX_TOKENS, structured=spec)
    results = engine.generate(PROMPTS, params)  # one batch: the masks of all rows are computed together
    tok = engine.tokenizer
    finishes = []
    for prompt, res in zip(PROMPTS, results, strict=True):
        matcher = reference_matcher(tiny_llama_dir, tok, engine.model_config.vocab_size, schema)
        want, finish = hf_constrained_greedy(hf_model, matcher, res.prompt_token_ids, tok.eos_token_ids, MAX_TOKENS)
        assert res.token_ids == want, prompt
        assert res.finish_reason == finish, prompt
        finishes.append(finish)
        if finish == "stop":
            value = json.loads(res.text)
            assert isinstance(value, dict)
            jsonschema.validate(value, schema)
    # the enum/boolean/bounded-integer schema always terminates; a free object may run on in a string
    assert "stop" in finishes
    if spec is SCHEMA_SPEC:
        assert finishes == ["stop"] * len(PROMPTS)


def test_seeded_sampling_under_a_schema_validates(engine: LLMEngine) -> None:
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s, structured=SCHEMA_SPEC)
              for s in range(6)]
    results = engine.generate(["Tell me"] * len(params), params)
    for res in results:
        assert res.finish_reason == "stop"
        jsonschema.validate(json.loads(res.text), SCHEMA)
    assert len({r.text for r in results}) > 1  # the grammar constrains; it does not make sampling greedy


def test_grammar_state_rebuilt_from_generated_tokens_equals_the_live_one(engine: LLMEngine) -> None:
    """Step by step, a state replayed from the completion tokens so far allows exactly what the live
    state allows; and a request resumed after k tokens continues exactly as the uninterrupted one."""
    prompt = engine.tokenizer.encode("The answer is")
    params = SamplingParams(max_tokens=MAX_TOKENS, structured=SCHEMA_SPEC)
    seq = engine.add_request("live", prompt, params)
    words = (engine.model_config.vocab_size + 31) // 32
    compared = 0
    while engine.has_unfinished():
        engine.step()
        if seq.is_finished:
            break
        assert seq.grammar is not None
        rebuilt = engine.grammars.new_state(SCHEMA_SPEC, seq.completion_token_ids)
        assert torch.equal(rebuilt.bitmask(words), seq.grammar.bitmask(words))
        assert rebuilt.finish == seq.grammar.finish and rebuilt.num_tokens == seq.grammar.num_tokens
        engine.check_integrity()  # which also checks the grammar consumed every completion token
        compared += 1
    full = seq.completion_token_ids
    assert compared >= 5 and seq.finish_reason == "stop"
    for k in (1, len(full) // 2, len(full) - 1):
        engine.add_request(f"resumed-{k}", prompt, params, resume=Resume(tuple(full[:k])))
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
        assert full[:k] + tokens == full, k


def test_resumed_tokens_the_grammar_rejects_are_refused(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode("hello")
    not_json = engine.tokenizer.encode("hello")
    with pytest.raises(GrammarError, match="not allowed by the response format"):
        engine.add_request("bad-resume", prompt, SamplingParams(max_tokens=8, structured=SCHEMA_SPEC),
                           resume=Resume(tuple(not_json)))
    engine.check_integrity()


def test_unsupported_schema_is_refused_with_its_reason(engine: LLMEngine) -> None:
    bad = StructuredSpec("json_schema", json.dumps({"type": "object", "if": {}, "then": {}}))
    with pytest.raises(GrammarError, match="if"):
        check_spec(bad)
    with pytest.raises(GrammarError, match="if"):
        engine.add_request("bad-schema", [5, 6], SamplingParams(max_tokens=4, structured=bad))
    with pytest.raises(GrammarError, match="cannot be read"):
        check_spec(StructuredSpec("json_schema", "{nope"))
    engine.check_integrity()


def test_compiled_grammars_are_cached_per_spec_with_a_bound(engine: LLMEngine) -> None:
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, max_cached=2)
    specs = [StructuredSpec("json_schema", json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"}}}))
             for i in range(3)]
    compiler.new_state(specs[0])
    compiler.new_state(specs[0])
    assert compiler.num_compiled == 1
    compiler.new_state(specs[1])
    compiler.new_state(specs[2])  # evicts specs[0], the least recently used
    assert compiler.num_compiled == 3 and len(compiler._cache) == 2
    compiler.new_state(specs[0])
    assert compiler.num_compiled == 4


def test_bitmask_unpacking_orders_bits_by_token_id() -> None:
    words = torch.tensor([[0b101, -(1 << 31)], [0, -1]], dtype=torch.int32)  # [2, 2]
    allowed = unpack_bitmask(words, 64)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, 63]
    assert allowed[1].nonzero().flatten().tolist() == list(range(32, 64))


def test_grammar_masks_match_a_float32_reference_on_a_mixed_batch(engine: LLMEngine) -> None:
    """Rows with and without grammars, shuffled, one grammar in error: the table-lookup mask equals a
    plain per-token reference; a row allowing nothing gets its EOS ids (`allow_tokens`, little-endian bits)."""
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size)
    vocab = engine.model_config.vocab_size
    tok = engine.tokenizer
    states: list[GrammarState | None] = []
    for i in range(6):
        state = compiler.new_state(StructuredSpec("json_schema", json.dumps(
            {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]})))
        for t in tok.encode('{"k' + str(i) + '":', add_special_tokens=False)[: i % 3 + 1]:
            assert state.advance(t)
        states.append(state)
    broken = compiler.new_state(StructuredSpec("json_object"))
    assert not broken.advance(tok.encode("x", add_special_tokens=False)[0])  # JSON cannot start with x
    rows: list[GrammarState | None] = [*states, None, broken, None]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    rows = [rows[i] for i in order]
    eos = [frozenset(tok.eos_token_ids)] * len(rows)
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(1))
    got = apply_grammar_masks(logits, rows, eos)
    for r, state in enumerate(rows):
        if state is None:
            assert torch.equal(got[r], logits[r])
            continue
        allowed = unpack_bitmask(batch_bitmask([state], vocab), vocab)[0]  # [V] bool
        want = torch.where(allowed, logits[r], torch.tensor(float("-inf")))
        assert torch.equal(got[r], want), r
    words = torch.zeros((2, 2), dtype=torch.int32)
    allow_tokens(words, 1, [0, 9, 33, 63])
    assert unpack_bitmask(words, 64)[1].nonzero().flatten().tolist() == [0, 9, 33, 63] and not words[0].any()
    everyone = [s for s in rows if s is not None]  # every row constrained: the no-gather path
    sub = torch.stack([logits[r] for r, s in enumerate(rows) if s is not None])
    assert torch.equal(apply_grammar_masks(sub, everyone, eos[: len(everyone)]),
                       torch.stack([got[r] for r, s in enumerate(rows) if s is not None]))


def test_logit_bias_plus_100_forces_a_token(engine: LLMEngine) -> None:
    forced = engine.tokenizer.encode(" cat", add_special_tokens=False)[-1]
    res = engine.generate(["hello world"], SamplingParams(max_tokens=6, logit_bias={forced: 100.0}))[0]
    assert res.token_ids == [forced] * 6
    sampled = engine.generate(["hello world"], SamplingParams(max_tokens=6, temperature=1.0, seed=1,
                                                               logit_bias={forced: 100.0}))[0]
    assert sampled.token_ids == [forced] * 6


def test_logit_bias_minus_100_bans_tokens(engine: LLMEngine, hf_model: torch.nn.Module) -> None:
    prompt = engine.tokenizer.encode("hello world")
    plain = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    banned = {plain[0]: -100.0, plain[1]: -100.0}
    res = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=banned))[0]
    assert not set(res.token_ids) & set(banned)
    # the first token is the argmax of transformers' logits with the banned ones lowered by 100
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, -1].float()  # [V]
    for t, b in banned.items():
        logits[t] += b
    assert res.token_ids[0] == int(logits.argmax())
    seeded = engine.generate([prompt] * 4, [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True,
                                                           logit_bias=banned) for s in range(4)])
    assert all(not set(r.token_ids) & set(banned) for r in seeded)


def test_logit_bias_is_validated(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={5: 101.0})
    with pytest.raises(ValueError, match="logit_bias token ids"):
        SamplingParams(logit_bias={-1: 1.0})
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias token ids must be in"):
        engine.add_request("bias-oov", [5, 6], SamplingParams(logit_bias={vocab: 1.0}))
    engine.check_integrity()


def test_async_engine_compiles_the_grammar_before_the_engine_thread_sees_the_request(tiny_llama_dir: Path) -> None:
    """The grammar is compiled on a worker thread: the engine thread only copies the cached matcher; a
    schema that does not compile is refused there, with no stream left open and nothing queued."""
    engine = reference_engine(tiny_llama_dir)
    threads: list[str] = []
    compile_template = engine.grammars._template

    def recording(spec: StructuredSpec) -> Any:
        hit = spec in engine.grammars._cache
        threads.append(("hit " if hit else "compile ") + threading.current_thread().name)
        return compile_template(spec)

    engine.grammars._template = recording  # type: ignore[method-assign]

    async def run() -> None:
        async_engine = AsyncEngine(engine, name="grammar-test")
        async_engine.start()
        try:
            stream = await async_engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=MAX_TOKENS,
                                                                                    structured=SCHEMA_SPEC))
            text = ""
            while not stream.finished or not stream.queue.empty():
                text += "".join(o.new_text for o in await stream.next_batch())
            jsonschema.validate(json.loads(text), SCHEMA)
            bad = StructuredSpec("json_schema", json.dumps({"type": "object", "if": {}, "then": {}}))
            with pytest.raises(GrammarError):
                await async_engine.add_request("b", [5, 6], SamplingParams(max_tokens=4, structured=bad))
            assert async_engine.open_streams == frozenset()
            assert not await async_engine.call(lambda e: e.has_unfinished())
        finally:
            await async_engine.close()

    asyncio.run(run())
    engine_thread = [t for t in threads if "grammar-test" in t]
    assert threads[0].startswith("compile ") and "grammar-test" not in threads[0]
    assert engine_thread and all(t.startswith("hit ") for t in engine_thread), threads


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_schema_output_validates_with_other_tokenizers(tiny_model_dir: Any, arch: str) -> None:
    """The llguidance tokenizer is built from each model's tokenizer.json (Qwen's pre-tokenizer here)."""
    engine = reference_engine(tiny_model_dir(arch))
    for res in engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, structured=SCHEMA_SPEC)):
        assert res.finish_reason == "stop"
        jsonschema.validate(json.loads(res.text), SCHEMA)
