"""Parsing and validating OpenAI request bodies into one dataclass per request, with OpenAI-style errors.

A body is a pydantic model (`ChatBody`, `CompletionBody`; `frontend.validation` says how they read JSON
and report errors) validated from the orjson-parsed dict, fields declared in the order they are checked.
Unknown fields are ignored, because SDKs keep adding new ones; known fields whose feature is not served
(the deprecated `functions`, non-text content, ...) are rejected rather than silently dropped, since
ignoring them would change what the client gets.

`messages` are read by `frontend.messages`, `response_format` and `logit_bias` by `frontend.structured`,
`tools` by `frontend.tools` (each schema's grammar is compiled there, so one that cannot be served is a
400 before any node sees it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import orjson
from pydantic import AfterValidator, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from pdserve.engine.structured_spec import StructuredSpec
from pdserve.frontend.errors import APIError, bad_request, invalid_type, invalid_value
from pdserve.frontend.messages import parse_messages
from pdserve.frontend.prompts import parse_prompts
from pdserve.frontend.structured import parse_logit_bias, parse_response_format
from pdserve.frontend.tools import ToolSpec, parse_tools
from pdserve.frontend.validation import (
    INT64_MAX,
    Integral,
    StrictBody,
    as_failure,
    call_parser,
    coded_error,
    type_error,
    validated,
    value_error,
)

MAX_STOP_STRINGS = 4
MAX_CHOICES = 128
MAX_TOP_LOGPROBS = 20
# chat_template_kwargs: extra chat template variables (e.g. enable_thinking), bounded like other inputs.
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_BYTES = 8192
# Template variables the server itself sets when it renders a chat (`Tokenizer.apply_chat_template`,
# `frontend.tools.template_input`), and the globals templates call (`engine.tokenizer.chat_environment`
# and jinja2's own): a request may not replace them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "bos_token", "eos_token", "unk_token", "pad_token", "raise_exception", "strftime_now",
    "range", "dict", "lipsum", "cycler", "joiner", "namespace"})
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
    # chat: extra chat template variables (`chat_template_kwargs`, e.g. {"enable_thinking": False})
    template_kwargs: dict[str, Any] | None = None
    # Chat: how many leading messages (after a first system message) admission may drop, oldest first, to
    # fit the context instead of refusing (the Responses API's truncation "auto"); 0: refuse.
    droppable: int = 0
    truncation: str | None = None  # chat: the request's "auto" / "disabled" (None: the model's default)


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


# --- bodies: fields in the order they are checked -------------------------------------------------


def _limits(info: ValidationInfo) -> RequestLimits:
    return info.context["limits"]


def _model_name(value: str | None) -> str:
    if value is None:
        raise coded_error("you must provide a model parameter", "missing_required_parameter")
    if not value:
        raise value_error("the model name must not be empty.")
    return value


def _stop(value: Any, info: ValidationInfo) -> tuple[str, ...]:
    limits = _limits(info)
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise type_error("a string or an array of strings", value)
    if len(items) > limits.max_stop_strings:
        raise value_error(f"at most {limits.max_stop_strings} stop sequences are allowed, got {len(items)}.")
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise type_error("a string", item, i)
        if not item:
            raise value_error("stop sequences must be non-empty.", i)
        if len(item) > limits.max_stop_chars:
            raise value_error(f"a stop sequence may have at most {limits.max_stop_chars} characters, "
                              f"got {len(item)}.", i)
    return tuple(items)


class _Head(StrictBody):
    model: Annotated[str | None, AfterValidator(_model_name)] = Field(None, validate_default=True)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_k: Integral = Field(-1, ge=-1, le=INT64_MAX)  # 0 is -1: no top-k
    seed: Integral = Field(None, ge=SEED_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0)


class _MaxCompletionTokens(StrictBody):
    max_completion_tokens: Integral = Field(None, ge=1, le=INT64_MAX)  # chat: wins over max_tokens


class _MaxTokens(StrictBody):
    max_tokens: Integral = Field(None, ge=1, le=INT64_MAX)


class _Tail(StrictBody):
    stop: Annotated[Any, AfterValidator(_stop)] = ()
    ignore_eos: bool = False
    stream: bool = False
    stream_options: Any = False  # validated: its include_usage
    user: str = None
    logit_bias: Annotated[Any, AfterValidator(lambda v: call_parser(parse_logit_bias, {"logit_bias": v}))] = None
    priority: Annotated[Any, AfterValidator(lambda v: call_parser(parse_priority, v, "priority"))] = None
    n: Integral = Field(1, ge=1, le=MAX_CHOICES)

    @field_validator("stream_options")
    @classmethod
    def _include_usage(cls, value: Any, info: ValidationInfo) -> bool:
        if not isinstance(value, dict):
            raise type_error("an object", value)
        if not info.data.get("stream"):
            raise value_error("stream_options is only allowed when 'stream' is true.")
        usage = value.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise as_failure(invalid_type("include_usage", "a boolean", usage))
        return bool(usage)


def parse_template_kwargs(value: Any, param: str = "chat_template_kwargs") -> dict[str, Any] | None:
    """Extra chat template variables: an object of at most MAX_TEMPLATE_KWARGS keys and
    MAX_TEMPLATE_KWARGS_BYTES serialized, none of them a variable the server sets itself (the render
    would otherwise take the client's messages or tools from a kwarg). None or {} is None."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_type(param, "an object", value)
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise invalid_value(param, f"at most {MAX_TEMPLATE_KWARGS} keys are allowed, got {len(value)}.")
    try:
        size = len(orjson.dumps(value))
    except TypeError:  # orjson.JSONEncodeError: only from values JSON cannot hold (a parsed body has none)
        raise invalid_value(param, "it must be JSON-serializable.") from None
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise invalid_value(param, f"it may be at most {MAX_TEMPLATE_KWARGS_BYTES} bytes serialized, got {size}.")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(value))
    if reserved:
        raise invalid_value(param, f"{reserved} are set by the server and cannot be overridden.")
    return dict(value) or None


