"""Parsing and validating OpenAI request bodies into one dataclass per request, with OpenAI-style errors.

A lean hand-written validator instead of pydantic models: it runs on every request, it produces the exact
messages and `param` paths OpenAI uses ("Invalid type for 'temperature' ..."), and it ignores unknown
fields, because SDKs keep adding new ones. Known fields whose feature is not served (the deprecated
`functions`, non-text content, ...) are rejected rather than silently dropped, since ignoring them would change what
the client gets.

`response_format` and `logit_bias` are read by `frontend.structured`, `tools` by `frontend.tools` (each
schema's grammar is compiled there, so one that cannot be served is a 400 before any node sees it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from pdserve.engine.structured_spec import StructuredSpec
from pdserve.frontend.errors import APIError, bad_request, invalid_type, invalid_value, missing_parameter
from pdserve.frontend.structured import parse_logit_bias, parse_response_format
from pdserve.frontend.tools import ToolSpec, parse_tool_calls, parse_tools

ROLES = ("system", "user", "assistant", "tool", "developer", "function")
MAX_STOP_STRINGS = 4
MAX_CHOICES = 128
MAX_TOP_LOGPROBS = 20
MAX_PROMPTS = 128
INT64_MAX = (1 << 63) - 1
SEED_MIN = -(1 << 63)

# Named priorities (`priority` takes these or an integer; lower is served first, as in vLLM).
PRIORITY_CLASSES: dict[str, int] = {"interactive": 0, "batch": 10}
PRIORITY_BOUND = (1 << 31) - 1

Kind = Literal["chat", "completion"]
Prompt = str | list[int]


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on what one request may ask for, checked while parsing (FrontendConfig sets them)."""

    max_messages: int = 2048
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_chars: int = 256  # characters per stop string
    max_prompt_chars: int = 1 << 20  # characters of message content, or prompt characters plus token ids
    max_schema_bytes: int = 1 << 16  # bytes of a response_format JSON schema (serialized)

    def __post_init__(self) -> None:
        assert min(self.max_messages, self.max_stop_strings, self.max_stop_chars, self.max_prompt_chars,
                   self.max_schema_bytes) >= 1, self


@dataclass(eq=False)
class SamplingOptions:
    """Sampling fields of a request, validated; `max_tokens` None means the model's default."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: sampled token plus the top k
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    structured: StructuredSpec | None = None  # response_format json_object / json_schema
    # Scheduling priority, lower first; None: the tenant's. Admission sets the one in force: never more
    # urgent than the tenant's (`effective_priority`).
    priority: int | None = None


@dataclass(eq=False)
class GenerationRequest:
    """A validated chat or completions request, before tokenization."""

    kind: Kind
    model: str
    sampling: SamplingOptions
    messages: list[dict[str, Any]] | None = None  # chat: cleaned messages for the chat template
    prompts: list[Prompt] | None = None  # completions: one entry per prompt
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    echo: bool = False
    tools: ToolSpec | None = None  # chat: tools, tool_choice, parallel_tool_calls
    suffix: str | None = None  # completions: the text after the insertion (fill-in-the-middle models)
    max_tokens_param: str = "max_tokens"  # the field max_tokens came from, for error messages


def parse_json_body(body: bytes) -> dict[str, Any]:
    """Decodes a request body; malformed JSON, invalid UTF-8 and non-objects are 400s."""
    if not body:
        raise bad_request("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as err:
        detail = str(err)
        if "utf-8" in detail.lower() or "surrogate" in detail.lower():
            raise bad_request(f"The request body is not valid UTF-8 JSON: {detail}", code="invalid_encoding") from None
        raise bad_request(f"We could not parse the JSON body of your request: {detail}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return obj


# --- field readers --------------------------------------------------------------------------------


def _number(obj: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = obj.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid_type(key, "a number", value)
    if not lo <= value <= hi:
        raise invalid_value(key, f"{value} is out of range; it must be between {lo:g} and {hi:g}.")
    return float(value)


def _integer(obj: dict[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    value = obj.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_type(key, "an integer", value)
    if not lo <= value <= hi:
        bound = f"at least {lo}" if hi >= INT64_MAX else f"between {lo} and {hi}"
        raise invalid_value(key, f"{value} is out of range; it must be {bound}.")
    return value


def _boolean(obj: dict[str, Any], key: str, default: bool) -> bool:
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_type(key, "a boolean", value)
    return value


def _string(obj: dict[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid_type(key, "a string", value)
    return value


def _stop(obj: dict[str, Any], limits: RequestLimits) -> tuple[str, ...]:
    value = obj.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise invalid_type("stop", "a string or an array of strings", value)
    if len(items) > limits.max_stop_strings:
        raise invalid_value("stop", f"at most {limits.max_stop_strings} stop sequences are allowed, got {len(items)}.")
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise invalid_type(f"stop[{i}]", "a string", item)
        if not item:
            raise invalid_value(f"stop[{i}]", "stop sequences must be non-empty.")
        if len(item) > limits.max_stop_chars:
            raise invalid_value(f"stop[{i}]", f"a stop sequence may have at most {limits.max_stop_chars} characters, "
                                f"got {len(item)}.")
    return tuple(items)


def parse_priority(value: object, param: str) -> int | None:
    """A priority: an integer (lower first) or a class name (PRIORITY_CLASSES); None when absent."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in PRIORITY_CLASSES:
            raise invalid_value(param, f"{value!r} is not one of {list(PRIORITY_CLASSES)} or an integer.")
        return PRIORITY_CLASSES[value]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_type(param, "an integer or a priority class name", value)
    if not -PRIORITY_BOUND <= value <= PRIORITY_BOUND:
        raise invalid_value(param, f"{value} is out of range; it must be between {-PRIORITY_BOUND} and {PRIORITY_BOUND}.")
    return value


