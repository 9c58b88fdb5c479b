"""Tool calling for the chat API: the request's `tools`, `tool_choice` and `parallel_tool_calls` into a
`ToolSpec`; the conversation (with assistant `tool_calls` and `tool` results) into what the model's chat
template renders; and the generated text back into OpenAI `tool_calls`, whole or streamed.

How a tool call is produced depends on `tool_choice`:

- `required` and a named function: decoding is constrained (`ToolSpec.constraint`, an llguidance JSON
  schema like any `response_format`), so the output always parses. Required: a JSON array of
  `{"name": <one of the tools>, "arguments": <that tool's parameters>}` (one item when
  `parallel_tool_calls` is false). Named: the function's arguments object alone.
- `auto`: the model decides. It writes calls as `<tool_call>...</tool_call>` blocks holding one
  `{"name", "arguments"}` object or an array of them (the convention of Hermes-style templates and of
  the tool prompt below); text outside the blocks is the message's content.
- `none`: the tools are not shown to the model and nothing is parsed.

Templates that render tools themselves (they read the `tools` variable) get them as transformers passes
them; for the others (SmolLM2's is one) the tools are described in the system message, in the format the
parser reads, and earlier turns' calls and results are written the same way.

The parsers are incremental (`ToolCallParser.feed`/`finish` return `ToolEvent`s), so a streamed response
sends a call's name as soon as it is complete and its arguments as they are generated, and a whole
response is the same events joined.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from pdserve.engine.structured_spec import GrammarError, StructuredSpec, check_spec
from pdserve.frontend.errors import APIError, invalid_type, invalid_value, json_type_name, missing_parameter

MAX_TOOLS = 128  # OpenAI's bound
ChoiceMode = Literal["none", "auto", "required", "named"]
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
# Parameters of a function that declares none: exactly the empty object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Function:
    """One declared function: its name, description and parameters (a JSON schema, serialized)."""

    name: str
    description: str | None
    parameters_json: str  # NO_PARAMETERS when the tool declares none

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI `tools[]` item, as chat templates receive it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = json.loads(self.parameters_json)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolSpec:
    """The tools of one chat request and how the model may use them. Plain data (it crosses to the
    frontend's worker processes)."""

    functions: tuple[Function, ...]
    mode: ChoiceMode
    named: str | None = None  # mode "named": the function to call
    parallel: bool = True  # parallel_tool_calls

    def __post_init__(self) -> None:
        assert (self.mode == "named") == (self.named is not None), self
        assert self.named is None or any(f.name == self.named for f in self.functions), self

    @property
    def shown(self) -> bool:
        """Whether the model sees the tools (not with tool_choice "none")."""
        return self.mode != "none" and bool(self.functions)

    def function(self, name: str) -> Function:
        return next(f for f in self.functions if f.name == name)

    def constraint(self) -> StructuredSpec | None:
        """The output grammar of `required` and named choices; None when the model decides."""
        if self.mode == "named":
            assert self.named is not None
            return StructuredSpec("json_schema", self.function(self.named).parameters_json)
        if self.mode != "required":
            return None
        # Raw JSON spliced, not re-serialized: a schema's key order is the order its properties come in.
        calls = b",".join(
            b'{"type":"object","properties":{"name":{"const":%b},"arguments":%b},'
            b'"required":["name","arguments"],"additionalProperties":false}'
            % (orjson.dumps(f.name), f.parameters_json.encode()) for f in self.functions)
        items = b'{"anyOf":[%b]}' % calls
        bound = b'"minItems":1' + (b"" if self.parallel else b',"maxItems":1')
        return StructuredSpec("json_schema", (b'{"type":"array","items":%b,%b}' % (items, bound)).decode())

    def parser(self) -> ToolCallParser | None:
        """A fresh parser for one choice's output (None: the output is plain content)."""
        if self.mode == "named":
            assert self.named is not None
            return NamedCallParser(self.named)
        if self.mode == "required":
            return ArrayCallParser()
        if self.mode == "auto" and self.functions:
            return TaggedCallParser()
        return None


# --- the request ----------------------------------------------------------------------------------


def _tool_error(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"Invalid '{param}': {message}", param=param, code=code)


def _function(item: Any, i: int, max_schema_bytes: int) -> Function:
    where = f"tools[{i}]"
    if not isinstance(item, dict):
        raise invalid_type(where, "an object", item)
    kind = item.get("type")
    if kind is None:
        raise missing_parameter(f"{where}.type")
    if kind != "function":
        raise invalid_value(f"{where}.type", f"{kind!r} is not supported; only 'function' tools are.")
    fn = item.get("function")
    if fn is None:
        raise missing_parameter(f"{where}.function")
    if not isinstance(fn, dict):
        raise invalid_type(f"{where}.function", "an object", fn)
    name = fn.get("name")
    if name is None:
        raise missing_parameter(f"{where}.function.name")
    if not isinstance(name, str):
        raise invalid_type(f"{where}.function.name", "a string", name)
    if not 1 <= len(name) <= 64 or not set(name) <= _NAME_CHARS:
        raise invalid_value(f"{where}.function.name", "it must be 1 to 64 characters of a-z, A-Z, 0-9, '_' and '-'.")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid_type(f"{where}.function.description", "a string", description)
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_type(f"{where}.function.strict", "a boolean", strict)
    params = fn.get("parameters")
    param = f"{where}.function.parameters"
    if params is None:
        text = orjson.dumps(NO_PARAMETERS).decode()
    else:
        if not isinstance(params, dict):
            raise _tool_error(param, f"the JSON schema must be an object, got {json_type_name(params)}.",
                              "invalid_function_parameters")
        try:
            text = orjson.dumps(params).decode()
        except orjson.JSONEncodeError as err:
            raise _tool_error(param, f"the JSON schema cannot be used: {err}.", "invalid_function_parameters") from None
        if len(text) > max_schema_bytes:
            raise _tool_error(param, f"the JSON schema is {len(text)} bytes; this server accepts at most "
                              f"{max_schema_bytes}.", "schema_too_large")
        try:
            check_spec(StructuredSpec("json_schema", text))
        except GrammarError as err:
            raise _tool_error(param, str(err), "invalid_function_parameters") from None
    return Function(name, description, text)


def _choice(obj: dict[str, Any], names: set[str]) -> tuple[ChoiceMode, str | None]:
    value = obj.get("tool_choice")
    if value is None:
        return ("auto" if names else "none"), None
    if not names:
        raise invalid_value("tool_choice", "'tool_choice' is only allowed when 'tools' are specified.")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise invalid_value("tool_choice", f"{value!r} is not one of ['none', 'auto', 'required'] or a named "
                                "function.")
        return value, None  # type: ignore[return-value]
    if not isinstance(value, dict):
        raise invalid_type("tool_choice", "a string or an object", value)
    if value.get("type") != "function":
        raise invalid_value("tool_choice.type", f"{value.get('type')!r} is not supported; use 'function'.")
    fn = value.get("function")
    if not isinstance(fn, dict):
        raise invalid_type("tool_choice.function", "an object", fn)
    name = fn.get("name")
    if not isinstance(name, str):
        raise invalid_type("tool_choice.function.name", "a string", name)
    if name not in names:
        raise invalid_value("tool_choice.function.name", f"no tool named {name!r} is in 'tools'.")
    return "named", name


def parse_tools(obj: dict[str, Any], max_schema_bytes: int) -> ToolSpec | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat body; None without tools. Each function's
    parameters schema is compiled here, so one the grammar engine refuses is a 400 naming the tool."""
    tools = obj.get("tools")
    parallel = obj.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid_type("parallel_tool_calls", "a boolean", parallel)
    if tools is None:
        _choice(obj, set())
        return None
    if not isinstance(tools, list):
        raise invalid_type("tools", "an array", tools)
    if len(tools) > MAX_TOOLS:
        raise invalid_value("tools", f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}.")
    functions = tuple(_function(item, i, max_schema_bytes) for i, item in enumerate(tools))
    seen: set[str] = set()
    for i, f in enumerate(functions):
        if f.name in seen:
            raise invalid_value(f"tools[{i}].function.name", f"two tools are named {f.name!r}.")
        seen.add(f.name)
    mode, named = _choice(obj, seen)
    if not functions:
        return None
    spec = ToolSpec(functions, mode, named, True if parallel is None else parallel)
    if spec.mode == "required":
        try:  # each part compiled above; the union could still exceed what the engine builds
            check_spec(spec.constraint())  # type: ignore[arg-type]
        except GrammarError as err:
            raise _tool_error("tools", str(err), "invalid_function_parameters") from None
    return spec


def parse_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, validated: [{"id", "type": "function", "function": {"name",
    "arguments": str}}]."""
    if not isinstance(value, list):
        raise invalid_type(where, "an array", value)
    out: list[dict[str, Any]] = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise invalid_type(at, "an object", call)
        call_id = call.get("id")
        if not isinstance(call_id, str):
            raise invalid_type(f"{at}.id", "a string", call_id)
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise invalid_type(f"{at}.function", "an object", fn)
        name, arguments = fn.get("name"), fn.get("arguments")
        if not isinstance(name, str):
            raise invalid_type(f"{at}.function.name", "a string", name)
        if not isinstance(arguments, str):
            raise invalid_type(f"{at}.function.arguments", "a string", arguments)
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return out


# --- the prompt -----------------------------------------------------------------------------------


def _arguments_value(arguments: str) -> Any:
    """Arguments as templates expect them (a mapping, as transformers documents); the string itself when it
    is not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _tool_prompt(tools: ToolSpec) -> str:
    listed = json.dumps([f.as_tool()["function"] for f in tools.functions], ensure_ascii=False)
    return ("You can call functions. These are the functions available, as JSON schemas:\n"
            f"<tools>{listed}</tools>\n\n"
            "To call functions, answer with only a JSON list of calls between tags, like this:\n"
            f'{OPEN_TAG}[{{"name": "function_name", "arguments": {{"argument": "value"}}}}]{CLOSE_TAG}\n'
            "When no function fits the request, answer in plain text.")


def _written_calls(calls: list[dict[str, Any]]) -> str:
    items = [{"name": c["function"]["name"], "arguments": _arguments_value(c["function"]["arguments"])} for c in calls]
    return OPEN_TAG + json.dumps(items, ensure_ascii=False) + CLOSE_TAG


def template_input(messages: list[dict[str, Any]], tools: ToolSpec | None, renders_tools: bool,
                   ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and template variables to render for a conversation. A template that reads `tools`
    gets them and the calls as transformers passes them; for any other template, the tools are described
    in the system message and calls and results written as text in the tool prompt's format. Pure."""
    has_calls = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if renders_tools:
        kwargs: dict[str, Any] = {"tools": [f.as_tool() for f in tools.functions]} if tools and tools.shown else {}
        if not has_calls:
            return messages, kwargs
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [{**c, "function": {"name": c["function"]["name"], "arguments":
                                                          _arguments_value(c["function"]["arguments"])}}
                                       for c in m["tool_calls"]]}
            out.append(m)
        return out, kwargs
    out = []
    if tools is not None and tools.shown:
        prompt = _tool_prompt(tools)
        if messages[0]["role"] == "system":
            first, *messages = messages
            out.append({**first, "content": first["content"] + "\n\n" + prompt})
        else:
            out.append({"role": "system", "content": prompt})
    for m in messages:
        if m.get("tool_calls"):
            text = m.get("content") or ""
            out.append({"role": "assistant", "content": (text + "\n" if text else "") + _written_calls(m["tool_calls"])})
        elif m["role"] == "tool":
            # A template without tool support may not know the role: results go back as a user turn,
            # consecutive results in one.
            block = f"<tool_response>{m['content']}</tool_response>"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_results": True})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "_results"} for m in out], {}


# --- the output -----------------------------------------------------------------------------------


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
            arguments = _arguments_value(arguments)
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
