"""Streams a request's generated tokens out as text: whole characters only, stop strings cut off.

Two layers per token. The decode layer re-decodes only a short window of token ids (the tokens of the
last released piece, for context, plus the ones not yet turned into text) and releases new text once the
window no longer ends inside a multi-byte character. The stop layer then holds back any tail of the text
that could still grow into a stop string, and ends the stream when one appears.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"  # what a byte-level decode puts where a UTF-8 sequence is still incomplete


class TokenDecoder(Protocol):
    """Anything that turns token ids into text, e.g. a `tokenizers.Tokenizer`."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class DetokenizerDelta:
    text: str  # newly releasable text (possibly empty)
    stopped: bool = False  # a stop string appeared; nothing more will be released
    stop_string: str | None = None  # the stop string that matched (excluded from the text)
    stop_token_index: int | None = None  # 0-based index, among generated tokens, of the one completing it


@dataclass
class _StopMatch:
    start: int  # where the stop string starts in the searched text
    stop: str


class IncrementalDetokenizer:
    """Per-request streaming decoder.

    The released pieces, concatenated (with `flush()` at the end), equal the text the generated tokens
    decode to after the prompt, i.e. `decode(prompt + generated)[len(decode(prompt)):]`, cut just before
    the stop string if one matched. A stop is decided at the first token after which any stop string is
    complete in the decoded text; among stop strings complete at that token the earliest one wins."""

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
        context_tokens: int = 5,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(dict.fromkeys(stop or []))
        if not all(self.stop):
            raise ValueError("stop strings must be non-empty")
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # a few prompt tokens give the first generated token its context (e.g. a leading space)
        self._ids: list[int] = list(prompt_token_ids[-context_tokens:]) if context_tokens > 0 else []
        self._read_offset = len(self._ids)  # _ids[:read] were already released; _ids[read:] not yet
        self._prefix_text: str | None = None  # decode of _ids[:read], cached until the window moves
        self._held = ""  # decoded text kept back because it could be the start of a stop string
        self._num_tokens = 0  # generated tokens seen
        self._pieces: list[str] = []
        self._stop_delta: DetokenizerDelta | None = None  # set once a stop string matched

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def stopped(self) -> bool:
        return self._stop_delta is not None

    @property
    def stop_string(self) -> str | None:
        return self._stop_delta.stop_string if self._stop_delta else None

    @property
    def output_text(self) -> str:
        """Everything released so far."""
        return "".join(self._pieces)

    def add(self, token_ids: list[int]) -> DetokenizerDelta:
        """Feeds newly generated tokens; returns the text they make releasable. Once a stop string has
        matched, the remaining tokens (here and in later calls) are ignored and the delta stays stopped."""
        if self._stop_delta is not None:
            return self._stopped_delta("")
        released: list[str] = []
        for token_id in token_ids:
            index = self._num_tokens
            self._num_tokens += 1
            self._ids.append(token_id)
            piece = self._decode_window(final=False)
            if not piece:  # nothing new to search or release; the held text was already checked
                continue
            text, match = self._check_stops(self._held + piece)
            released.append(text)
            if match is not None:
                self._stop_delta = DetokenizerDelta(
                    "", stopped=True, stop_string=match.stop, stop_token_index=index
                )
                break
        out = "".join(released)
        if out:
            self._pieces.append(out)
        if self._stop_delta is not None:
            return self._stopped_delta(out)
        return DetokenizerDelta(out)

    def flush(self) -> str:
        """Releases everything still held back, for a request that ended for another reason (length, EOS,
        abort): a trailing incomplete character comes out as U+FFFD. A stop string completed only by that
        tail still cuts the text (and marks the detokenizer stopped). Returns "" once stopped."""
        if self._stop_delta is not None:
            return ""
        text = self._held + self._decode_window(final=True)
        self._held = ""
        match = self._find_stop(text)
        if match is not None:
            text = text[: match.start]
            # the match lies in text of still-pending tokens; the last of them bounds where it completed
            last = max(self._num_tokens - 1, 0)
            self._stop_delta = DetokenizerDelta(
                "", stopped=True, stop_string=match.stop, stop_token_index=last
            )
        if text:
            self._pieces.append(text)
        return text

    def _stopped_delta(self, text: str) -> DetokenizerDelta:
        assert self._stop_delta is not None
        return DetokenizerDelta(
            text,
            stopped=True,
            stop_string=self._stop_delta.stop_string,
            stop_token_index=self._stop_delta.stop_token_index,
        )

    def _decode_window(self, final: bool) -> str:
        """Returns the text of the not-yet-released tokens and slides the window past them, unless (when
        not `final`) that text is empty or ends inside a character, in which case it returns "" and waits."""
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self.tokenizer.decode(
                self._ids[: self._read_offset], skip_special_tokens=self.skip_special_tokens
            )
        full = self.tokenizer.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
        if not final and (len(full) <= len(self._prefix_text) or full.endswith(REPLACEMENT_CHAR)):
            return ""
        piece = full[len(self._prefix_text) :]
        # the tokens just released become the context of the next window; older ones are never decoded again
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = None
        return piece

    def _check_stops(self, text: str) -> tuple[str, _StopMatch | None]:
        """Splits `text` (held-back text plus a new piece) into what may be released now and what must
        wait (kept in `_held`); on a stop match releases only the text before it."""
        match = self._find_stop(text)
        if match is not None:
            self._held = ""
            return text[: match.start], match
        keep = self._stop_prefix_len(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], None

    def _find_stop(self, text: str) -> _StopMatch | None:
        # No match can start in already released text: the held-back tail is the longest suffix that
        # could begin a stop string, so searching the held text plus the new piece is enough.
        best: _StopMatch | None = None
        for stop in self.stop:
            start = text.find(stop)
            if start >= 0 and (best is None or start < best.start):
                best = _StopMatch(start, stop)
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for k in range(min(len(text), self._max_stop_len - 1), 0, -1):
            tail = text[-k:]
            if any(stop.startswith(tail) for stop in self.stop):
                return k
        return 0
