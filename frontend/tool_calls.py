"""The generated text of a chat choice back into OpenAI `tool_calls` (`frontend.tools` has the request
side): incremental parsers (`ToolCallParser.feed`/`finish` return `ToolEvent`s), so a streamed response
sends a call's name as soon as it is complete and its arguments as they are generated, and a whole
response is the same events joined (`message_of`). A parser gives the same events' text for any split of
the output into pieces.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


def arguments_value(arguments: str) -> Any:
    """Arguments as templates expect them (a mapping, as transformers documents); the string itself when it
    is not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


@dataclass(frozen=True)
class ToolEvent:
    """One step of a choice's output: content text, a call's start (its id and name) or a piece of its
    arguments. `call` numbers the choice's calls from 0."""

    kind: Literal["content", "call", "arguments"]
    text: str = ""  # content or arguments text
    call: int = -1
    call_id: str = ""
    name: str = ""


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolCallParser:
    """Turns one choice's generated text into ToolEvents, incrementally; `finish` flushes what is held
    back. Owned by one choice; `calls` counts the calls started."""

    calls: int = 0

    def feed(self, text: str) -> list[ToolEvent]:
        raise NotImplementedError

    def finish(self) -> list[ToolEvent]:
        return []

    def _start(self, name: str) -> ToolEvent:
        event = ToolEvent("call", call=self.calls, call_id=new_call_id(), name=name)
        self.calls += 1
        return event


class NamedCallParser(ToolCallParser):
    """tool_choice naming a function: the whole output is that function's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name

    def feed(self, text: str) -> list[ToolEvent]:
        out = [self._start(self.name)] if not self.calls else []
        if text:
            out.append(ToolEvent("arguments", text, call=0))
        return out

    def finish(self) -> list[ToolEvent]:
        return [self._start(self.name)] if not self.calls else []


class _ValueEnd:
    """Finds where a JSON value ends in text given piece by piece (strings and escapes respected)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False

    def scan(self, text: str) -> int | None:
        """Index in `text` just after the value's end, or None when it continues past `text`."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
                continue
            if ch in " \t\r\n" and not self.started:
                continue
            self.started = True
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif self.depth == 0 and ch in ",":
                return i  # a bare scalar ended
        return None


# a call's head: the array's "[" or the "}," closing the call before, then the name and the arguments key
_CALL_HEAD = re.compile(r'\s*(?:\}\s*)?[\[,]\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:')


class ArrayCallParser(ToolCallParser):
    """tool_choice required: `[{"name": ..., "arguments": {...}}, ...]` as the constraint generates it
    (name first); each call starts once its name is complete and its arguments stream as they come."""

    def __init__(self) -> None:
        self.pending = ""  # text not yet turned into events
        self.args: _ValueEnd | None = None  # inside a call's arguments

    def feed(self, text: str) -> list[ToolEvent]:
        self.pending += text
        out: list[ToolEvent] = []
        while self.pending:
            if self.args is None:
                head = _CALL_HEAD.match(self.pending)
                if head is None:
                    break
                out.append(self._start(json.loads(f'"{head.group(1)}"')))
                self.pending = self.pending[head.end():]
                self.args = _ValueEnd()
                continue
            if not self.args.started:  # the arguments begin at their value, wherever the text was cut
                self.pending = self.pending.lstrip()
                if not self.pending:
                    break
            end = self.args.scan(self.pending)
            piece = self.pending if end is None else self.pending[:end]
            if piece:
                out.append(ToolEvent("arguments", piece, call=self.calls - 1))
            if end is None:
                self.pending = ""
                break
            self.pending = self.pending[end:]
            self.args = None
        return out

    def finish(self) -> list[ToolEvent]:
        # Cut before the first call's name was complete (finish_reason "length"): the text is content.
        rest, self.pending = self.pending, ""
        return [ToolEvent("content", rest)] if rest and not self.calls else []


class TaggedCallParser(ToolCallParser):
    """tool_choice auto: content, with calls in `<tool_call>...</tool_call>` blocks (one object or an
    array of them). Text that might begin a tag is held back; a block that does not parse is content."""

    def __init__(self) -> None:
        self.pending = ""
        self.inside = False

    def feed(self, text: str) -> list[ToolEvent]:
        self.pending += text
        out: list[ToolEvent] = []
        while self.pending:
            if not self.inside:
                at = self.pending.find(OPEN_TAG)
                if at < 0:
                    keep = _partial_tag_suffix(self.pending, OPEN_TAG)
                    content, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
                    if content:
                        out.append(ToolEvent("content", content))
                    break
                if at:
                    out.append(ToolEvent("content", self.pending[:at]))
                self.pending = self.pending[at + len(OPEN_TAG):]
                self.inside = True
                continue
            end = self.pending.find(CLOSE_TAG)
            if end < 0:
                break
            out += self._block(self.pending[:end])
            self.pending = self.pending[end + len(CLOSE_TAG):]
            self.inside = False
        return out

    def finish(self) -> list[ToolEvent]:
        # A block cut short (the model stopped before its closing tag) still counts when it parses.
        rest, self.pending = self.pending, ""
        if self.inside:
            self.inside = False
            return self._block(rest)
        return [ToolEvent("content", rest)] if rest else []

    def _block(self, body: str) -> list[ToolEvent]:
        calls = _calls_of(body)
        if calls is None:
            return [ToolEvent("content", OPEN_TAG + body + CLOSE_TAG)]
        out: list[ToolEvent] = []
        for name, arguments in calls:
            out.append(self._start(name))
            out.append(ToolEvent("arguments", arguments, call=self.calls - 1))
        return out


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _calls_of(body: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call written in a block; None when the block is not calls."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = arguments_value(arguments)
        calls.append((item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


@dataclass
class ToolMessage:
    """A whole choice's message built from its events: content (None when there is none) and calls."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def message_of(events: list[ToolEvent]) -> ToolMessage:
    """The message a choice's events add up to (what a client joining the stream's deltas gets)."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for e in events:
        if e.kind == "content":
            content.append(e.text)
        elif e.kind == "call":
            calls.append({"id": e.call_id, "type": "function", "function": {"name": e.name, "arguments": ""}})
        else:
            calls[e.call]["function"]["arguments"] += e.text
    text = "".join(content)
    if calls:  # content beside calls is kept only when it says something
        return ToolMessage(text if text.strip() else None, calls)
    return ToolMessage(text, calls)
