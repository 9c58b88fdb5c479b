"""Incremental detokenizer against real byte-level tokenizers built here with the `tokenizers` library."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdserve.engine.detokenizer import DetokenizerDelta, IncrementalDetokenizer

END = "<|end|>"

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Streaming text must never split a character in half.",
    "我们今天去公园散步，天气很好。",
    "大语言模型的推理服务需要流式输出。",
    "你好，世界！Hello, world!",
    "Emoji: 🎉🚀👍🏽 party time 🎉!",
    "Stop strings may span several tokens, 结束 or not.",
]

TEXTS = [
    "Hello, world! The fox is quick.",
    "你好，世界！我们今天去公园散步。",
    "Emoji 🎉🚀 and skin tones 👍🏽 mixed with 中文 text.",
    "混合English和中文🎉，naïve café — déjà vu 😀.",
    "大语言模型 streaming 输出 🚀🚀🚀 done",
]


@dataclass
class TextTokenizer:
    """Adapter over a `tokenizers.Tokenizer`: plain-id encode and the decode the detokenizer needs."""

    tok: Tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        token_id = self.tok.token_to_id(token)
        assert token_id is not None
        return token_id


@dataclass
class RecordingTokenizer(TextTokenizer):
    """Real tokenizer that also remembers the longest id list it was asked to decode."""

    longest_decode: int = field(default=0)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.longest_decode = max(self.longest_decode, len(ids))
        return super().decode(ids, skip_special_tokens)


def _byte_level_setup(tok: Tokenizer) -> Tokenizer:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


@pytest.fixture(scope="module")
def bpe() -> TextTokenizer:
    tok = _byte_level_setup(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=320,  # few merges: CJK characters and emoji stay split over several byte tokens
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[END],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    return TextTokenizer(tok)


@pytest.fixture(scope="module")
def byte_tok() -> TextTokenizer:
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = _byte_level_setup(Tokenizer(models.BPE(vocab=vocab, merges=[])))
    tok.add_special_tokens([END])
    return TextTokenizer(tok)


@pytest.fixture(params=["bpe", "byte_tok"])
def any_tok(request: pytest.FixtureRequest) -> TextTokenizer:
    return request.getfixturevalue(request.param)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[DetokenizerDelta]:
    return [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]


def joined(deltas: list[DetokenizerDelta]) -> str:
    return "".join(d.text for d in deltas)


def test_tokenizers_split_multibyte_characters(bpe: TextTokenizer, byte_tok: TextTokenizer) -> None:
    # the streaming tests below only mean something if characters really are split across tokens
    for ch in ["我", "园", "🎉", "😀"]:
        assert len(bpe.encode(ch)) > 1
        assert len(byte_tok.encode(ch)) == len(ch.encode("utf-8"))
    assert len(bpe.encode("Hello")) < len("Hello")  # merges were learned


@pytest.mark.parametrize("chunk", [1, 3])
def test_streaming_equals_full_decode(any_tok: TextTokenizer, chunk: int) -> None:
    rng = random.Random(0)
    for text in TEXTS:
        ids = any_tok.encode(text)
        # split points on character boundaries, so the generated part decodes on its own
        splits = [i for i in range(1, len(ids) - 1) if not any_tok.decode(ids[:i]).endswith("\ufffd")]
        for split in rng.sample(splits, 4):
            prompt, gen = ids[:split], ids[split:]
            detok = IncrementalDetokenizer(any_tok, prompt)
            deltas = stream(detok, gen, chunk)
            tail = detok.flush()
            assert joined(deltas) + tail == any_tok.decode(gen)
            assert joined(deltas) + tail == any_tok.decode(ids)[len(any_tok.decode(prompt)) :]
            assert all("\ufffd" not in d.text for d in deltas)
            assert tail == ""  # every text ends on a whole character, so nothing was left
            assert not any(d.stopped for d in deltas)
            assert detok.output_text == any_tok.decode(gen)


def test_multibyte_characters_are_held_until_complete(byte_tok: TextTokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode("> "))
    texts = [d.text for d in stream(detok, byte_tok.encode("中🎉a"))]
    assert texts == ["", "", "中", "", "", "", "🎉", "a"]


def test_bpe_holds_partial_characters(bpe: TextTokenizer) -> None:
    ids = bpe.encode(TEXTS[2])
    deltas = stream(IncrementalDetokenizer(bpe, []), ids)
    assert any(d.text == "" for d in deltas)  # some token ended mid-character and was held
    assert joined(deltas) == TEXTS[2]
    assert all("\ufffd" not in d.text for d in deltas)


def test_prompt_gives_context_to_first_token(bpe: TextTokenizer) -> None:
    ids = bpe.encode("Hello, world! The fox")
    split = len(bpe.encode("Hello, world!"))
    detok = IncrementalDetokenizer(bpe, ids[:split])
    assert joined(stream(detok, ids[split:])) == " The fox"  # leading space comes from the token itself


def test_stop_string_split_across_tokens(byte_tok: TextTokenizer) -> None:
    text = "Hello world, stop here please"
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode("Q: "), stop=["stop here"])
    deltas = stream(detok, byte_tok.encode(text))
    assert joined(deltas) == "Hello world, "
    stops = [d for d in deltas if d.stopped]
    assert stops[0].stop_string == "stop here"
    assert stops[0].stop_token_index == len("Hello world, stop here") - 1
    assert all(d.text == "" for d in stops[1:])
    assert detok.stopped and detok.stop_string == "stop here"
    assert detok.flush() == ""
    assert detok.add(byte_tok.encode("more")).text == ""


def test_multibyte_stop_string_across_tokens(bpe: TextTokenizer) -> None:
    gen = bpe.encode("我们现在结束，再见")
    detok = IncrementalDetokenizer(bpe, bpe.encode("好的。"), stop=["结束"])
    deltas = stream(detok, gen)
    assert joined(deltas) == "我们现在"
    first_complete = next(t for t in range(len(gen)) if "结束" in bpe.decode(gen[: t + 1]))
    stop = next(d for d in deltas if d.stopped)
    assert stop.stop_string == "结束" and stop.stop_token_index == first_complete
    assert len(bpe.encode("结束")) > 2  # the stop string really spans several tokens


def test_stop_in_multi_token_add(bpe: TextTokenizer) -> None:
    gen = bpe.encode("alpha beta STOP gamma delta")
    detok = IncrementalDetokenizer(bpe, [], stop=["STOP"])
    delta = detok.add(gen)
    assert delta.text == "alpha beta " and delta.stopped and delta.stop_string == "STOP"
    assert delta.stop_token_index == next(t for t in range(len(gen)) if "STOP" in bpe.decode(gen[: t + 1]))


def test_stop_string_at_the_very_start(byte_tok: TextTokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, byte_tok.encode("x"), stop=["STOP"])
    deltas = stream(detok, byte_tok.encode("STOP and more"))
    assert all(d.text == "" for d in deltas)
    assert deltas[3].stopped and deltas[3].stop_token_index == 3
    assert not any(d.stopped for d in deltas[:3])
    assert detok.flush() == "" and detok.output_text == ""


def test_earliest_stop_string_wins(byte_tok: TextTokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=["STOP2", "STOP1"])
    deltas = stream(detok, byte_tok.encode("abc STOP1 xyz STOP2"))
    assert joined(deltas) == "abc " and detok.stop_string == "STOP1"

    # "bc" and "abc" complete on the same token: the one starting earlier wins
    detok = IncrementalDetokenizer(byte_tok, [], stop=["bc", "abc"])
    assert joined(stream(detok, byte_tok.encode("xabcd"))) == "x" and detok.stop_string == "abc"

    # the stream stops at the first token completing any stop string, even if a longer one began earlier
    detok = IncrementalDetokenizer(byte_tok, [], stop=["bcde", "cd"])
    assert joined(stream(detok, byte_tok.encode("abcdef"))) == "ab" and detok.stop_string == "cd"


def test_held_text_released_when_not_a_stop(byte_tok: TextTokenizer) -> None:
    text = "a ST b STO c"
    detok = IncrementalDetokenizer(byte_tok, [], stop=["STOP"])
    texts = [d.text for d in stream(detok, byte_tok.encode(text))]
    assert texts == ["a", " ", "", "", "ST ", "b", " ", "", "", "", "STO ", "c"]
    assert not detok.stopped
    assert detok.flush() == ""
    assert detok.output_text == text


def test_flush_releases_held_back_text(byte_tok: TextTokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=["STOP"])
    assert joined(stream(detok, byte_tok.encode("the end ST"))) == "the end "
    assert detok.flush() == "ST"
    assert detok.output_text == "the end ST"

    # a request cut off mid-character: flush gives what the tokens decode to, replacement included
    gen = byte_tok.encode("ok 好")[:-1]
    detok = IncrementalDetokenizer(byte_tok, [])
    assert joined(stream(detok, gen)) == "ok "
    assert detok.flush() == byte_tok.decode(gen)[len("ok ") :]
    assert detok.output_text == byte_tok.decode(gen)


def test_random_stop_strings_match_reference(any_tok: TextTokenizer) -> None:
    rng = random.Random(1)
    for text in TEXTS:
        gen = any_tok.encode(text)
        for _ in range(6):
            a = rng.randrange(0, len(text) - 1)
            stop = text[a : a + rng.randint(1, 5)]
            detok = IncrementalDetokenizer(any_tok, any_tok.encode("prompt: "), stop=[stop])
            deltas = stream(detok, gen)
            assert joined(deltas) + detok.flush() == text[: text.find(stop)]
            assert all("\ufffd" not in d.text for d in deltas)
            assert detok.stopped and detok.stop_string == stop


def test_skip_special_tokens(bpe: TextTokenizer) -> None:
    gen = bpe.encode("hi ") + [bpe.token_id(END)] + bpe.encode(" there")
    skipped = IncrementalDetokenizer(bpe, [], skip_special_tokens=True)
    assert joined(stream(skipped, gen)) + skipped.flush() == "hi  there"
    kept = IncrementalDetokenizer(bpe, [], skip_special_tokens=False)
    assert joined(stream(kept, gen)) + kept.flush() == f"hi {END} there"


def test_decode_window_stays_bounded(bpe: TextTokenizer) -> None:
    recording = RecordingTokenizer(bpe.tok)
    gen = recording.encode(" ".join(TEXTS) * 8)
    assert len(gen) > 400
    expected = bpe.decode(gen)
    detok = IncrementalDetokenizer(recording, list(range(100)), stop=["never appears"])
    out = joined(stream(detok, gen)) + detok.flush()
    assert out == expected
    assert 0 < recording.longest_decode <= 12
