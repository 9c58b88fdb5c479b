"""The `messages` of a chat body, cleaned into the dicts chat templates take ({"role", "content": text,
"name"?, "tool_calls"?, "tool_call_id"?}).

A message is a pydantic union tagged by its role (`Message`): the assistant's content may be absent, a
tool result needs its `tool_call_id`, every other role needs content. Typed dicts rather than models: a
message is validated into the dict the template gets, with no object per message (a long conversation
costs what the hand-written loop did). Messages are validated one by one, so that the first bad message,
or the one at which the prompt gets too long, is the one reported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, NotRequired

from pydantic import AfterValidator, ConfigDict, Field, TypeAdapter, ValidationError
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from pdserve.frontend.errors import APIError, invalid_type, invalid_value, missing_parameter
from pdserve.frontend.tools import parse_tool_calls
from pdserve.frontend.validation import api_error, coded_error, missing, type_error

if TYPE_CHECKING:
    from pdserve.frontend.protocol import RequestLimits

ROLES = ("system", "user", "assistant", "tool", "developer", "function")


def prompt_too_long(param: str, size: int, limits: RequestLimits) -> APIError:
    return APIError(400, f"The {param} is too long: {size} characters; this server accepts at most "
                    f"{limits.max_prompt_chars}.", param=param, code="prompt_too_long")


def _text(content: Any) -> str:
    """The text of a string or of a list of text parts."""
    if content is None:
        raise missing()
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise type_error("a string or an array of content parts", content)
    parts: list[str] = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise type_error("an object", part, j)
        if part.get("type") != "text":
            raise coded_error(f"Content parts of type {part.get('type')!r} are not supported; only 'text' parts "
                              "are.", "unsupported_content", j, "type")
        text = part.get("text")
        if not isinstance(text, str):
            raise type_error("a string", text, j, "text")
        parts.append(text)
    return "".join(parts)


Text = Annotated[Any, AfterValidator(_text)]


class _Said(TypedDict):
    role: Literal["system", "user", "developer", "function"]
    content: Text
    name: NotRequired[str | None]


class _Assistant(TypedDict):
    role: Literal["assistant"]
    content: NotRequired[Text | None]
    name: NotRequired[str | None]
    # tool_calls: read by `_cleaned` with their full path (frontend.tools names each call's fields)


class _ToolResult(TypedDict):
    role: Literal["tool"]
    content: Text
    name: NotRequired[str | None]
    tool_call_id: str


Message = TypeAdapter(Annotated[_Said | _Assistant | _ToolResult, Field(discriminator="role")],
                      config=ConfigDict(strict=True))


def _message_error(raw: Any, i: int, exc: ValidationError) -> APIError:
    """The APIError of message i's first error: the role tag's own, or one of the role's fields."""
    error = exc.errors(include_url=False)[0]
    where = f"messages[{i}].role"
    if error["type"] in ("union_tag_not_found", "union_tag_invalid"):
        role = raw.get("role")
        if role is None:
            return missing_parameter(where)
        if not isinstance(role, str):
            return invalid_type(where, "a string", role)
        return invalid_value(where, f"{role!r} is not one of {list(ROLES)}.")
    loc = error["loc"][1:] if isinstance(raw, dict) else error["loc"]  # without the role tag pydantic adds
    return api_error({**error, "loc": loc}, None, ("messages", i))


def _cleaned(raw: Any, i: int) -> tuple[dict[str, Any], int]:
    """Message i for the chat template, and the characters it adds to the prompt."""
    try:
        msg = Message.validate_python(raw)
    except ValidationError as exc:
        raise _message_error(raw, i, exc) from None
    role = msg["role"]
    # "developer" is OpenAI's newer name for the system role; chat templates know "system".
    item: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": msg.get("content") or ""}
    if msg.get("name") is not None:
        item["name"] = msg["name"]
    chars = len(item["content"])
    if role == "assistant" and raw.get("tool_calls"):
        item["tool_calls"] = parse_tool_calls(raw["tool_calls"], f"messages[{i}].tool_calls")
        chars += sum(len(c["function"]["arguments"]) for c in item["tool_calls"])
    elif role == "tool":
        item["tool_call_id"] = msg["tool_call_id"]
    return item, chars


def parse_messages(messages: Any, limits: RequestLimits) -> list[dict[str, Any]]:
    """A chat body's `messages`, cleaned for the chat template. Raises APIError (400)."""
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
    for i, raw in enumerate(messages):
        item, added = _cleaned(raw, i)
        chars += added
        if chars > limits.max_prompt_chars:
            raise prompt_too_long("messages", chars, limits)
        cleaned.append(item)
    return cleaned