def effective_priority(requested: int | None, tenant_priority: int) -> int:
    """The priority a request runs at: its own, but never more urgent than its tenant's."""
    return tenant_priority if requested is None else max(requested, tenant_priority)


def _prompt_too_long(param: str, size: int, limits: RequestLimits) -> APIError:
    return APIError(400, f"The {param} is too long: {size} characters; this server accepts at most "
                    f"{limits.max_prompt_chars}.", param=param, code="prompt_too_long")


def _unsupported(obj: dict[str, Any], key: str, ok: bool, what: str) -> None:
    if obj.get(key) is not None and not ok:
        raise APIError(400, f"'{key}' is not supported by this server: {what}", param=key, code="unsupported_parameter")


def _common(obj: dict[str, Any], kind: Kind, limits: RequestLimits) -> GenerationRequest:
    model = obj.get("model")
    if model is None:
        raise APIError(400, "you must provide a model parameter", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise invalid_type("model", "a string", model)
    if not model:
        raise invalid_value("model", "the model name must not be empty.")
    max_param = "max_tokens"
    if kind == "chat" and obj.get("max_completion_tokens") is not None:
        max_param = "max_completion_tokens"
    sampling = SamplingOptions(
        temperature=_number(obj, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(obj, "top_p", 1.0, 0.0, 1.0),
        top_k=_integer(obj, "top_k", -1, -1, INT64_MAX) or -1,
        seed=_integer(obj, "seed", None, SEED_MIN, INT64_MAX),
        presence_penalty=_number(obj, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(obj, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(obj, "repetition_penalty", 1.0, 0.01, 10.0),
        max_tokens=_integer(obj, max_param, None, 1, INT64_MAX),
        stop=_stop(obj, limits),
        ignore_eos=_boolean(obj, "ignore_eos", False),
    )
    if kind == "chat" and max_param == "max_completion_tokens":
        _integer(obj, "max_tokens", None, 1, INT64_MAX)  # still type-checked when both are sent
    if sampling.top_p == 0.0:
        # top_p 0 keeps only the most likely token: greedy, which the engine expresses as temperature 0.
        sampling.temperature, sampling.top_p = 0.0, 1.0
    stream = _boolean(obj, "stream", False)
    options = obj.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise invalid_type("stream_options", "an object", options)
        if not stream:
            raise invalid_value("stream_options", "stream_options is only allowed when 'stream' is true.")
        include_usage = _boolean(options, "include_usage", False)
    user = _string(obj, "user")
    sampling.logit_bias = parse_logit_bias(obj)
    sampling.priority = parse_priority(obj.get("priority"), "priority")
    return GenerationRequest(
        kind=kind,
        model=model,
        sampling=sampling,
        n=_integer(obj, "n", 1, 1, MAX_CHOICES) or 1,
        stream=stream,
        include_usage=include_usage,
        user=user or None,
        max_tokens_param=max_param,
    )


# --- chat -----------------------------------------------------------------------------------------


def _message_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_type(param, "a string or an array of content parts", content)
    parts: list[str] = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise invalid_type(where, "an object", part)
        ptype = part.get("type")
        if ptype != "text":
            raise APIError(400, f"Content parts of type {ptype!r} are not supported; only 'text' parts are.",
                           param=f"{where}.type", code="unsupported_content")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid_type(f"{where}.text", "a string", text)
        parts.append(text)
    return "".join(parts)


def _messages(obj: dict[str, Any], limits: RequestLimits) -> list[dict[str, Any]]:
    messages = obj.get("messages")
    if messages is None:
        raise missing_parameter("messages")
    if not isinstance(messages, list):
        raise invalid_type("messages", "an array", messages)
    if not messages:
        raise invalid_value("messages", "the array must not be empty.")
    if len(messages) > limits.max_messages:
        raise invalid_value("messages", f"at most {limits.max_messages} messages are allowed, got {len(messages)}.")
    cleaned: list[dict[str, Any]] = []
    chars = 0
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise invalid_type(where, "an object", msg)
        role = msg.get("role")
        if role is None:
            raise missing_parameter(f"{where}.role")
        if not isinstance(role, str):
            raise invalid_type(f"{where}.role", "a string", role)
        if role not in ROLES:
            raise invalid_value(f"{where}.role", f"{role!r} is not one of {list(ROLES)}.")
        content = msg.get("content")
        if content is None:
            if role != "assistant":
                raise missing_parameter(f"{where}.content")
            text = ""
        else:
            text = _message_text(content, f"{where}.content")
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        item: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
        name = msg.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise invalid_type(f"{where}.name", "a string", name)
            item["name"] = name
        if role == "assistant" and msg.get("tool_calls"):
            item["tool_calls"] = parse_tool_calls(msg["tool_calls"], f"{where}.tool_calls")
            chars += sum(len(c["function"]["arguments"]) for c in item["tool_calls"])
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if call_id is None:
                raise missing_parameter(f"{where}.tool_call_id")
            if not isinstance(call_id, str):
                raise invalid_type(f"{where}.tool_call_id", "a string", call_id)
            item["tool_call_id"] = call_id
        chars += len(text)
        if chars > limits.max_prompt_chars:
            raise _prompt_too_long("messages", chars, limits)
        cleaned.append(item)
    return cleaned


def parse_chat_request(obj: dict[str, Any], limits: RequestLimits = RequestLimits()) -> GenerationRequest:
    """Validates a /v1/chat/completions body. Raises APIError (400)."""
    req = _common(obj, "chat", limits)
    req.messages = _messages(obj, limits)
    logprobs = _boolean(obj, "logprobs", False)
    top = _integer(obj, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise invalid_value("top_logprobs", "top_logprobs requires 'logprobs' to be true.")
    req.sampling.logprobs = (top or 0) if logprobs else None
    _unsupported(obj, "functions", not obj.get("functions"), "the deprecated 'functions' are not served; "
                 "send them as 'tools'.")
    _unsupported(obj, "function_call", False, "the deprecated 'function_call' is not served; use 'tool_choice'.")
    req.sampling.structured = parse_response_format(obj, limits.max_schema_bytes)
    req.tools = parse_tools(obj, limits.max_schema_bytes)
    constraint = req.tools.constraint() if req.tools is not None else None
    if constraint is not None:
        if req.sampling.structured is not None:
            raise invalid_value("response_format", "a JSON response_format cannot be combined with "
                                "tool_choice 'required' or a named function (the calls' arguments are the "
                                "structured output).")
        req.sampling.structured = constraint
    _unsupported(obj, "audio", False, "audio output is not available.")
    return req


# --- completions ----------------------------------------------------------------------------------


def _token_list(value: list[Any], param: str) -> list[int]:
    for j, tok in enumerate(value):
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise invalid_type(f"{param}[{j}]", "an integer token id", tok)
        if tok < 0:
            raise invalid_value(f"{param}[{j}]", f"token id {tok} is negative.")
    return value


def _prompts(obj: dict[str, Any], limits: RequestLimits) -> list[Prompt]:
    prompts = _prompt_list(obj)
    size = sum(len(p) for p in prompts)  # characters of text prompts, ids of token prompts
    if size > limits.max_prompt_chars:
        raise _prompt_too_long("prompt", size, limits)
    return prompts


def _prompt_list(obj: dict[str, Any]) -> list[Prompt]:
    prompt = obj.get("prompt")
    if prompt is None:
        raise missing_parameter("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise invalid_type("prompt", "a string, an array of strings, or an array of token ids", prompt)
    if not prompt:
        raise invalid_value("prompt", "the prompt must not be empty.")
    first = prompt[0]
    if isinstance(first, int) and not isinstance(first, bool):
        return [_token_list(prompt, "prompt")]
    if len(prompt) > MAX_PROMPTS:
        raise invalid_value("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}.")
    out: list[Prompt] = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list):
            if not item:
                raise invalid_value(f"prompt[{i}]", "a token-id prompt must not be empty.")
            out.append(_token_list(item, f"prompt[{i}]"))
        else:
            raise invalid_type(f"prompt[{i}]", "a string or an array of token ids", item)
    return out


def parse_completion_request(obj: dict[str, Any], limits: RequestLimits = RequestLimits()) -> GenerationRequest:
    """Validates a /v1/completions body. Raises APIError (400)."""
    req = _common(obj, "completion", limits)
    req.prompts = _prompts(obj, limits)
    req.sampling.logprobs = _integer(obj, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    req.echo = _boolean(obj, "echo", False)
    if req.echo and req.sampling.logprobs is not None:
        raise APIError(400, "'echo' together with 'logprobs' is not supported (prompt logprobs are not computed).",
                       param="echo", code="unsupported_parameter")
    best_of = _integer(obj, "best_of", None, 1, MAX_CHOICES)
    if best_of is not None and best_of != req.n:
        raise APIError(400, "'best_of' different from 'n' is not supported.", param="best_of",
                       code="unsupported_parameter")
    req.suffix = _string(obj, "suffix") or None
    if len(req.prompts) * req.n > MAX_CHOICES:
        raise invalid_value("n", f"prompts x n must be at most {MAX_CHOICES}, got {len(req.prompts) * req.n}.")
    if req.sampling.max_tokens is None:
        req.sampling.max_tokens = 16  # the legacy endpoint's documented default
    return req
