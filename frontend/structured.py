"""The structured-output and logit_bias fields of a request: `response_format` (json_object, json_schema)
into an `engine.structured_spec.StructuredSpec` whose llguidance grammar is compiled here (no tokenizer,
no torch), so a schema that cannot be served is a 400 naming the problem before any node sees it; and
`logit_bias` ({"<token id>": bias}), whose ids `check_logit_bias` checks against the model's vocabulary
once the model is known (at admission)."""

from __future__ import annotations

from typing import Any

import orjson

from pdserve.engine.structured_spec import GrammarError, StructuredSpec, check_spec
from pdserve.frontend.errors import APIError, invalid_type, invalid_value, json_type_name, missing_parameter

MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's bound
MAX_LOGIT_BIAS = 100.0


def parse_logit_bias(obj: dict[str, Any]) -> dict[int, float] | None:
    """`logit_bias`: {"<token id>": bias in [-100, 100]}, at most MAX_LOGIT_BIAS_ENTRIES entries. Whether
    the ids are in the model's vocabulary is `check_logit_bias`'s question."""
    value = obj.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_type("logit_bias", "an object mapping token ids to biases", value)
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid_value("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} tokens may be biased, got {len(value)}.")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise invalid_value("logit_bias", f"keys must be token ids (non-negative integers as strings), got {key!r}.")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise invalid_type(f"logit_bias.{key}", "a number", bias)
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise invalid_value(f"logit_bias.{key}", f"{bias} is out of range; it must be between "
                                f"{-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}.")
        out[int(key)] = float(bias)
    return out or None


def check_logit_bias(logit_bias: dict[int, float] | None, vocab_size: int, model: str) -> None:
    """400 APIError when a `logit_bias` token id is outside the model's vocabulary. Changes nothing."""
    for token in sorted(logit_bias or ()):
        if token >= vocab_size:
            raise invalid_value("logit_bias", f"token id {token} is outside the vocabulary of model {model!r} "
                                f"(size {vocab_size}).")


def _schema_error(message: str) -> APIError:
    return APIError(400, f"Invalid 'response_format': {message}", param="response_format", code="invalid_json_schema")


def parse_response_format(obj: dict[str, Any], max_schema_bytes: int) -> StructuredSpec | None:
    """`response_format`: None for text; a StructuredSpec for {"type": "json_object"} and {"type":
    "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}, whose grammar is compiled
    here (a 400 naming the problem when it cannot be). `strict` is accepted either way: the schema is
    always enforced."""
    fmt = obj.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid_type("response_format", "an object", fmt)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        spec = StructuredSpec("json_object")
    elif kind == "json_schema":
        spec = StructuredSpec("json_schema", _json_schema(fmt.get("json_schema"), max_schema_bytes))
    else:
        raise invalid_value("response_format.type", f"{kind!r} is not one of ['text', 'json_object', 'json_schema'].")
    try:
        check_spec(spec)
    except GrammarError as err:
        raise _schema_error(str(err)) from None
    return spec


def _json_schema(value: Any, max_schema_bytes: int) -> str:
    """The serialized schema of a response_format json_schema object (its `name` checked as OpenAI does)."""
    where = "response_format.json_schema"
    if value is None:
        raise missing_parameter(where)
    if not isinstance(value, dict):
        raise invalid_type(where, "an object", value)
    name = value.get("name")
    if name is None:
        raise missing_parameter(f"{where}.name")
    if not isinstance(name, str):
        raise invalid_type(f"{where}.name", "a string", name)
    if not 1 <= len(name) <= 64 or not all(c.isascii() and (c.isalnum() or c in "_-") for c in name):
        raise invalid_value(f"{where}.name", "it must be 1 to 64 characters of a-z, A-Z, 0-9, '_' and '-'.")
    strict = value.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_type(f"{where}.strict", "a boolean", strict)
    schema = value.get("schema")
    if schema is None:
        raise missing_parameter(f"{where}.schema")
    if not isinstance(schema, dict):
        raise _schema_error(f"the JSON schema must be an object, got {json_type_name(schema)}.")
    try:
        text = orjson.dumps(schema)  # key order kept: it is the order properties are generated in
    except orjson.JSONEncodeError as err:  # nesting beyond what orjson writes (the body's parser allows more)
        raise _schema_error(f"the JSON schema cannot be used: {err}.") from None
    if len(text) > max_schema_bytes:
        raise APIError(400, f"Invalid 'response_format': the JSON schema is {len(text)} bytes; this server accepts "
                       f"at most {max_schema_bytes}.", param="response_format", code="schema_too_large")
    return text.decode()
