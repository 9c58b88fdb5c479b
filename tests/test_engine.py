"""Engine behaviour through the real tiny model: seeded sampling, stop strings, whole UTF-8 characters,
abort, logprobs, validation, and the `pdserve generate` CLI. Every test ends with a clean block manager."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tiny import default_model_dir


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(default_model_dir("llama")), dtype="float32", num_kv_blocks=256))


@pytest.fixture(autouse=True)
def clean_after(engine):
    yield
    engine.block_manager.check_integrity()
    engine.scheduler.check_integrity()
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used_blocks == 0


PROMPTS = ["Once upon a time", "def main():", "The quick brown fox", "数据"]


def test_seeded_sampling_is_reproducible(engine):
    def run(seed: int, prompts: list[str]) -> list[str]:
        sp = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=24, ignore_eos=True)
        return [r.text for r in engine.generate(prompts, sp)]

    a = run(7, PROMPTS)
    b = run(7, list(reversed(PROMPTS)))[::-1]  # other batch order: per-request generators
    c = run(8, PROMPTS)
    assert a == b
    assert all(x != y for x, y in zip(a, c, strict=True))


def test_stop_string_across_tokens_is_excluded(engine):
    greedy = engine.generate(["The quick brown fox"], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    ids = greedy.token_ids
    # Pick a stop string that starts inside one token's text and ends inside a later one.
    texts = [engine.tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    full = texts[-1]
    start = next(i for i in range(4, len(ids) - 3) if len(texts[i + 1]) - len(texts[i]) >= 2)
    cut = len(texts[start]) + 1  # one character into token `start`
    stop = full[cut : len(texts[start + 2]) + 1]  # spans into token start+2
    assert len(stop) >= 3
    res = engine.generate(["The quick brown fox"], SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert res.finish_reason == "stop" and res.stop_reason == stop
    assert res.text == full[: full.index(stop)]


def test_multibyte_characters_come_out_whole(engine):
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=48, ignore_eos=True)
    prompt = "中文字符和表情符号 🙂 混合在一起"
    seq = engine.add_request("mb", prompt, sp)
    pieces = []
    while engine.has_unfinished():
        pieces += [o.new_text for o in engine.step()]
    text = "".join(pieces)
    assert text == engine.tokenizer.decode(seq.completion_token_ids)
    encoded_multibyte = [t for t in engine.tokenizer.encode("中文") if len(engine.tokenizer.decode([t])) == 0
                         or "\ufffd" in engine.tokenizer.decode([t])]
    assert encoded_multibyte, "the tokenizer should split some CJK characters across byte tokens"


def test_split_multibyte_prompt_echo(engine):
    # Feed the byte tokens of a CJK string as "generated" tokens one at a time through the detokenizer.
    from pdserve.engine.detokenizer import IncrementalDetokenizer

    ids = engine.tokenizer.encode("汉字🙂ok", add_special_tokens=False)
    det = IncrementalDetokenizer(engine.tokenizer, [1], [])
    out = [det.add([t]).text for t in ids] + [det.flush()]
    assert all("\ufffd" not in p for p in out)
    assert "".join(out) == "汉字🙂ok"


def test_abort_frees_everything(engine):
    sp = SamplingParams(max_tokens=50, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"a{i}", "x " * (20 + 30 * i), sp)
    engine.step()
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    for i in range(4):
        assert engine.abort(f"a{i}")
    assert not engine.abort("a0")


def test_logprobs(engine):
    res = engine.generate(["Hello"], SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True))[0]
    assert len(res.logprobs) == 5
    for tok, lp in zip(res.token_ids, res.logprobs, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert lp.top[0][0] == tok  # greedy: the sampled token is the most likely one


def test_validation(engine):
    with pytest.raises(ValueError, match="context length"):
        engine.add_request("long", [5] * 10, SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("bad", [10**9], SamplingParams())
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)


def test_cli_generate_prints_only_text():
    cmd = [sys.executable, "-m", "pdserve.deploy", "generate", "--model", "tiny", "--prompt", "Hello there", "--max-tokens", "8"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    assert "[pdserve]" in p.stderr and "completion_tokens=8" in p.stderr
    assert "[pdserve]" not in p.stdout and p.stdout.strip()
    p2 = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    assert p.stdout == p2.stdout  # greedy by default


def test_prefill_here_turns_a_reservation_into_a_local_request(engine):
    """A reserved request whose remote prefill failed is freed and run here, seed and all: same text as
    an ordinary request with the same params."""
    sp = SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    prompt = engine.tokenizer.encode("The quick brown fox " * 8)
    want = engine.generate([prompt], sp)[0].text
    assert engine.reserve("r", prompt, sp) is not None and engine.block_manager.num_used_blocks > 0
    seq = engine.prefill_here("r")
    assert engine.block_manager.num_used_blocks == 0 and not engine.scheduler.reserved_seqs
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == "r"]
    assert outs[-1].finished and "".join(o.new_text for o in outs) == want and seq.num_completion_tokens == 16
    with pytest.raises(KeyError):
        engine.prefill_here("r")


class _Recorder:
    """A prefill watcher that snapshots, at each layer_done, every layer's K/V of the watched blocks."""

    def __init__(self, engine: LLMEngine, fail_at: int | None = None) -> None:
        self.engine = engine
        self.fail_at = fail_at
        self.calls: list[tuple[int, list[str]]] = []  # (engine step index, completing seq ids)
        self.events: list[object] = []  # layer indices, then ("done", ok)
        self.snapshots: list[torch.Tensor] = []  # per layer_done: [L, 2, n, BS, Hkv, D]
        self.blocks: list[int] = []
        self.step_index = 0

    def __call__(self, seqs):
        self.calls.append((self.step_index, [s.seq_id for s in seqs]))
        self.blocks = [b for s in seqs for b in s.block_table]
        return self

    def layer_done(self, layer: int) -> None:
        if layer == self.fail_at:
            raise RuntimeError("injected failure in the forward")
        self.events.append(layer)
        self.snapshots.append(self.engine.kv_cache[:, :, self.blocks].clone())

    def step_done(self, ok: bool) -> None:
        self.events.append(("done", ok))


