"""Request bodies validated by pydantic, reported as the OpenAI API reports errors.

`StrictBody` is the base of every body model: strict JSON types (the string "5" is no integer; 5.0 is,
as `Integral` says), JSON null the same as an absent field (SDKs send null for unset options), unknown
fields ignored, because SDKs keep adding new ones. A model declares its fields in the order they are
checked; `validated` reports the first error in that order, turned by `api_error`, the one place that
knows pydantic's error types, into the message and `param` path OpenAI uses ("Invalid type for
'temperature' ...", `messages[0].content`). Validators raise `fail(...)` for the rules pydantic has no
constraint for; the APIError it names gets its param from where pydantic found the field.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Annotated, Any, TypeVar

import annotated_types
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, model_validator
from pydantic_core import ErrorDetails, PydanticCustomError

from pdserve.frontend.errors import APIError, invalid_type, invalid_value, missing_parameter

INT64_MAX = (1 << 63) - 1
_FAILED = "pdserve"  # the type of the errors `fail` makes
_EXPECTED = {"float_type": "a number", "int_type": "an integer", "bool_type": "a boolean", "string_type": "a string",
             "list_type": "an array", "dict_type": "an object", "model_type": "an object",
             "model_attributes_type": "an object"}
Loc = tuple[str | int, ...]
Body = TypeVar("Body", bound=BaseModel)


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer field: JSON has one number type, so 5.0 is the integer 5 (OpenAI accepts it); 5.5 is none.
Integral = Annotated[int, BeforeValidator(_integral)]


class StrictBody(BaseModel):
    """Strict JSON types, unknown fields ignored, null the same as absent. A field's default is what its
    absence means (None where it has no value: pydantic validates no default unless told to)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_absent(cls, obj: Any) -> Any:
        return {k: v for k, v in obj.items() if v is not None} if isinstance(obj, dict) else obj


def fail(make: Callable[[str], APIError], *at: str | int) -> PydanticCustomError:
    """A validator's error: `make(param)` is the APIError, `at` the path below the field it validates."""
    return PydanticCustomError(_FAILED, "invalid", {"make": make, "at": at})


def type_error(expected: str, value: object, *at: str | int) -> PydanticCustomError:
    return fail(partial(invalid_type, expected=expected, value=value), *at)


def value_error(message: str, *at: str | int) -> PydanticCustomError:
    return fail(partial(invalid_value, message=message), *at)


def missing(*at: str | int) -> PydanticCustomError:
    return fail(missing_parameter, *at)


def coded_error(message: str, code: str, *at: str | int) -> PydanticCustomError:
    """A 400 with its own message and code (unsupported_parameter, ...)."""
    return fail(lambda param: APIError(400, message, param=param, code=code), *at)


def as_failure(err: APIError) -> PydanticCustomError:
    """An APIError whose param is already the full path, raised from inside a validator."""
    return fail(lambda _param: err)


def call_parser(parse: Callable[..., Any], *args: Any) -> Any:
    """`parse(*args)` of a parser that raises APIErrors (frontend.tools, frontend.structured), in a validator."""
    try:
        return parse(*args)
    except APIError as err:
        raise as_failure(err) from None


def param_path(loc: Loc) -> str:
    """("messages", 0, "content") -> "messages[0].content"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else part
    return out


def _range(model: type[BaseModel], name: str, value: Any) -> str:
    """"<value> is out of range; it must be ..." with both bounds of the field's Field(ge=, le=)."""
    meta = model.model_fields[name].metadata
    lo = next(m.ge for m in meta if isinstance(m, annotated_types.Ge))
    hi = next(m.le for m in meta if isinstance(m, annotated_types.Le))
    if isinstance(lo, int):  # an Integral field: the value is an int or an integral float
        bound = f"at least {lo}" if hi >= INT64_MAX else f"between {lo} and {hi}"
        return f"{int(value)} is out of range; it must be {bound}."
    return f"{value} is out of range; it must be between {lo:g} and {hi:g}."


def api_error(error: ErrorDetails, model: type[BaseModel] | None, prefix: Loc = ()) -> APIError:
    """The 400 of one pydantic error raised validating `model` (found at `prefix` in the body; None: a type
    with no bounded number field)."""
    ctx = error.get("ctx") or {}
    loc = (*prefix, *error["loc"], *ctx.get("at", ()))
    param = param_path(loc)
    kind, value = error["type"], error["input"]
    if kind == _FAILED:
        return ctx["make"](param)
    if kind == "missing":
        return missing_parameter(param)
    if kind in _EXPECTED:
        if value is None and loc and isinstance(loc[-1], str):
            return missing_parameter(param)  # a required field sent as null: null is an absent field everywhere
        return invalid_type(param, _EXPECTED[kind], value)
    if kind in ("greater_than_equal", "less_than_equal") and model is not None:
        return invalid_value(param, _range(model, str(error["loc"][0]), value))
    return invalid_value(param, error["msg"])  # a constraint no field declares today: still the OpenAI shape


def validated(model: type[Body], obj: Any, context: dict[str, Any], prefix: Loc = ()) -> Body:
    """`obj` validated as `model`. Raises the APIError of its first error."""
    try:
        return model.model_validate(obj, context=context)
    except ValidationError as exc:
        raise api_error(exc.errors(include_url=False)[0], model, prefix) from None
