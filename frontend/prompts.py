"""The `prompt` of a completions body: a string, a list of strings, a token-id list, or a list of those
(at most MAX_PROMPTS). Token ids are checked by pydantic-core, so a 100k-token prompt costs no Python loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from pdserve.frontend.errors import invalid_type, invalid_value, missing_parameter
from pdserve.frontend.messages import prompt_too_long
from pdserve.frontend.validation import param_path

if TYPE_CHECKING:
    from pdserve.frontend.protocol import Prompt, RequestLimits

MAX_PROMPTS = 128
_TOKEN_IDS = TypeAdapter(list[Annotated[int, Field(ge=0)]], config=ConfigDict(strict=True))


def _token_ids(value: list[Any], *at: int) -> list[int]:
    try:
        return _TOKEN_IDS.validate_python(value)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        param, tok = param_path(("prompt", *at, *error["loc"])), error["input"]
        if error["type"] == "greater_than_equal":
            raise invalid_value(param, f"token id {tok} is negative.") from None
        raise invalid_type(param, "an integer token id", tok) from None


def _prompt_list(prompt: Any) -> list[Prompt]:
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise invalid_type("prompt", "a string, an array of strings, or an array of token ids", prompt)
    if not prompt:
        raise invalid_value("prompt", "the prompt must not be empty.")
    first = prompt[0]
    if isinstance(first, int) and not isinstance(first, bool):
        return [_token_ids(prompt)]
    if len(prompt) > MAX_PROMPTS:
        raise invalid_value("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}.")
    out: list[Prompt] = []
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list):
            if not item:
                raise invalid_value(f"prompt[{i}]", "a token-id prompt must not be empty.")
            out.append(_token_ids(item, i))
        else:
            raise invalid_type(f"prompt[{i}]", "a string or an array of token ids", item)
    return out


def parse_prompts(prompt: Any, limits: RequestLimits) -> list[Prompt]:
    """A completions body's `prompt`, one entry per prompt. Raises APIError (400)."""
    if prompt is None:
        raise missing_parameter("prompt")
    prompts = _prompt_list(prompt)
    size = sum(len(p) for p in prompts)  # characters of text prompts, ids of token prompts
    if size > limits.max_prompt_chars:
        raise prompt_too_long("prompt", size, limits)
    return prompts
