"""The `prompt` of a completions body: a string, a list of strings, a token-id list, or a list of those
(at most MAX_PROMPTS). Token ids are checked by pydantic-core, so a 100k-token prompt costs no Python loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from pdserve.frontend.errors import APIError, invalid_type, invalid_value, missing_parameter
from pdserve.frontend.messages import prompt_too_long
from pdserve.frontend.validation import param_path

if TYPE_CHECKING:
    from pdserve.frontend.protocol import Prompt, RequestLimits

MAX_PROMPTS = 128
_TOKEN_IDS = TypeAdapter(list[Annotated[int, Field(ge=0)]], config=ConfigDict(strict=True))


def _token_ids(value: list[Any], param: str, *at: int) -> list[int]:
    try:
        return _TOKEN_IDS.validate_python(value)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where, tok = param_path((param, *at, *error["loc"])), error["input"]
        if error["type"] == "greater_than_equal":
            raise invalid_value(where, f"token id {tok} is negative.") from None
        raise invalid_type(where, "an integer token id", tok) from None


def text_or_token_lists(value: Any, param: str, max_items: int,
                        empty_text: Callable[[str], APIError] | None = None) -> list[Prompt]:
    """`value` as a list of entries: a string, a list of strings, a token-id list, or a list of those (at
    most `max_items`); each entry a string or token ids. `empty_text(param path)` is the error for an
    empty string and an empty list (None: empty strings are allowed). Raises APIError (400)."""
    if isinstance(value, str):
        if not value and empty_text is not None:
            raise empty_text(param)
        return [value]
    if not isinstance(value, list):
        raise invalid_type(param, "a string, an array of strings, or an array of token ids", value)
    if not value:
        raise empty_text(param) if empty_text is not None else invalid_value(param, f"the {param} must not be empty.")
    first = value[0]
    if isinstance(first, int) and not isinstance(first, bool):
        return [_token_ids(value, param)]
    if len(value) > max_items:
        raise invalid_value(param, f"at most {max_items} {param}s per request, got {len(value)}.")
    out: list[Prompt] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item and empty_text is not None:
                raise empty_text(f"{param}[{i}]")
            out.append(item)
        elif isinstance(item, list):
            if not item:
                raise invalid_value(f"{param}[{i}]", f"a token-id {param} must not be empty.")
            out.append(_token_ids(item, param, i))
        else:
            raise invalid_type(f"{param}[{i}]", "a string or an array of token ids", item)
    return out


def parse_prompts(prompt: Any, limits: RequestLimits) -> list[Prompt]:
    """A completions body's `prompt`, one entry per prompt. Raises APIError (400)."""
    if prompt is None:
        raise missing_parameter("prompt")
    prompts = text_or_token_lists(prompt, "prompt", MAX_PROMPTS)
    size = sum(len(p) for p in prompts)  # characters of text prompts, ids of token prompts
    if size > limits.max_prompt_chars:
        raise prompt_too_long("prompt", size, limits)
    return prompts
