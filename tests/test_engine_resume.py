"""Resumed requests through the real tiny model: a request restarted with the first k completion tokens of
an uninterrupted run (and the text that run had released by then) yields exactly the rest of that run,
tokens and text, greedy and seeded, with penalties, across a stop string straddling the resume point,
and after a reservation is turned into a local request at any point (`prefill_here`). Every test ends
with a clean block manager."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Resume, TokenLogprob
from pdserve.engine.tiny import default_model_dir

PROMPT = "The quick brown fox " * 6


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(default_model_dir("llama")), dtype="float32", num_kv_blocks=256,
                                  block_size=16))


@pytest.fixture(autouse=True)
def clean_after(engine: LLMEngine):
    yield
    engine.check_integrity()
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0


@dataclass
class Run:
    outputs: list[RequestOutput]

    @property
    def token_ids(self) -> list[int]:
        return [t for o in self.outputs for t in o.new_token_ids]

    @property
    def text(self) -> str:
        return "".join(o.new_text for o in self.outputs)

    def text_after(self, k: int) -> str:
        """Text released with the first k tokens (one token per output in an engine run)."""
        assert all(len(o.new_token_ids) <= 1 for o in self.outputs)
        return "".join(o.new_text for o in self.outputs[:k])

    @property
    def last(self) -> RequestOutput:
        return self.outputs[-1]


def drain(engine: LLMEngine, rid: str) -> Run:
    outs: list[RequestOutput] = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs and outs[-1].finished
    return Run(outs)


def run(engine: LLMEngine, rid: str, prompt: list[int], sp: SamplingParams, resume: Resume | None = None) -> Run:
    engine.add_request(rid, prompt, sp, resume=resume)
    return drain(engine, rid)


def resume_after(full: Run, k: int) -> Resume:
    return Resume(tuple(full.token_ids[:k]), len(full.text_after(k)))


def assert_suffix(full: Run, k: int, resumed: Run) -> None:
    assert resumed.token_ids == full.token_ids[k:]
    assert full.text_after(k) + resumed.text == full.text
    assert resumed.last.finish_reason == full.last.finish_reason
    assert resumed.last.stop_reason == full.last.stop_reason
    assert resumed.last.num_completion_tokens == full.last.num_completion_tokens


@pytest.mark.parametrize("sp", [
    SamplingParams(max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True, frequency_penalty=0.7,
                   presence_penalty=0.3, repetition_penalty=1.2),
], ids=["greedy", "seeded", "seeded-penalties"])
def test_resumed_request_yields_the_rest_of_the_uninterrupted_run(engine: LLMEngine, sp: SamplingParams) -> None:
    prompt = engine.tokenizer.encode(PROMPT)
    full = run(engine, "full", prompt, sp)
    assert len(full.token_ids) == 20
    for k in (1, 7, 19):
        assert_suffix(full, k, run(engine, f"r{k}", prompt, sp, resume_after(full, k)))


def test_stop_string_straddling_the_resume_point(engine: LLMEngine) -> None:
    """The resumed node holds back (and then matches) the start of a stop string the first node had
    already held back: the text is the uninterrupted run's, cut at the stop string."""
    prompt = engine.tokenizer.encode(PROMPT)
    greedy = run(engine, "g", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    ids = greedy.token_ids
    texts = [engine.tokenizer.decode(prompt + ids[:i])[len(engine.tokenizer.decode(prompt)):]
             for i in range(len(ids) + 1)]
    start = next(i for i in range(4, len(ids) - 3) if len(texts[i + 1]) - len(texts[i]) >= 2)
    stop = texts[-1][len(texts[start]) + 1 : len(texts[start + 2]) + 1]  # from inside token start to start+2
    sp = SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop])
    full = run(engine, "full", prompt, sp)
    assert full.last.finish_reason == "stop" and full.last.stop_reason == stop
    k = start + 1  # the stop string has begun (and is held back) but is not complete
    assert len(full.text_after(k)) < len(texts[k]), "the first node held back the stop string's start"
    resumed = run(engine, "r", prompt, sp, resume_after(full, k))
    assert_suffix(full, k, resumed)
    # A resume point whose held-back text turned out not to be a stop string releases it after all.
    other = SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop + "\x00"])
    whole = run(engine, "w", prompt, other)
    assert whole.last.finish_reason == "length" and stop in whole.text
    assert_suffix(whole, k, run(engine, "r2", prompt, other, resume_after(whole, k)))


def test_text_the_first_node_did_not_deliver_comes_first(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode(PROMPT)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    full = run(engine, "full", prompt, sp)
    resumed = run(engine, "r", prompt, sp, Resume(tuple(full.token_ids[:5]), 0))
    assert resumed.token_ids == full.token_ids[5:] and resumed.text == full.text


@pytest.mark.parametrize("k", [0, 4])
@pytest.mark.parametrize("first_token", [False, True])
def test_prefill_here_continues_a_reservation(engine: LLMEngine, k: int, first_token: bool) -> None:
    """A reserved (resumed or not) request whose K/V will not arrive, before or after the prefill node's
    first token, is computed here and continues the stream with neither gap nor repeat (seeded)."""
    prompt = engine.tokenizer.encode(PROMPT)
    sp = SamplingParams(temperature=1.0, seed=9, max_tokens=14, ignore_eos=True, logprobs=1)
    full = run(engine, "full", prompt, sp)
    resume = resume_after(full, k) if k else None
    assert engine.reserve("r", prompt, sp, resume) is not None and engine.block_manager.num_used_blocks > 0
    outs = []
    if first_token:
        lp = TokenLogprob(full.token_ids[k], -1.0, [])
        outs.append(engine.append_first_token("r", full.token_ids[k], lp))
    seq = engine.prefill_here("r")
    assert engine.block_manager.num_used_blocks == 0 and not engine.scheduler.reserved_seqs
    resumed = Run(outs + drain(engine, "r").outputs)
    assert_suffix(full, k, resumed)
    assert seq.num_completion_tokens == 14 and len(seq.logprobs) == 14 - k
    with pytest.raises(KeyError):
        engine.prefill_here("r")


def test_resume_validation(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode(PROMPT)
    sp = SamplingParams(max_tokens=4, stop_token_ids=[42])
    with pytest.raises(ValueError, match="nothing of max_tokens"):
        engine.add_request("a", prompt, sp, resume=Resume((7, 8, 9, 10)))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("b", prompt, sp, resume=Resume((10**9,)))
    with pytest.raises(ValueError, match="ended the request"):
        engine.add_request("c", prompt, sp, resume=Resume((7, 42)))
    with pytest.raises(ValueError, match="resume_text_chars"):
        engine.add_request("d", prompt, sp, resume=Resume((7,), text_chars=1000))
    with pytest.raises(ValueError, match="context length"):
        engine.reserve("e", prompt, SamplingParams(max_tokens=engine.max_model_len), Resume((7,)))
    with pytest.raises(ValueError):
        Resume(())
    assert not engine.has_unfinished() and not engine.scheduler.reserved_seqs
