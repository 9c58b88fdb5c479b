"""Reasoning ("thinking") models: telling the thinking span of a chat answer from its content.

Qwen3 and DeepSeek-R1 style models write their reasoning between `<think>` and `</think>` before the
answer. A model's `ReasoningFormat` (from the models file's `reasoning_parser`, or detected: a chat
template that mentions `<think>` and a tokenizer with both tags as tokens that decode into the text) makes
one `ReasoningParser` per choice, fed the generated text piece by piece as it streams.

Where the output starts is read from the end of the rendered prompt, not guessed from the output:

- the prompt ends with `<think>` (and whitespace): the template opened the span (newer Qwen3 templates,
  DeepSeek-R1), so the output starts inside it;
- the prompt ends with `</think>` (and whitespace): the template closed an empty span (Qwen3 with
  `enable_thinking: false`), so the output is all content;
- otherwise the output decides: a leading `<think>` opens the span; without one, qwen3 output is
  content and deepseek_r1 output is reasoning (R1 may leave the tag out).

A span that never closes is all reasoning (as vLLM does). The tags and the newlines that pad them (Qwen3
writes `<think>\\n...\\n</think>\\n\\n`) are dropped, as the template drops them when it writes an
earlier turn's reasoning back; anything after `</think>`, including a later `<think>`, is content.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

START_TAG, END_TAG = "<think>", "</think>"
# The models file's reasoning_parser: "auto" detects the format (module docstring), "none" turns it off.
ReasoningSetting = Literal["auto", "qwen3", "deepseek_r1", "none"]
REASONING_SETTINGS: tuple[str, ...] = ("auto", "qwen3", "deepseek_r1", "none")

Phase = Literal["start", "reasoning", "content"]  # start: the output has not yet said whether it thinks
_PROMPT_TAIL = 8  # tokens after a tag at the end of the prompt that may still be whitespace


class ReasoningFormatError(ValueError):
    """A reasoning_parser setting the model's tokenizer cannot support."""


@dataclass(frozen=True)
class ReasoningFormat:
    """How one model marks its thinking span: the style and the tags' token ids."""

    style: Literal["qwen3", "deepseek_r1"]
    start_id: int
    end_id: int

    def first_phase(self, prompt_ids: Sequence[int], text_of: Callable[[int], str]) -> Phase:
        """Where a choice of this prompt starts, from the prompt's last tokens (`text_of`: a token's text):
        reasoning when the prompt ends with an open `<think>`, content when it ends with `</think>`."""
        for tok in reversed(prompt_ids[-_PROMPT_TAIL:]):
            if tok == self.start_id:
                return "reasoning"
            if tok == self.end_id:
                return "content"
            if text_of(tok).strip():
                break
        return "start"

    def parser(self, prompt_ids: Sequence[int], text_of: Callable[[int], str]) -> ReasoningParser:
        """A parser for one choice generated after `prompt_ids`."""
        return ReasoningParser(self.first_phase(prompt_ids, text_of), self.end_id,
                               implicit=self.style == "deepseek_r1")