def _sampling(body: ChatBody | CompletionBody, max_tokens: int | None) -> SamplingOptions:
    sampling = SamplingOptions(
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k or -1, seed=body.seed,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, max_tokens=max_tokens, stop=body.stop,
        ignore_eos=body.ignore_eos, logit_bias=body.logit_bias, priority=body.priority)
    if sampling.top_p == 0.0:
        # top_p 0 keeps only the most likely token: greedy, which the engine expresses as temperature 0.
        sampling.temperature, sampling.top_p = 0.0, 1.0
    return sampling


def _request(kind: Kind, body: ChatBody | CompletionBody, max_tokens: int | None, max_param: str) -> GenerationRequest:
    return GenerationRequest(kind=kind, model=body.model, sampling=_sampling(body, max_tokens), n=body.n,
                             stream=body.stream, include_usage=body.stream_options, user=body.user or None,
                             max_tokens_param=max_param)


def _unsupported(key: str, what: str) -> PydanticCustomError:
    return coded_error(f"'{key}' is not supported by this server: {what}", "unsupported_parameter")


# --- chat -----------------------------------------------------------------------------------------


class ChatBody(_Tail, _MaxTokens, _MaxCompletionTokens, _Head):
    """A /v1/chat/completions body; then `parse_tools`, and `audio` is refused."""

    messages: Any = Field(None, validate_default=True)  # validated: cleaned for the chat template
    logprobs: bool = False
    top_logprobs: Integral = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    functions: Any = None
    function_call: Any = None
    response_format: Any = None  # validated: a StructuredSpec
    chat_template_kwargs: Annotated[Any, AfterValidator(lambda v: call_parser(parse_template_kwargs, v))] = None
    # As the Responses API names it: "auto" lets admission drop the oldest turns of a chat over the context
    # (`frontend.degrade` trim_history); absent: the model's trim_history default.
    truncation: Literal["auto", "disabled"] = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, messages: Any, info: ValidationInfo) -> list[dict[str, Any]]:
        return call_parser(parse_messages, messages, _limits(info))

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top: int, info: ValidationInfo) -> int:
        if not info.data.get("logprobs", True):
            raise value_error("top_logprobs requires 'logprobs' to be true.")
        return top

    @field_validator("functions")
    @classmethod
    def _functions(cls, value: Any) -> None:
        if value:
            raise _unsupported("functions", "the deprecated 'functions' are not served; send them as 'tools'.")

    @field_validator("function_call")
    @classmethod
    def _function_call(cls, value: Any) -> None:
        raise _unsupported("function_call", "the deprecated 'function_call' is not served; use 'tool_choice'.")

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: Any, info: ValidationInfo) -> StructuredSpec | None:
        return call_parser(parse_response_format, {"response_format": value}, _limits(info).max_schema_bytes)


