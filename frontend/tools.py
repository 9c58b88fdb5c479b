"""Tool calling for the chat API: the request's `tools`, `tool_choice` and `parallel_tool_calls` into a
`ToolSpec`; the conversation (with assistant `tool_calls` and `tool` results) into what the model's chat
template renders; and the parser that reads the generated text back (`frontend.tool_calls`).

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

The generated text is read back by the parsers of `frontend.tool_calls` (`ToolSpec.parser` picks one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from pdserve.engine.structured_spec import GrammarError, StructuredSpec, check_spec
from pdserve.frontend.errors import APIError, invalid_type, invalid_value, json_type_name, missing_parameter
from pdserve.frontend.tool_calls import (
    CLOSE_TAG,
    OPEN_TAG,
    ArrayCallParser,
    NamedCallParser,
    TaggedCallParser,
    ToolCallParser,
    arguments_value,
)

MAX_TOOLS = 128  # OpenAI's bound
ChoiceMode = Literal["none", "auto", "required", "named"]
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
# Parameters of a function that declares none: exactly the empty object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


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


def _tool_prompt(tools: ToolSpec) -> str:
    listed = json.dumps([f.as_tool()["function"] for f in tools.functions], ensure_ascii=False)
    return ("You can call functions. These are the functions available, as JSON schemas:\n"
            f"<tools>{listed}</tools>\n\n"
            "To call functions, answer with only a JSON list of calls between tags, like this:\n"
            f'{OPEN_TAG}[{{"name": "function_name", "arguments": {{"argument": "value"}}}}]{CLOSE_TAG}\n'
            "When no function fits the request, answer in plain text.")


def _written_calls(calls: list[dict[str, Any]]) -> str:
    items = [{"name": c["function"]["name"], "arguments": arguments_value(c["function"]["arguments"])} for c in calls]
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
                                                          arguments_value(c["function"]["arguments"])}}
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