def reasoning_format(setting: str, template: str | None, token_id: Callable[[str], int | None],
                     special_ids: frozenset[int]) -> ReasoningFormat | None:
    """The format a model's setting asks for (None: its output is not split). `auto` is qwen3 when the
    chat template mentions `<think>` and both tags are tokens outside `special_ids`; an explicit style
    without such tokens raises ReasoningFormatError (special tokens never reach the decoded text)."""
    if setting == "none":
        return None
    start, end = token_id(START_TAG), token_id(END_TAG)
    usable = start is not None and end is not None and not {start, end} & special_ids
    if setting == "auto":
        if template is None or START_TAG not in template or not usable:
            return None
        setting = "qwen3"
    if setting not in ("qwen3", "deepseek_r1"):
        raise ReasoningFormatError(f"reasoning_parser must be one of {list(REASONING_SETTINGS)}, got {setting!r}")
    if not usable:
        raise ReasoningFormatError(f"reasoning_parser {setting!r} needs {START_TAG} and {END_TAG} as tokens of the "
                                   "tokenizer that are not special (special tokens are left out of the text)")
    assert start is not None and end is not None
    return ReasoningFormat(setting, start, end)  # type: ignore[arg-type]


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag` (it may still become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    """Splits one choice's generated text, fed in pieces as it comes, into reasoning and content, and
    counts the reasoning tokens. Text is held back only while it may still be part of a tag (or is
    newlines that a closing tag would drop); any split of the same output gives the same two texts."""

    def __init__(self, phase: Phase, end_id: int, implicit: bool = False) -> None:
        self.phase: Phase = phase
        self._end_id = end_id
        self._implicit = implicit  # deepseek_r1: output that does not open with <think> reasons anyway
        self._held = ""  # text not yet given out
        self._lead = phase != "content"  # at the start of the span or of the content after it: newlines go
        self._pending = 0  # tokens of messages fed while the phase was still "start"
        self.reasoning_tokens = 0

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> tuple[str, str]:
        """(reasoning, content) of the next piece; `token_ids`: the piece's tokens, for the count."""
        reasoned = self.phase == "reasoning"
        reasoning: list[str] = []
        content: list[str] = []
        self._held += text
        while self._held:
            if self.phase == "start":
                if not self._start():
                    break
            elif self.phase == "reasoning":
                reasoned = True
                if not self._reason(reasoning):
                    break
            else:
                content.append(self._content(self._held))
                self._held = ""
        self._count(reasoned or self.phase == "reasoning", token_ids)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) of what was held back, once the output is complete: a tag begun but never
        finished is text; an output that never said whether it thinks is content (qwen3) or reasoning."""
        held, self._held = self._held, ""
        if self.phase == "start":
            self.phase = "reasoning" if self._implicit else "content"
            if self._implicit:
                self.reasoning_tokens += self._pending
            self._pending = 0
            return (held.lstrip("\n"), "") if self._implicit else ("", held)
        if self.phase == "reasoning":
            return (held.lstrip("\n") if self._lead else held), ""
        return "", self._content(held)

    # --- one step of each phase over the held text: False when it must wait for more -------------

    def _start(self) -> bool:
        head = self._held.lstrip()
        if head.startswith(START_TAG):
            self._held = head[len(START_TAG):]
            self.phase = "reasoning"
            return True
        if START_TAG.startswith(head):  # only whitespace, or part of the tag so far
            return False
        self.phase = "reasoning" if self._implicit else "content"
        self._lead = self._implicit
        return True

    def _reason(self, out: list[str]) -> bool:
        if self._lead:
            self._held = self._held.lstrip("\n")
            if not self._held:
                return False
            self._lead = False
        at = self._held.find(END_TAG)
        if at >= 0:
            out.append(self._held[:at].rstrip("\n"))
            self._held = self._held[at + len(END_TAG):]
            self.phase, self._lead = "content", True
            return True
        keep = _partial_tail(self._held, END_TAG)
        body = self._held[:len(self._held) - keep]
        newlines = len(body) - len(body.rstrip("\n"))  # dropped if the closing tag comes next
        keep += newlines
        out.append(self._held[:len(self._held) - keep])
        self._held = self._held[len(self._held) - keep:]
        return False

    def _content(self, text: str) -> str:
        if self._lead:
            text = text.lstrip("\n")
            self._lead = not text
        return text

    def _count(self, reasoned: bool, token_ids: Sequence[int]) -> None:
        """A message's tokens are reasoning when its text was (all of them while the span is open, plus
        those of earlier messages that came before the output said it thinks); a message whose text closed
        the span counts its tokens up to and including the `</think>` token, or all of them when that token
        is not among them (the tag's text came from another message, or from several tokens)."""
        n = len(token_ids)
        if self.phase == "start":
            self._pending += n
            return
        pending, self._pending = self._pending, 0
        if not reasoned:
            return
        if self.phase == "reasoning":
            self.reasoning_tokens += pending + n
        else:
            ids = list(token_ids)
            self.reasoning_tokens += pending + (ids.index(self._end_id) + 1 if self._end_id in ids else n)
