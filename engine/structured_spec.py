"""What a request's structured output must be (`StructuredSpec`) and the llguidance grammar for it.

Imports no torch: the frontend checks a request's schema with `check_spec` before any node sees it, so a
grammar that cannot compile is a 400 at the door instead of an error from a node.

Why llguidance rather than xgrammar: llguidance computes each step's token mask on the fly from a
lexer and an Earley parser walking a token trie, with no ahead-of-time compilation of per-state masks,
so a schema seen for the first time starts at once (clients send one-off schemas as often as repeated
ones); its JSON-schema compiler refuses keywords it does not implement with a message naming them
instead of silently dropping the constraint, which is what a 400 should say; and it builds its tokenizer
from a `tokenizer.json` string alone, which is what `engine.tokenizer` loads. xgrammar precompiles
masks per grammar (a cache miss is paid on the request's first token) and builds its tokenizer
information from a transformers tokenizer object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import llguidance

StructuredKind = Literal["json_object", "json_schema"]
KINDS: tuple[str, ...] = ("json_object", "json_schema")

# Compact JSON (no whitespace between tokens, "," and ":" as separators): a model, tiny random ones
# above all, can otherwise keep choosing whitespace forever, and compact output is what clients parse
# anyway. Unsupported schema keywords are errors (lenient False), never silently dropped constraints.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "lenient": False}
# "any JSON object": what response_format {"type": "json_object"} asks for.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarError(ValueError):
    """A structured-output spec whose grammar cannot be built (bad JSON, unsupported schema keyword,
    unresolvable reference, ...); the message names the problem."""


@dataclass(frozen=True)
class StructuredSpec:
    """A request's structured-output constraint: any JSON object, or JSON matching `schema_json`.
    Plain data (hashable: the engine caches compiled grammars by it)."""

    kind: StructuredKind
    schema_json: str = ""  # json_schema: the schema, serialized; json_object: empty

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {list(KINDS)}, got {self.kind!r}")
        if self.kind == "json_schema" and not self.schema_json:
            raise ValueError("a json_schema structured output needs a schema")
        if self.kind == "json_object" and self.schema_json:
            raise ValueError("a json_object structured output takes no schema")


def grammar_of(spec: StructuredSpec) -> str:
    """The llguidance grammar (serialized) of `spec`; not yet checked beyond the schema being a JSON
    object. Raises GrammarError. Changes nothing."""
    schema = JSON_OBJECT_SCHEMA if spec.kind == "json_object" else spec.schema_json
    if not schema.lstrip().startswith("{"):
        raise GrammarError("the JSON schema must be a JSON object")
    try:
        # parsed by llguidance itself (serde_json, nesting bounded at 128 levels), never by Python's json,
        # whose recursion on a deeply nested schema would raise RecursionError instead of a clean error
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as err:
        raise GrammarError(f"the JSON schema cannot be read: {err}") from None


def check_spec(spec: StructuredSpec) -> None:
    """Compiles `spec`'s grammar without a tokenizer and raises GrammarError naming the first problem
    (unsupported keyword, bad regex pattern, unresolvable $ref, ...). Changes nothing."""
    problem = llguidance.LLMatcher.validate_grammar(grammar_of(spec))
    if problem:
        raise GrammarError(f"the JSON schema is not supported: {problem}")
