"""Reasoning ("thinking") models on chat completions: `chat_template_kwargs` reaches the chat template (the
prompt ids equal transformers' for the tiny Qwen3 thinking fixture, `enable_thinking` on and off), bad
ones are 400s; `frontend.reasoning`'s parser splits `<think>...</think>` from the answer for any split of
the output into pieces (prompt-opened span, no closing tag, thinking disabled, tool calls after the
thinking); and, through a real cluster (etcd, 1 prefill + 1 decode node, the frontend process), whole and
streamed responses carry `reasoning_content` apart from `content`, the streamed deltas join to the whole
response, and `usage.completion_tokens_details.reasoning_tokens` counts the thinking span's tokens.

A random tiny model never closes a thinking span on its own, so the cluster tests read its raw output from
a model entry that serves the same pool without a reasoning parser, and make `</think>` appear mid-way
with a logit_bias found once (the model is fixed, so the search is deterministic)."""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from transformers import AutoTokenizer

from pdserve.engine.tiny import default_model_dir
from pdserve.engine.tokenizer import Tokenizer
from pdserve.frontend.config import ConfigError, ModelSpec
from pdserve.frontend.errors import APIError
from pdserve.frontend.models import ModelCatalog, ServedModel
from pdserve.frontend.output import text_of
from pdserve.frontend.prepare import tokenize
from pdserve.frontend.protocol import parse_chat_request
from pdserve.frontend.reasoning import ReasoningFormatError, ReasoningParser, reasoning_format
from pdserve.frontend.render import Delta, usage_dict
from pdserve.frontend.tool_calls import message_of
from pdserve.registry.etcd_server import free_port
from testing.cluster import LocalCluster
from testing.openapi import OpenAPISchemas
from testing.procs import FrontendProc, start_frontend
from testing.recording import response_event_schema

pytestmark = pytest.mark.timeout(400)

