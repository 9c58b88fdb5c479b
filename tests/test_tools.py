"""Tool calling and `suffix` in the frontend, on their own: validating `tools`/`tool_choice` and tool
messages, the constraint each choice decodes under (its grammar checked by llguidance against example
outputs), the prompt a template with and without tool support renders, and the incremental parsers (any
split of the output gives the same calls as the whole); fill-in-the-middle prompts for `suffix`."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.structured import GrammarCompiler
from pdserve.engine.structured_spec import GrammarError, StructuredSpec
from pdserve.engine.tokenizer import Tokenizer
from pdserve.frontend.config import ModelSpec
from pdserve.frontend.errors import APIError
from pdserve.frontend.models import ModelCatalog, ServedModel
from pdserve.frontend.prepare import tokenize
from pdserve.frontend.protocol import RequestLimits, parse_chat_request, parse_completion_request
from pdserve.frontend.render import StreamEncoder
from pdserve.frontend.tool_calls import (
    ArrayCallParser,
    NamedCallParser,
    TaggedCallParser,
    ToolCallParser,
    ToolEvent,
    message_of,
)
from pdserve.frontend.tools import template_input
from testing.openapi import OpenAPISchemas

pytestmark = pytest.mark.timeout(60)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "weather in Paris?"}], **fields}


def api_error(fn: Callable[[], object]) -> APIError:
    with pytest.raises(APIError) as info:
        fn()
    return info.value


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param", "code"), [
    (chat(tools={"type": "function"}), "tools", "invalid_type"),
    (chat(tools=["f"]), "tools[0]", "invalid_type"),
    (chat(tools=[{"function": {"name": "f"}}]), "tools[0].type", "missing_required_parameter"),
    (chat(tools=[{"type": "web_search"}]), "tools[0].type", "invalid_value"),
    (chat(tools=[{"type": "function"}]), "tools[0].function", "missing_required_parameter"),
    (chat(tools=[{"type": "function", "function": {}}]), "tools[0].function.name", "missing_required_parameter"),
    (chat(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name", "invalid_value"),
    (chat(tools=[{"type": "function", "function": {"name": "x" * 65}}]), "tools[0].function.name", "invalid_value"),
    (chat(tools=[WEATHER, WEATHER]), "tools[1].function.name", "invalid_value"),
    (chat(tools=[NOW] * 129), "tools", "invalid_value"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "description": 5}}]),
     "tools[0].function.description", "invalid_type"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
     "tools[0].function.parameters", "invalid_function_parameters"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "if": {}, "then": {}}}}]), "tools[0].function.parameters", "invalid_function_parameters"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "(?=a)"}}}}}]),
     "tools[0].function.parameters", "invalid_function_parameters"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(100)}}}}]),
     "tools[0].function.parameters", "schema_too_large"),
    (chat(tool_choice="auto"), "tool_choice", "invalid_value"),
    (chat(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", "invalid_value"),
    (chat(tools=[WEATHER], tool_choice=5), "tool_choice", "invalid_type"),
    (chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}),
     "tool_choice.function.name", "invalid_value"),
    (chat(tools=[WEATHER], parallel_tool_calls="no"), "parallel_tool_calls", "invalid_type"),
    (chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
     "response_format", "invalid_value"),
    (chat(functions=[{"name": "f"}]), "functions", "unsupported_parameter"),
    (chat(messages=[{"role": "tool", "content": "18C"}]), "messages[0].tool_call_id", "missing_required_parameter"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}]),
     "messages[0].tool_calls[0].function.arguments", "invalid_type"),
    (chat(messages=[{"role": "assistant", "tool_calls": {"id": "c"}}]), "messages[0].tool_calls", "invalid_type"),
])
def test_bad_tools_are_400s_naming_the_field(body: dict[str, Any], param: str, code: str) -> None:
    err = api_error(lambda: parse_chat_request(body, RequestLimits(max_schema_bytes=1024)))
    assert err.status == 400 and (err.param, err.code) == (param, code), err.message


@pytest.fixture(scope="module")
def accepts(tiny_qwen2_dir: Path) -> Callable[[StructuredSpec, str], bool]:
    """Whether the engine's grammar for a spec accepts a text as a whole output."""
    tok = Tokenizer(tiny_qwen2_dir)
    grammars = GrammarCompiler(tok, tok.vocab_size)

    def check(spec: StructuredSpec, text: str) -> bool:
        try:
            state = grammars.new_state(spec, tok.encode(text, add_special_tokens=False))
        except GrammarError:
            return False
        return bool(state.matcher.is_accepting())
    return check


