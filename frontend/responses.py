"""The Responses API's request side: a `/v1/responses` body becomes a chat `GenerationRequest`.

A Response runs on the chat machinery: its input items become chat messages (messages with text parts;
`function_call` items an assistant message's tool calls; `function_call_output` items tool messages),
`instructions` a first system message, function `tools`/`tool_choice` the chat tools, `text.format` the
chat `response_format`, `max_output_tokens` `max_tokens`. So the prompt, the sampling and the constraints
are the ones chat completions would use for the same conversation, token for token; only the rendering of
the output differs (`frontend.responses_output`). What a stored conversation adds (`previous_response_id`)
is put in front by the frontend once the store has been read (`conversation`).

Whatever pdserve cannot honour is a 400 naming it (built-in tools, image, file and audio inputs, item
references, prompt templates, conversations), never silently dropped.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator

from pdserve.frontend.errors import APIError, bad_request, invalid_type, invalid_value, missing_parameter
from pdserve.frontend.messages import parse_messages
from pdserve.frontend.protocol import (
    MAX_TOP_LOGPROBS,
    GenerationRequest,
    RequestLimits,
    SamplingOptions,
    parse_json_body,
    parse_priority,
)
from pdserve.frontend.structured import parse_logit_bias, parse_response_format
from pdserve.frontend.tools import parse_tools
from pdserve.frontend.validation import (
    INT64_MAX,
    Integral,
    StrictBody,
    call_parser,
    coded_error,
    type_error,
    validated,
)

MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_INPUT_ITEMS = 2048

# reasoning.effort -> does the model think (the chat template's enable_thinking).
REASONING_EFFORTS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True}

_TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}
_UNSERVED_PARTS = {"input_image", "input_file", "input_audio"}
_INCLUDE_SERVED = {"message.output_text.logprobs"}


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass(eq=False)
class ResponsesRequest:
    """A validated /v1/responses body: the chat request it runs as, and what the Response object repeats."""

    generation: GenerationRequest  # messages: this input's only (instructions and a stored conversation not yet)
    input_items: list[dict[str, Any]]  # this input as items with ids, as GET .../input_items lists them
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    metadata: dict[str, str] = field(default_factory=dict)
    truncation: Literal["auto", "disabled"] = "disabled"
    reasoning_effort: str | None = None
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the Response object carries as sent

    def conversation(self, context: list[dict[str, Any]], limits: RequestLimits) -> None:
        """Puts the instructions and a stored conversation's messages (`context`, already cleaned) in front
        of this input; the prompt is bounded as a chat's is. Changes `generation.messages`."""
        gen = self.generation
        assert gen.messages is not None
        head = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages = [*head, *context, *gen.messages]
        if len(messages) > limits.max_messages:
            raise invalid_value("input", f"the conversation has {len(messages)} messages with the stored ones; at "
                                f"most {limits.max_messages} are allowed.")
        chars = sum(len(m.get("content") or "") for m in messages)
        if chars > limits.max_prompt_chars:
            raise bad_request(f"The conversation is too long: {chars} characters; this server accepts at most "
                              f"{limits.max_prompt_chars}.", param="input", code="prompt_too_long")
        gen.messages = messages
        if self.truncation == "auto":
            gen.droppable = len(messages) - len(head) - 1


# --- input items -> chat messages ------------------------------------------------------------------