USER = [{"role": "user", "content": "What is 2 + 2?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
# The generation prompt of newer Qwen3 (2507 thinking) and DeepSeek-R1 templates opens the span itself.
OPENED = ("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}")


@pytest.fixture(scope="module")
def thinking_dir() -> Path:
    return default_model_dir("qwen3", thinking=True)


@pytest.fixture(scope="module")
def opened_dir(thinking_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The thinking fixture with a template whose generation prompt ends in `<think>\\n`."""
    out = tmp_path_factory.mktemp("opened") / "model"
    shutil.copytree(thinking_dir, out)
    template = (out / "chat_template.jinja").read_text()
    assert template.count(OPENED[0]) == 1
    (out / "chat_template.jinja").write_text(template.replace(*OPENED))
    return out


def served(path: Path, setting: str = "auto") -> ServedModel:
    return ModelCatalog((ModelSpec("m", str(path), reasoning_parser=setting),)).resolve("m")


def api_error(fn: Callable[[], object]) -> APIError:
    with pytest.raises(APIError) as info:
        fn()
    return info.value


# --- chat_template_kwargs -------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": True}, {"enable_thinking": False}])
@pytest.mark.parametrize("tools", [None, [WEATHER]])
def test_prompt_ids_equal_transformers(thinking_dir: Path, kwargs: dict[str, Any] | None,
                                       tools: list[dict[str, Any]] | None) -> None:
    body: dict[str, Any] = {"model": "m", "messages": USER, "chat_template_kwargs": kwargs}
    if tools:
        body["tools"] = tools
    req = parse_chat_request(body)
    assert req.template_kwargs == kwargs
    ids = tokenize(req, served(thinking_dir)).prompts[0]
    hf = AutoTokenizer.from_pretrained(thinking_dir)
    expected = hf.apply_chat_template(USER, tools=tools, add_generation_prompt=True, tokenize=True,
                                      **(kwargs or {}))
    assert ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    text = Tokenizer(thinking_dir).decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" if kwargs == {"enable_thinking": False}
                         else "<|im_start|>assistant\n")


@pytest.mark.parametrize(("value", "code"), [
    ("enable_thinking", "invalid_type"),
    ([{"enable_thinking": False}], "invalid_type"),
    ({f"k{i}": i for i in range(33)}, "invalid_value"),
    ({"k": "x" * 9000}, "invalid_value"),
    ({"messages": []}, "invalid_value"),
    ({"tools": []}, "invalid_value"),
    ({"add_generation_prompt": False}, "invalid_value"),
    ({"enable_thinking": True, "bos_token": "<s>"}, "invalid_value"),
    ({"namespace": 1}, "invalid_value"),  # a jinja2 global the template calls
])
def test_bad_chat_template_kwargs_are_400s(value: Any, code: str) -> None:
    err = api_error(lambda: parse_chat_request({"model": "m", "messages": USER, "chat_template_kwargs": value}))
    assert (err.status, err.param, err.code) == (400, "chat_template_kwargs", code), err.message


def test_empty_chat_template_kwargs_are_none() -> None:
    for value in (None, {}):
        assert parse_chat_request({"model": "m", "messages": USER, "chat_template_kwargs": value}).template_kwargs is None


# --- which models split their output --------------------------------------------------------------


def test_the_reasoning_format_comes_from_the_setting_and_the_tokenizer(thinking_dir: Path, tiny_qwen3_dir: Path) -> None:
    fmt = served(thinking_dir).reasoning
    tok = Tokenizer(thinking_dir)
    assert fmt is not None and (fmt.style, fmt.start_id, fmt.end_id) == (
        "qwen3", tok.token_to_id("<think>"), tok.token_to_id("</think>"))
    assert served(thinking_dir, "deepseek_r1").reasoning.style == "deepseek_r1"  # type: ignore[union-attr]
    assert served(thinking_dir, "none").reasoning is None
    assert served(tiny_qwen3_dir).reasoning is None  # no <think> in the template nor the vocabulary
    with pytest.raises(ConfigError, match="needs <think> and </think>"):
        served(tiny_qwen3_dir, "qwen3")
    with pytest.raises(ConfigError, match="reasoning_parser must be one of"):
        ModelSpec("m", str(thinking_dir), reasoning_parser="o1")
    # special tags never reach the decoded text: not detected, and refused when asked for
    special = frozenset({tok.token_to_id("<think>")})
    assert reasoning_format("auto", tok.chat_template, tok.token_to_id, special) is None
    with pytest.raises(ReasoningFormatError):
        reasoning_format("qwen3", tok.chat_template, tok.token_to_id, special)


def test_the_prompt_says_where_the_output_starts(thinking_dir: Path, opened_dir: Path) -> None:
    for path, kwargs, phase in [(thinking_dir, None, "start"), (thinking_dir, {"enable_thinking": False}, "content"),
                                (opened_dir, None, "reasoning"), (opened_dir, {"enable_thinking": False}, "content")]:
        model = served(path)
        assert model.reasoning is not None
        ids = model.encode_chat(USER, None, kwargs)
        assert model.reasoning.first_phase(ids, text_of(model.texts)) == phase, (path, kwargs)
    # a <think> the user wrote is not the generation prompt's
    model = served(thinking_dir)
    assert model.reasoning is not None
    ids = model.encode_chat([{"role": "user", "content": "what does <think> mean"}])
    assert model.reasoning.first_phase(ids, text_of(model.texts)) == "start"


# --- the parser -----------------------------------------------------------------------------------

END = 7  # the `</think>` token id in these parser tests


def split(phase: str, pieces: list[str], implicit: bool = False) -> tuple[str, str]:
    parser = ReasoningParser(phase, END, implicit)  # type: ignore[arg-type]
    reasoning = content = ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


PARSER_CASES = [  # (first phase, deepseek_r1, output, reasoning, content)
    ("start", False, "<think>\nLet me add.\n2 + 2 = 4\n</think>\n\nIt is 4.", "Let me add.\n2 + 2 = 4", "It is 4."),
    ("start", False, "\n<think>a</think>b\n", "a", "b\n"),
    ("start", False, "It is 4, no <think> needed.", "", "It is 4, no <think> needed."),
    ("start", False, "\n\nIt is <thin", "", "\n\nIt is <thin"),
    ("start", False, "<thin", "", "<thin"),  # a tag begun and never finished is text
    ("start", False, "<think>\nstill thinking </thi", "still thinking </thi", ""),  # no closing tag
    ("start", False, "<think>x</think>\n\nanswer <think>y</think> more", "x", "answer <think>y</think> more"),
    ("reasoning", False, "Hmm, 2 + 2.\n\n</think>\n\n4", "Hmm, 2 + 2.", "4"),  # the prompt opened it
    ("reasoning", False, "\nthinking\nand thinking\n\n", "thinking\nand thinking\n\n", ""),  # never closed
    ("reasoning", False, "</think>4", "", "4"),
    ("content", False, "\n4 <think>a</think> b", "", "\n4 <think>a</think> b"),  # thinking disabled
    ("start", True, "reasoning without the tag</think>\n\nanswer", "reasoning without the tag", "answer"),
    ("start", True, "<think>\nr</think>a", "r", "a"),
    ("start", True, "never closed", "never closed", ""),
]


@pytest.mark.parametrize(("phase", "implicit", "output", "reasoning", "content"), PARSER_CASES)
def test_any_split_of_the_output_parses_the_same(phase: str, implicit: bool, output: str, reasoning: str,
                                                 content: str) -> None:
    assert split(phase, [output], implicit) == (reasoning, content)
    assert split(phase, list(output), implicit) == (reasoning, content)  # character by character
    for i, j in itertools.combinations(range(len(output) + 1), 2):  # tags cut at every position
        assert split(phase, [output[:i], output[i:j], output[j:]], implicit) == (reasoning, content), (i, j)


def test_text_is_held_back_only_while_it_may_be_a_tag() -> None:
    parser = ReasoningParser("reasoning", END)
    assert parser.feed("I think") == ("I think", "")
    assert parser.feed(" so</th") == (" so", "")
    assert parser.feed("ought") == ("</thought", "")
    assert parser.feed("\n") == ("", "")  # dropped if </think> comes next
    assert parser.feed("x") == ("\nx", "")
    assert parser.feed("</think>\n\nThe") == ("", "The")
    assert parser.feed(" end") == ("", " end")


def test_reasoning_tokens_count_the_span() -> None:
    parser = ReasoningParser("start", END)
    parser.feed("\n", [1])  # undecided: counted once the output says it thinks
    parser.feed("<think>", [2])
    parser.feed("a b", [3, 4])
    parser.feed("c</think>\n\nd", [5, END, 8])  # closes the span: its tokens up to </think>
    parser.feed(" e", [9])
    assert parser.reasoning_tokens == 6
    no_id = ReasoningParser("reasoning", END)
    no_id.feed("a</think>b", [3, 4, 5])  # the tag's text came without its token: the message counts
    assert no_id.reasoning_tokens == 3
    plain = ReasoningParser("start", END)
    plain.feed("\n", [1])
    plain.feed("Hi", [2])
    assert plain.reasoning_tokens == 0
    implicit = ReasoningParser("start", END, implicit=True)
    implicit.feed("<thi", [1])
    implicit.finish()
    assert implicit.reasoning_tokens == 1


def test_tool_calls_after_thinking_are_parsed_from_the_content_only() -> None:
    tools = parse_chat_request({"model": "m", "messages": USER, "tools": [WEATHER]}).tools
    assert tools is not None
    output = ('<think>\nI could write <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
              '</tool_call> but no.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", '
              '"arguments": {"city": "Paris"}}\n</tool_call>')
    for cut in range(0, len(output), 7):
        reasoning_parser, calls = ReasoningParser("start", END), tools.parser()
        assert calls is not None
        events, thought = [], ""
        for piece in (output[:cut], output[cut:]):
            r, c = reasoning_parser.feed(piece)
            thought += r
            events += calls.feed(c)
        r, c = reasoning_parser.finish()
        events += calls.feed(c) + calls.finish()
        said = message_of(events)
        assert thought + r == output[len("<think>\n"):output.index("\n</think>")]
        assert [json.loads(t["function"]["arguments"]) for t in said.tool_calls] == [{"city": "Paris"}]
        assert said.content == "Checking.\n"  # as the tool-call parser leaves it without thinking


def test_delta_and_usage_stay_backward_compatible() -> None:
    delta = Delta("hi", None, None, None)
    assert delta.reasoning == "" and delta == ("hi", None, None, None, "")
    assert "completion_tokens_details" not in usage_dict(3, 2, 0)
    assert usage_dict(3, 2, 0, 1)["completion_tokens_details"] == {"reasoning_tokens": 1}


# --- end to end through a cluster -----------------------------------------------------------------

POOL = "tiny-think"
NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "256", "--block-size", "16",
             "--model-name", POOL]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, thinking_dir: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("reasoning"), thinking_dir, node_args=NODE_ARGS) as c:
        c.start(1, 1)
        yield c
        c.wait_clean()


@pytest.fixture(scope="module")
def frontend(cluster: LocalCluster, thinking_dir: Path, opened_dir: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontendProc]:
    """Four names for the one pool: the two templates, each with and without the reasoning parser."""
    tmp = tmp_path_factory.mktemp("reasoning-fe")
    models = tmp / "models.yaml"
    models.write_text(yaml.safe_dump({"models": [
        {"name": "think", "path": str(thinking_dir), "pool": POOL},
        {"name": "think-open", "path": str(opened_dir), "pool": POOL},
        {"name": "raw", "path": str(thinking_dir), "pool": POOL, "reasoning_parser": "none"},
        {"name": "raw-open", "path": str(opened_dir), "pool": POOL, "reasoning_parser": "none"},
    ]}))
    fe = start_frontend("frontend", tmp, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                        "--models", str(models), "--log-level", "warning")
    try:
        yield fe
    finally:
        assert fe.stop() == 0, fe.proc.tail()
        assert "Traceback" not in fe.proc.log_text(), fe.proc.tail(80)


@pytest.fixture(scope="module")
def schemas() -> OpenAPISchemas:
    return OpenAPISchemas()


@pytest.fixture(scope="module")
def http(frontend: FrontendProc) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"{frontend.base_url}/v1", timeout=120) as client:
        yield client


def whole(http: httpx.Client, schemas: OpenAPISchemas, **body: Any) -> dict[str, Any]:
    body = {"messages": USER, "temperature": 0, "max_tokens": MAX_TOKENS, **body}
    resp = http.post("/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    schemas.validate("CreateChatCompletionResponse", out)
    return out


def streamed(http: httpx.Client, schemas: OpenAPISchemas, **body: Any) -> tuple[str, str, dict[str, Any]]:
    """(reasoning, content, usage) of a streamed request, its deltas joined."""
    body = {"messages": USER, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}, **body}
    reasoning = content = ""
    usage: dict[str, Any] = {}
    with http.stream("POST", "/chat/completions", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            schemas.validate("CreateChatCompletionStreamResponse", chunk)
            if chunk["usage"]:
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                reasoning += choice["delta"].get("reasoning_content") or ""
                content += choice["delta"].get("content") or ""
    return reasoning, content, usage


def check_both(http: httpx.Client, schemas: OpenAPISchemas, raw: dict[str, Any], phase: str,
               reasoning_tokens: int, **body: Any) -> tuple[str, str]:
    """The reasoning model's whole and streamed answers split the raw model's output as the parser does."""
    text = raw["choices"][0]["message"]["content"]
    reasoning, content = split(phase, [text])
    out = whole(http, schemas, **body)
    message = out["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (reasoning or None, content)
    assert out["choices"][0]["finish_reason"] == raw["choices"][0]["finish_reason"]
    assert out["usage"]["completion_tokens"] == raw["usage"]["completion_tokens"]
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}
    assert "completion_tokens_details" not in raw["usage"]
    got_reasoning, got_content, usage = streamed(http, schemas, **body)
    assert (got_reasoning, got_content) == (reasoning, content)
    assert usage["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}
    assert usage["completion_tokens"] == out["usage"]["completion_tokens"]
    return reasoning, content


def test_a_prompt_opened_span_without_an_end_is_all_reasoning(http: httpx.Client, schemas: OpenAPISchemas) -> None:
    raw = whole(http, schemas, model="raw-open")
    assert "reasoning_content" not in raw["choices"][0]["message"]
    assert "</think>" not in raw["choices"][0]["message"]["content"]
    n = raw["usage"]["completion_tokens"]
    reasoning, content = check_both(http, schemas, raw, "reasoning", n, model="think-open")
    assert reasoning and content == ""


def test_thinking_disabled_is_all_content(http: httpx.Client, schemas: OpenAPISchemas) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    raw = whole(http, schemas, model="raw", **off)
    reasoning, content = check_both(http, schemas, raw, "content", 0, model="think", **off)
    assert reasoning == "" and content == raw["choices"][0]["message"]["content"]
    # the kwargs reach the template: another prompt, so (for this model) other prompt tokens
    assert whole(http, schemas, model="raw")["usage"]["prompt_tokens"] < raw["usage"]["prompt_tokens"]


def closed_mid_way(http: httpx.Client, schemas: OpenAPISchemas, thinking_dir: Path) -> tuple[dict[str, Any],
                                                                                             dict[str, Any], int]:
    """(body, the raw model's answer, tokens in the span) for the weakest `</think>` bias that makes greedy
    decoding close the span mid-way."""
    end = Tokenizer(thinking_dir).token_to_id("</think>")
    for bias in range(1, 41):
        body = {"logit_bias": {str(end): bias}, "logprobs": True}
        raw = whole(http, schemas, model="raw-open", **body)
        tokens = [t["token"] for t in raw["choices"][0]["logprobs"]["content"]]
        if "</think>" in tokens and 1 <= tokens.index("</think>") <= len(tokens) - 2:
            return body, raw, tokens.index("</think>") + 1
    raise AssertionError("no bias in 1..40 closes the span mid-way")


def test_a_span_closed_mid_way_splits_reasoning_from_content(http: httpx.Client, schemas: OpenAPISchemas,
                                                             thinking_dir: Path) -> None:
    body, raw, in_span = closed_mid_way(http, schemas, thinking_dir)
    reasoning, content = check_both(http, schemas, raw, "reasoning", in_span, model="think-open", **body)
    assert reasoning and content
    # logprobs still cover every token, thinking included
    out = whole(http, schemas, model="think-open", **body)
    assert out["choices"][0]["logprobs"] == raw["choices"][0]["logprobs"]


def test_bad_chat_template_kwargs_over_http_are_400s(http: httpx.Client) -> None:
    for value in ("yes", {"messages": []}):
        resp = http.post("/chat/completions", json={"model": "think", "messages": USER, "chat_template_kwargs": value})
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "chat_template_kwargs"


def responses_events(http: httpx.Client, schemas: OpenAPISchemas, **body: Any) -> list[dict[str, Any]]:
    events = []
    with http.stream("POST", "/responses", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                assert schemas.errors(response_event_schema(schemas, event), event) == [], event
                events.append(event)
    return events


def test_responses_return_the_thinking_as_a_reasoning_item(http: httpx.Client, schemas: OpenAPISchemas,
                                                           thinking_dir: Path) -> None:
    body, _, in_span = closed_mid_way(http, schemas, thinking_dir)
    chat = whole(http, schemas, model="think-open", **body)["choices"][0]["message"]
    ask = {"model": "think-open", "input": USER[0]["content"], "temperature": 0, "max_output_tokens": MAX_TOKENS,
           "logit_bias": body["logit_bias"], "store": False}
    resp = http.post("/responses", json=ask)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert schemas.errors("Response", out) == []
    kinds = [item["type"] for item in out["output"]]
    assert kinds == ["reasoning", "message"], out["output"]
    assert out["output"][0]["content"][0]["text"] == chat["reasoning_content"]
    assert out["output"][1]["content"][0]["text"] == chat["content"]
    assert out["usage"]["output_tokens_details"]["reasoning_tokens"] == in_span
    events = responses_events(http, schemas, **ask)
    joined = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (joined, text) == (chat["reasoning_content"], chat["content"])
    assert events[-1]["response"]["output"][0]["content"] == out["output"][0]["content"]


def test_reasoning_effort_switches_thinking(http: httpx.Client, schemas: OpenAPISchemas) -> None:
    off = whole(http, schemas, model="think", chat_template_kwargs={"enable_thinking": False})
    resp = http.post("/responses", json={"model": "think", "input": USER[0]["content"], "temperature": 0,
                                         "max_output_tokens": MAX_TOKENS, "reasoning": {"effort": "none"},
                                         "store": False})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["usage"]["input_tokens"] == off["usage"]["prompt_tokens"]
    assert [i["type"] for i in out["output"]] == ["message"]
    assert out["output"][0]["content"][0]["text"] == off["choices"][0]["message"]["content"]
    bad = http.post("/responses", json={"model": "raw", "input": "hi", "reasoning": {"effort": "high"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning.effort"