def test_each_tool_choice_decodes_under_its_constraint(accepts: Callable[[StructuredSpec, str], bool]) -> None:
    none = parse_chat_request(chat(tools=[WEATHER], tool_choice="none"))
    assert none.tools is not None and not none.tools.shown and none.sampling.structured is None
    assert none.tools.parser() is None
    auto = parse_chat_request(chat(tools=[WEATHER, TIME]))
    assert auto.tools is not None and auto.tools.mode == "auto" and auto.sampling.structured is None

    named = parse_chat_request(chat(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                        "function": {"name": "get_weather"}}))
    spec = named.sampling.structured
    assert spec is not None and json.loads(spec.schema_json) == WEATHER["function"]["parameters"]

    required = parse_chat_request(chat(tools=[WEATHER, TIME, NOW], tool_choice="required"))
    spec = required.sampling.structured
    assert spec is not None
    one = '[{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}]'
    two = one[:-1] + ',{"name":"now","arguments":{}}]'
    assert accepts(spec, one) and accepts(spec, two)
    assert not accepts(spec, "[]")  # at least one call
    assert not accepts(spec, '[{"name":"get_weather","arguments":{"city":"Paris"}}]')  # unit missing
    assert not accepts(spec, '[{"name":"launch","arguments":{}}]')  # no such tool
    single = parse_chat_request(chat(tools=[WEATHER, TIME, NOW], tool_choice="required", parallel_tool_calls=False))
    assert single.sampling.structured is not None
    assert accepts(single.sampling.structured, one)
    assert not accepts(single.sampling.structured, two)


# --- the prompt -----------------------------------------------------------------------------------

NATIVE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments.city }}</tool_call>"
    "{%- endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TURNS = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"time": "12:00"}'},
]


@pytest.fixture(scope="module")
def native_model(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    """The tiny qwen2 model's tokenizer with a template that renders tools itself."""
    root = tmp_path_factory.mktemp("native-tools")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_qwen2_dir / name, root / name)
    (root / "chat_template.jinja").write_text(NATIVE_TEMPLATE)
    return ModelCatalog((ModelSpec(name="m", path=str(root)),)).resolve("m")


@pytest.fixture(scope="module")
def plain_model(tiny_qwen2_dir: Path) -> ServedModel:
    return ModelCatalog((ModelSpec(name="m", path=str(tiny_qwen2_dir)),)).resolve("m")


def _prompt(model: ServedModel, body: dict[str, Any]) -> str:
    req = parse_chat_request(body)
    return model.tokenizer.decode(tokenize(req, model).prompts[0], skip_special_tokens=False)


def test_a_template_that_renders_tools_gets_them_and_the_calls_arguments_as_a_mapping(
        native_model: ServedModel) -> None:
    assert native_model.tokenizer.renders_tools
    text = _prompt(native_model, chat(messages=TURNS, tools=[WEATHER, TIME]))
    assert '"name": "get_weather"' in text and '"name": "get_time"' in text
    assert "<tool_call>get_weather Paris</tool_call>" in text  # arguments reached the template as a dict
    assert "<|im_start|>tool\n{\"temp\": 18}" in text
    # tool_choice none: the template is not given the tools
    assert "get_time" not in _prompt(native_model, chat(tools=[WEATHER, TIME], tool_choice="none"))


def test_a_template_without_tool_support_gets_them_in_the_system_message(plain_model: ServedModel) -> None:
    assert not plain_model.tokenizer.renders_tools
    body = chat(messages=[{"role": "system", "content": "Be brief."}, *TURNS], tools=[WEATHER])
    text = _prompt(plain_model, body)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n") and '"name": "get_weather"' in system
    # the earlier call written as the tool prompt asks, the two results as one user turn
    assert ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]</tool_call>'
            in text)
    assert ('<|im_start|>user\n<tool_response>{"temp": 18}</tool_response>\n'
            '<tool_response>{"time": "12:00"}</tool_response><|im_end|>' in text)
    # without tools in the request nothing is added
    messages, kwargs = template_input([{"role": "user", "content": "hi"}], None, False)
    assert messages == [{"role": "user", "content": "hi"}] and kwargs == {}


# --- the output -----------------------------------------------------------------------------------


def _split_feed(parser: ToolCallParser, text: str, rng: random.Random) -> list[ToolEvent]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    events: list[ToolEvent] = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        events += parser.feed(text[a:b])
    return events + parser.finish()


def _calls(events: list[ToolEvent]) -> tuple[str | None, list[tuple[str, Any]]]:
    msg = message_of(events)
    return msg.content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.tool_calls]


def _written(events: list[ToolEvent]) -> tuple[str | None, list[tuple[str, str]]]:
    """The message's content and each call's name and arguments text as written (not parsed)."""
    msg = message_of(events)
    return msg.content, [(c["function"]["name"], c["function"]["arguments"]) for c in msg.tool_calls]