def _item_text(content: Any, at: str) -> str:
    """The text of an item's content: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_type(at, "a string or an array of content parts", content)
    parts: list[str] = []
    for j, part in enumerate(content):
        where = f"{at}[{j}]"
        if not isinstance(part, dict):
            raise invalid_type(where, "an object", part)
        kind = part.get("type")
        if kind in _UNSERVED_PARTS:
            raise APIError(400, f"Content parts of type {kind!r} are not supported by this server: its models "
                           "read text only.", param=f"{where}.type", code="unsupported_content")
        if kind == "refusal":
            text = part.get("refusal")
        elif kind in _TEXT_PARTS:
            text = part.get("text")
        else:
            raise invalid_value(f"{where}.type", f"{kind!r} is not a content part type this server knows.")
        if not isinstance(text, str):
            raise invalid_type(f"{where}.{'refusal' if kind == 'refusal' else 'text'}", "a string", text)
        parts.append(text)
    return "".join(parts)


def _required_str(item: dict[str, Any], key: str, at: str) -> str:
    value = item.get(key)
    if value is None:
        raise missing_parameter(f"{at}.{key}")
    if not isinstance(value, str):
        raise invalid_type(f"{at}.{key}", "a string", value)
    return value


def input_messages(value: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`input` as chat messages (not yet cleaned) and as the items /input_items lists (with ids)."""
    if value is None:
        raise missing_parameter("input")
    if isinstance(value, str):
        item = {"type": "message", "id": new_item_id("msg"), "role": "user", "status": "completed",
                "content": [{"type": "input_text", "text": value}]}
        return [{"role": "user", "content": value}], [item]
    if not isinstance(value, list):
        raise invalid_type("input", "a string or an array of input items", value)
    if not value:
        raise invalid_value("input", "the array must not be empty.")
    if len(value) > MAX_INPUT_ITEMS:
        raise invalid_value("input", f"at most {MAX_INPUT_ITEMS} input items are allowed, got {len(value)}.")
    messages: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []
    for i, raw in enumerate(value):
        at = f"input[{i}]"
        if not isinstance(raw, dict):
            raise invalid_type(at, "an object", raw)
        kind = raw.get("type", "message" if "role" in raw else None)
        if kind == "message":
            role = raw.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid_value(f"{at}.role", f"{role!r} is not one of 'user', 'system', 'developer', 'assistant'.")
            text = _item_text(raw.get("content"), f"{at}.content")
            messages.append({"role": role, "content": text})
            part = "output_text" if role == "assistant" else "input_text"
            content = [{"type": part, "text": text, **({"annotations": [], "logprobs": []} if role == "assistant" else {})}]
            items.append({"type": "message", "id": raw.get("id") or new_item_id("msg"), "role": role,
                          "status": "completed", "content": content})
        elif kind == "function_call":
            call_id, name = _required_str(raw, "call_id", at), _required_str(raw, "name", at)
            arguments = _required_str(raw, "arguments", at)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # a turn's text and calls are one message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            items.append({"type": "function_call", "id": raw.get("id") or new_item_id("fc"), "call_id": call_id,
                          "name": name, "arguments": arguments, "status": "completed"})
        elif kind == "function_call_output":
            call_id = _required_str(raw, "call_id", at)
            output = raw.get("output")
            if output is None:
                raise missing_parameter(f"{at}.output")
            text = _item_text(output, f"{at}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
            items.append({"type": "function_call_output", "id": raw.get("id") or new_item_id("fco"),
                          "call_id": call_id, "output": text, "status": "completed"})
        elif kind == "reasoning":
            continue  # earlier thinking is not shown to the model again, as chat templates drop it
        elif kind == "item_reference":
            raise APIError(400, "Input items of type 'item_reference' are not supported by this server; send the "
                           "item itself, or continue with previous_response_id.", param=f"{at}.type",
                           code="unsupported_parameter")
        elif kind is None:
            raise missing_parameter(f"{at}.type")
        else:
            raise APIError(400, f"Input items of type {kind!r} are not supported by this server (it serves "
                           "messages, function_call and function_call_output items).", param=f"{at}.type",
                           code="unsupported_parameter")
    if not messages:
        raise invalid_value("input", "the input holds no message to answer.")
    return messages, items


# --- tools, text.format, reasoning -----------------------------------------------------------------


def _renamed(err: APIError, old: str, new: str) -> APIError:
    """`err` with the chat field names of its param replaced by the Responses ones."""
    if err.param is not None:
        err.param = err.param.replace(old, new)
        err.message = err.message.replace(f"'{old}", f"'{new}")
    return err


def chat_tools(obj: dict[str, Any], max_schema_bytes: int) -> Any:
    """`tools`, `tool_choice` and `parallel_tool_calls` as chat fields, then `frontend.tools.parse_tools`."""
    tools = obj.get("tools")
    chat: dict[str, Any] = {"parallel_tool_calls": obj.get("parallel_tool_calls")}
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid_type("tools", "an array", tools)
        converted = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise invalid_type(f"tools[{i}]", "an object", tool)
            kind = tool.get("type")
            if kind != "function":
                raise APIError(400, f"Tools of type {kind!r} are not supported by this server: it has no built-in "
                               "tools (web search, file search, computer use, code interpreter, ...); only "
                               "'function' tools are served.", param=f"tools[{i}].type", code="unsupported_parameter")
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            converted.append({"type": "function", "function": fn})
        chat["tools"] = converted
    choice = obj.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise APIError(400, f"tool_choice of type {choice.get('type')!r} is not supported by this server; use "
                           "'auto', 'none', 'required' or {'type': 'function', 'name': ...}.", param="tool_choice",
                           code="unsupported_parameter")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    try:
        return parse_tools(chat, max_schema_bytes)
    except APIError as err:
        raise _renamed(_renamed(err, ".function.", "."), "tool_choice.function.", "tool_choice.") from None


def text_format(value: Any, max_schema_bytes: int) -> Any:
    """`text` ({"format": ..., "verbosity"?}) as a chat `response_format`, parsed (a StructuredSpec or None)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_type("text", "an object", value)
    verbosity = value.get("verbosity")
    if verbosity not in (None, "medium"):
        raise APIError(400, f"text.verbosity {verbosity!r} is not supported by this server (its models have one "
                       "verbosity: 'medium').", param="text.verbosity", code="unsupported_parameter")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid_type("text.format", "an object", fmt)
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        fmt = {"type": "json_schema", "json_schema": inner}
    try:
        return parse_response_format({"response_format": fmt}, max_schema_bytes)
    except APIError as err:
        raise _renamed(_renamed(err, "response_format.json_schema", "text.format"), "response_format",
                       "text.format") from None


def _reasoning(value: Any) -> str | None:
    """reasoning.effort (None when absent); `summary` other than auto cannot be honoured."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_type("reasoning", "an object", value)
    summary = value.get("summary", value.get("generate_summary"))
    if summary not in (None, "auto"):
        raise APIError(400, f"reasoning.summary {summary!r} is not supported by this server: it returns the "
                       "reasoning text itself, not a summary.", param="reasoning.summary", code="unsupported_parameter")
    effort = value.get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise invalid_value("reasoning.effort", f"{effort!r} is not one of {list(REASONING_EFFORTS)}.")
    return effort


def _metadata(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise invalid_type("metadata", "an object", value)
    if len(value) > MAX_METADATA_KEYS:
        raise invalid_value("metadata", f"at most {MAX_METADATA_KEYS} keys are allowed, got {len(value)}.")
    for k, v in value.items():
        if len(k) > MAX_METADATA_KEY_CHARS:
            raise invalid_value("metadata", f"keys may have at most {MAX_METADATA_KEY_CHARS} characters.")
        if not isinstance(v, str):
            raise invalid_type(f"metadata.{k}", "a string", v)
        if len(v) > MAX_METADATA_VALUE_CHARS:
            raise invalid_value(f"metadata.{k}", f"values may have at most {MAX_METADATA_VALUE_CHARS} characters.")
    return dict(value)


# --- the body --------------------------------------------------------------------------------------


def _unsupported(key: str, what: str) -> Any:
    return coded_error(f"'{key}' is not supported by this server: {what}", "unsupported_parameter")


class ResponsesBody(StrictBody):
    """A /v1/responses body, fields in the order they are checked (then input, tools and text)."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_k: Integral = Field(-1, ge=-1, le=INT64_MAX)
    seed: Integral = Field(None, ge=-(1 << 63), le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0)
    max_output_tokens: Integral = Field(None, ge=1, le=INT64_MAX)
    top_logprobs: Integral = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    instructions: str = None
    previous_response_id: str = None
    store: bool = True
    background: bool = False
    stream: bool = False
    user: str = None
    prompt_cache_key: str = None
    parallel_tool_calls: bool = None
    truncation: Literal["auto", "disabled"] = "disabled"
    metadata: Annotated[Any, AfterValidator(_metadata)] = None
    reasoning: Annotated[Any, AfterValidator(lambda v: call_parser(_reasoning, v))] = None
    logit_bias: Annotated[Any, AfterValidator(lambda v: call_parser(parse_logit_bias, {"logit_bias": v}))] = None
    priority: Annotated[Any, AfterValidator(lambda v: call_parser(parse_priority, v, "priority"))] = None
    include: Any = None
    conversation: Any = None
    prompt: Any = None
    n: Integral = 1

    @field_validator("include")
    @classmethod
    def _include(cls, value: Any) -> list[str]:
        if not isinstance(value, list):
            raise type_error("an array", value)
        for j, name in enumerate(value):
            if name not in _INCLUDE_SERVED:
                raise coded_error(f"include {name!r} is not supported by this server; it can include "
                                  f"{sorted(_INCLUDE_SERVED)}.", "unsupported_parameter", j)
        return value

    @field_validator("conversation")
    @classmethod
    def _conversation(cls, value: Any) -> None:
        raise _unsupported("conversation", "continue a conversation with previous_response_id.")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> None:
        raise _unsupported("prompt", "stored prompt templates are not served; send the input itself.")

    @field_validator("n")
    @classmethod
    def _one(cls, value: int, info: ValidationInfo) -> int:
        if value != 1:
            raise _unsupported("n", "a response has one output.")
        return value


def parse_responses_request(body: bytes, limits: RequestLimits) -> ResponsesRequest:
    """Validates a /v1/responses body. Raises APIError (400)."""
    obj = parse_json_body(body)
    b = validated(ResponsesBody, obj, {"limits": limits})
    if b.model is None:
        raise APIError(400, "you must provide a model parameter", param="model", code="missing_required_parameter")
    if b.background and not b.store:
        raise invalid_value("background", "a background response must be stored ('store' true).")
    if b.background and b.stream:
        raise APIError(400, "'background' together with 'stream' is not supported by this server; poll the "
                       "background response instead.", param="background", code="unsupported_parameter")
    raw_messages, items = input_messages(obj.get("input"))
    try:
        messages = parse_messages(raw_messages, limits)
    except APIError as err:
        raise _renamed(err, "messages", "input") from None
    logprobs = (b.top_logprobs or 0) if b.include and "message.output_text.logprobs" in b.include else None
    sampling = SamplingOptions(
        temperature=b.temperature, top_p=b.top_p, top_k=b.top_k or -1, seed=b.seed,
        presence_penalty=b.presence_penalty, frequency_penalty=b.frequency_penalty,
        repetition_penalty=b.repetition_penalty, max_tokens=b.max_output_tokens,
        logprobs=logprobs,
        logit_bias=b.logit_bias, priority=b.priority)
    if sampling.top_p == 0.0:
        sampling.temperature, sampling.top_p = 0.0, 1.0
    sampling.structured = text_format(obj.get("text"), limits.max_schema_bytes)
    gen = GenerationRequest(kind="chat", model=b.model, sampling=sampling, messages=messages, stream=b.stream,
                            user=b.prompt_cache_key or b.user or None, max_tokens_param="max_output_tokens")
    gen.tools = chat_tools(obj, limits.max_schema_bytes)
    constraint = gen.tools.constraint() if gen.tools is not None else None
    if constraint is not None:
        if sampling.structured is not None:
            raise invalid_value("text.format", "a JSON text.format cannot be combined with tool_choice 'required' or "
                                "a named function (the calls' arguments are the structured output).")
        sampling.structured = constraint
    echo = {
        "temperature": b.temperature, "top_p": b.top_p, "max_output_tokens": b.max_output_tokens,
        "parallel_tool_calls": True if b.parallel_tool_calls is None else b.parallel_tool_calls,
        "tools": obj.get("tools") or [], "tool_choice": obj.get("tool_choice") or ("auto" if obj.get("tools") else "none"),
        "text": obj.get("text") or {"format": {"type": "text"}}, "user": b.user, "top_logprobs": b.top_logprobs,
        "reasoning": {"effort": b.reasoning, "summary": None},
    }
    return ResponsesRequest(generation=gen, input_items=items, instructions=b.instructions,
                            previous_response_id=b.previous_response_id, store=b.store, background=b.background,
                            metadata=b.metadata or {}, truncation=b.truncation, reasoning_effort=b.reasoning, echo=echo)