def parse_chat_request(obj: dict[str, Any], limits: RequestLimits = RequestLimits()) -> GenerationRequest:
    """Validates a /v1/chat/completions body. Raises APIError (400)."""
    body = validated(ChatBody, obj, {"limits": limits})
    max_param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    req = _request("chat", body, getattr(body, max_param), max_param)
    req.messages = body.messages
    req.template_kwargs = body.chat_template_kwargs
    req.truncation = body.truncation
    req.sampling.logprobs = (body.top_logprobs or 0) if body.logprobs else None
    req.sampling.structured = body.response_format
    req.tools = parse_tools(obj, limits.max_schema_bytes)
    constraint = req.tools.constraint() if req.tools is not None else None
    if constraint is not None:
        if req.sampling.structured is not None:
            raise invalid_value("response_format", "a JSON response_format cannot be combined with "
                                "tool_choice 'required' or a named function (the calls' arguments are the "
                                "structured output).")
        req.sampling.structured = constraint
    if obj.get("audio") is not None:
        raise APIError(400, "'audio' is not supported by this server: audio output is not available.",
                       param="audio", code="unsupported_parameter")
    return req


# --- completions ----------------------------------------------------------------------------------

class CompletionBody(_Tail, _MaxTokens, _Head):
    """A /v1/completions body."""

    prompt: Any = Field(None, validate_default=True)  # validated: one entry per prompt
    logprobs: Integral = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: Integral = Field(None, ge=1, le=MAX_CHOICES)
    suffix: str = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any, info: ValidationInfo) -> list[Prompt]:
        return call_parser(parse_prompts, prompt, _limits(info))

    @field_validator("echo")
    @classmethod
    def _echo(cls, echo: bool, info: ValidationInfo) -> bool:
        if echo and info.data.get("logprobs") is not None:
            raise coded_error("'echo' together with 'logprobs' is not supported (prompt logprobs are not "
                              "computed).", "unsupported_parameter")
        return echo

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, best_of: int, info: ValidationInfo) -> int:
        if best_of != info.data.get("n", best_of):
            raise coded_error("'best_of' different from 'n' is not supported.", "unsupported_parameter")
        return best_of


def parse_completion_request(obj: dict[str, Any], limits: RequestLimits = RequestLimits()) -> GenerationRequest:
    """Validates a /v1/completions body. Raises APIError (400)."""
    body = validated(CompletionBody, obj, {"limits": limits})
    req = _request("completion", body, body.max_tokens, "max_tokens")
    req.prompts = body.prompt
    req.sampling.logprobs = body.logprobs
    req.echo = body.echo
    req.suffix = body.suffix or None
    if len(req.prompts) * req.n > MAX_CHOICES:
        raise invalid_value("n", f"prompts x n must be at most {MAX_CHOICES}, got {len(req.prompts) * req.n}.")
    if req.sampling.max_tokens is None:
        req.sampling.max_tokens = 16  # the legacy endpoint's documented default
    return req
