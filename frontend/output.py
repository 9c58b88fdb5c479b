"""What one choice of a response says (`ChoiceOutput`), rendered once for the streamed and the whole
response alike.

Each upstream message of a choice is taken once and becomes its `Delta`: the text (a completion's echo
first), its tokens' logprobs in the endpoint's style (chat items, or the legacy object with text offsets
running on from the message before), the tool-call parser's events for the text, and, on the last
message, the finish_reason ("tool_calls" for a choice that stopped by itself after calling a tool). A
streamed response writes each delta as it comes (`StreamEncoder.delta`); a whole one keeps them and asks
for the choice object at the end (`ChoiceOutput.choice`): the deltas joined, i.e. what a client joining
the stream's deltas gets.

A reasoning model's choice (`frontend.reasoning`) first splits each message's text into thinking text
(`Delta.reasoning`: `delta.reasoning_content` streamed, `message.reasoning_content` whole) and content,
which alone goes on to the tool-call parser; `reasoning_text` and `reasoning_tokens` say what it thought.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdserve.frontend.job import CHAT, Job, Progress
from pdserve.frontend.models import TokenTexts
from pdserve.frontend.reasoning import ReasoningParser
from pdserve.frontend.render import Delta, chat_logprobs, completion_logprobs
from pdserve.frontend.tool_calls import ToolCallParser, message_of
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc.enums import finish_reason_name


class ChoiceOutput:
    """The rendered output of one choice (changed by `take`, once per upstream message)."""

    def __init__(self, index: int, chat: bool, texts: TokenTexts, top: int | None, echo: str,
                 parser: ToolCallParser | None, keep: bool, reasoning: ReasoningParser | None = None,
                 progress: Progress | None = None) -> None:
        self.index = index
        self._chat, self._texts, self._top, self._parser = chat, texts, top, parser
        self._echo = echo  # goes before the first message's text, then ""
        self._offset = 0  # legacy logprobs: text offset of the next token (the echo not counted)
        self._kept: list[Delta] | None = [] if keep else None  # a whole response's deltas so far
        self._finish_reason: str | None = None
        self._reasoning = reasoning  # splits off the thinking text (a reasoning model's chat choice)
        self._thought: list[str] = []  # the thinking text so far, streamed or whole
        self._progress = progress  # its reasoning_tokens is kept up to date, for the usage object
        if reasoning is not None and progress is not None:
            progress.reasoning_tokens = 0

    @property
    def parses_reasoning(self) -> bool:
        """Whether this choice's output is split into thinking text and content."""
        return self._reasoning is not None

    @property
    def reasoning_text(self) -> str:
        """The thinking text taken so far (complete once the last message was taken); "" when none."""
        return "".join(self._thought)

    @property
    def reasoning_tokens(self) -> int:
        """Generated tokens inside the thinking span so far (`ReasoningParser` says how a message that
        closes the span counts); 0 when the output is not split."""
        return self._reasoning.reasoning_tokens if self._reasoning is not None else 0

    def take(self, msg: pb.GenerateResponse) -> Delta:
        """The delta of the choice's next message (kept when the response is whole)."""
        assert self._finish_reason is None, "a message after the choice's last"
        text, self._echo = self._echo + msg.text, ""
        thought = ""
        if self._reasoning is not None:
            thought, text = self._reasoning.feed(text, msg.token_ids)
            if msg.finished:
                more, rest = self._reasoning.finish()
                thought, text = thought + more, text + rest
            self._thought.append(thought)
            if self._progress is not None:
                self._progress.reasoning_tokens = self._reasoning.reasoning_tokens
        logprobs = None
        if self._top is not None and msg.logprobs:
            if self._chat:
                logprobs = {"content": chat_logprobs(msg.logprobs, self._texts, self._top), "refusal": None}
            else:
                logprobs, self._offset = completion_logprobs(msg.logprobs, self._texts, self._top, self._offset)
        tools = None
        if self._parser is not None:
            tools = self._parser.feed(text) + (self._parser.finish() if msg.finished else [])
            text = ""
        if msg.finished:
            calls = self._parser is not None and self._parser.calls
            reason = finish_reason_name(msg.finish_reason)
            self._finish_reason = "tool_calls" if reason == "stop" and calls else reason
        delta = Delta(text, logprobs, tools, self._finish_reason, thought)
        if self._kept is not None:
            self._kept.append(delta)
        return delta

    def choice(self) -> dict[str, Any]:
        """The choice object of a whole response, once its last message was taken."""
        assert self._kept is not None and self._finish_reason is not None, "the choice has not finished"
        text = "".join(d.text for d in self._kept)
        if not self._chat:
            return {"index": self.index, "text": text, "logprobs": self._logprobs(),
                    "finish_reason": self._finish_reason}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self._reasoning is not None:
            message["reasoning_content"] = self.reasoning_text or None
        message["refusal"] = None
        if self._parser is not None:
            said = message_of([e for d in self._kept for e in d.tools or ()])
            message["content"] = said.content
            if said.tool_calls:
                message["tool_calls"] = said.tool_calls
        return {"index": self.index, "message": message, "logprobs": self._logprobs(),
                "finish_reason": self._finish_reason}

    def _logprobs(self) -> dict[str, Any] | None:
        """The kept deltas' logprobs as one object (empty when asked for and no token came)."""
        if self._top is None:
            return None
        assert self._kept is not None
        parts = [d.logprobs for d in self._kept if d.logprobs is not None]
        if self._chat:
            return {"content": [item for p in parts for item in p["content"]], "refusal": None}
        joined = completion_logprobs((), self._texts, self._top, 0).logprobs  # empty, its fields in order
        for p in parts:
            for name, values in joined.items():
                values.extend(p[name])
        return joined


def choice_outputs(job: Job) -> list[ChoiceOutput]:
    """One output per choice of `job`, each with its own tool-call parser when the request may call tools,
    and its own reasoning parser for a reasoning model's chat choice; not under a constraint
    (response_format, a required or named tool), which holds from the first token: no thinking span."""
    req, tools, model = job.req, job.req.tools, job.model
    split = model.reasoning if req.kind == CHAT and req.sampling.structured is None else None
    return [ChoiceOutput(c.index, req.kind == CHAT, model.texts, req.sampling.logprobs,
                         job.echo_texts[c.prompt_index], tools.parser() if tools is not None else None,
                         keep=not req.stream,
                         reasoning=split.parser(job.prompts[c.prompt_index], text_of(model.texts))
                         if split is not None else None, progress=c.progress) for c in job.choices]


def text_of(texts: TokenTexts) -> Callable[[int], str]:
    """A token's text, as `ReasoningFormat` reads the end of a prompt."""
    return lambda token_id: texts.get(token_id).text