@pytest.mark.parametrize(("make", "text", "want"), [
    (lambda: NamedCallParser("get_weather"), '{"city":"Pa\\"ris}","unit":"celsius"}',
     (None, [("get_weather", {"city": 'Pa"ris}', "unit": "celsius"})])),
    (ArrayCallParser, '[{"name":"get_weather","arguments":{"city":"[Oslo]","unit":"celsius"}},'
     '{"name":"now","arguments":{}}]',
     (None, [("get_weather", {"city": "[Oslo]", "unit": "celsius"}), ("now", {})])),
    (ArrayCallParser, '[{"name": "get_time", "arguments": {"city": "Oslo"}}, {"name": "now", "arguments":  {}}]',
     (None, [("get_time", {"city": "Oslo"}), ("now", {})])),
    (TaggedCallParser, 'Let me check. <tool_call>{"name": "get_time", "arguments": {"city": "Oslo"}}</tool_call>',
     ("Let me check. ", [("get_time", {"city": "Oslo"})])),
    (TaggedCallParser, '<tool_call>[{"name": "get_time", "arguments": {"city": "Oslo"}}, '
     '{"name": "now", "arguments": {}}]</tool_call>', (None, [("get_time", {"city": "Oslo"}), ("now", {})])),
    (TaggedCallParser, '<tool_call>{"name": "now", "arguments": {}}', (None, [("now", {})])),  # stopped unclosed
    (TaggedCallParser, "a < b and <tool_call>not json</tool_call> <tool_",
     ("a < b and <tool_call>not json</tool_call> <tool_", [])),
    (TaggedCallParser, "It is sunny in Paris.", ("It is sunny in Paris.", [])),
], ids=["named", "required", "required-spaced", "auto-object", "auto-array", "auto-unclosed", "auto-not-calls", "auto-text"])
def test_parsers_give_the_same_calls_for_any_split_of_the_output(
        make: Callable[[], ToolCallParser], text: str, want: tuple[str | None, list[tuple[str, Any]]]) -> None:
    whole = make()
    events = whole.feed(text) + whole.finish()
    assert _calls(events) == want
    rng = random.Random(7)
    for _ in range(40):
        split = _split_feed(make(), text, rng)
        assert _calls(split) == want
        assert _written(split) == _written(events)  # the same text, not only the same values


def test_required_arguments_stream_before_the_call_ends() -> None:
    p = ArrayCallParser()
    assert p.feed('[{"name":"get_wea') == []
    start = p.feed('ther","arguments":{"ci')
    assert [e.kind for e in start] == ["call", "arguments"] and start[0].name == "get_weather"
    assert start[1].text == '{"ci'
    assert [e.text for e in p.feed('ty":"Oslo"}}')] == ['ty":"Oslo"}']
    assert p.feed("]") == [] and p.finish() == []
    cut = ArrayCallParser()  # finish_reason length before the first name was complete
    assert cut.feed('[{"name":"get') == [] and message_of(cut.finish()).content == '[{"name":"get'


def test_tool_call_chunks_validate_against_the_openapi_spec() -> None:
    schemas = OpenAPISchemas()
    enc = StreamEncoder("chat", "chatcmpl-1", 1, "m", "fp_x", include_usage=False)
    p = ArrayCallParser()
    events = p.feed('[{"name":"get_weather","arguments":{"city":"Oslo","unit":"celsius"}}]') + p.finish()
    for e in events:
        chunk = json.loads(enc.tool_event(0, e)[len(b"data: "):])
        assert schemas.errors("CreateChatCompletionStreamResponse", chunk) == [], chunk


# --- suffix ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fim_model(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    """The tiny qwen2 tokenizer with Qwen's fill-in-the-middle tokens added."""
    root = tmp_path_factory.mktemp("fim")
    for name in ("chat_template.jinja", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_qwen2_dir / name, root / name)
    tok = json.loads((tiny_qwen2_dir / "tokenizer.json").read_text())
    next_id = max(a["id"] for a in tok["added_tokens"]) + 1 + len(tok["model"]["vocab"])
    for i, name in enumerate(("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>")):
        tok["added_tokens"].append({"id": next_id + i, "content": name, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
    (root / "tokenizer.json").write_text(json.dumps(tok))
    return ModelCatalog((ModelSpec(name="m", path=str(root), max_context=512),)).resolve("m")


def test_suffix_builds_a_prefix_suffix_middle_prompt(fim_model: ServedModel) -> None:
    tok = fim_model.tokenizer
    pre, mid, suf = (tok.token_to_id(n) for n in ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"))
    req = parse_completion_request({"model": "m", "prompt": ["def add(a, b):\n", [5, 6]], "suffix": "\n# done"})
    got = tokenize(req, fim_model).prompts
    tail = [suf, *tok.encode("\n# done", add_special_tokens=False), mid]
    assert got[0] == [pre, *tok.encode("def add(a, b):\n"), *tail]
    assert got[1] == [pre, 5, 6, *tail]
    # an empty suffix is no suffix
    plain = parse_completion_request({"model": "m", "prompt": "x", "suffix": ""})
    assert tokenize(plain, fim_model).prompts == [tok.encode("x")]


def test_suffix_on_a_model_that_cannot_insert_is_a_400(plain_model: ServedModel) -> None:
    req = parse_completion_request({"model": "m", "prompt": "x", "suffix": "y"})
    err = api_error(lambda: tokenize(req, plain_model))
    assert (err.status, err.param, err.code) == (400, "suffix", "unsupported_parameter")
    assert "fill-in-the-middle" in err.message
    bad = api_error(lambda: parse_completion_request({"model": "m", "prompt": "x", "suffix": 5}))
    assert (bad.param, bad.code) == ("suffix", "invalid_type")