@pytest.fixture(scope="module")
def chunked_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(default_model_dir("llama")), dtype="float32", num_kv_blocks=256,
                                  max_num_batched_tokens=32))


def test_prefill_watcher_sees_each_layer_of_the_completing_step(chunked_engine):
    """A prompt in three chunks: the watcher is called once, in the step of the last chunk, with that
    sequence; layer l's K/V are final when layer_done(l) runs and the next layers' are not yet."""
    engine = chunked_engine
    num_layers = engine.model_config.num_layers
    rec = _Recorder(engine)
    engine.prefill_watcher = rec
    try:
        engine.add_request("w0", list(range(10, 80)), SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
            rec.step_index += 1
    finally:
        engine.prefill_watcher = None
    assert engine.block_manager.num_used_blocks == 0
    assert rec.calls == [(2, ["w0"])]  # 70 prompt tokens in chunks of 32: the third step completes them
    assert rec.events == [*range(num_layers), ("done", True)]
    final = rec.snapshots[-1]
    for layer, snap in enumerate(rec.snapshots):
        assert torch.equal(snap[: layer + 1], final[: layer + 1]), f"layers up to {layer} final at layer_done({layer})"
        if layer + 1 < num_layers:
            assert not torch.equal(snap[layer + 1], final[layer + 1]), f"layer {layer + 1} written before its time"


def test_prefill_watcher_hears_of_a_failed_step(chunked_engine):
    engine = chunked_engine
    rec = _Recorder(engine, fail_at=1)
    engine.prefill_watcher = rec
    try:
        engine.add_request("w1", list(range(10, 30)), SamplingParams(max_tokens=2, ignore_eos=True))
        with pytest.raises(RuntimeError, match="injected failure"):
            engine.step()
    finally:
        engine.prefill_watcher = None
        engine.abort("w1")
    assert rec.events == [0, ("done", False)]
    engine.scheduler.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
