"""The real default model (SmolLM2-135M-Instruct, imported from its GGUF) served by a real cluster: etcd,
1 prefill + 1 decode node process, the frontend, and the official openai SDK.

8 concurrent chat requests, then the same 8 streamed, all prefilled on the prefill node and decoded on the
decode node (the KV blocks cross the gloo channel); every answer equals transformers' greedy text for the
same chat template. Structured output and tools on the same cluster: `chat.completions.parse` with a
pydantic model for 8 prompts, `json_object`, and a two-turn tool-calling exchange, whole and streamed.
Every body and chunk validates against the vendored OpenAPI spec, and every KV block on both nodes is
free afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from pdserve.registry.etcd_server import free_port
from testing.cluster import LocalCluster
from testing.openapi import OpenAPISchemas
from testing.procs import FrontendProc, start_frontend
from testing.recording import RecordingTransport, conformance_problems

pytest_plugins = ["tests.gguf_fixtures"]  # smollm2_dir
pytestmark = pytest.mark.timeout(900)

NAME = "SmolLM2-135M-Instruct"
MAX_TOKENS = 40
PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the ocean.",
    "What is 12 times 12?",
    "Give me one tip for learning to code.",
    "Translate 'good morning' into Spanish.",
    "What does a CPU do?",
    "Describe a cat in one sentence.",
)


@dataclass(eq=False)
class Env:
    cluster: LocalCluster
    frontend: FrontendProc
    expected: list[str]
    transports: list[RecordingTransport]

    def client(self) -> openai.OpenAI:
        transport = RecordingTransport()
        self.transports.append(transport)
        return openai.OpenAI(base_url=f"{self.frontend.base_url}/v1", api_key="sk-test", max_retries=0,
                             http_client=httpx.Client(transport=transport, timeout=300))


def transformers_greedy(model_dir: Path) -> list[str]:
    """transformers' greedy answers (fp32) to PROMPTS under the model's chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = []
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        x = torch.tensor([list(ids)])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS, do_sample=False)
        texts.append(tok.decode(out[0, x.shape[1]:].tolist(), skip_special_tokens=True))
    return texts


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("real-cluster")
    expected = transformers_greedy(smollm2_dir)
    node_args = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "256", "--model-name", NAME]
    with LocalCluster(tmp / "cluster", smollm2_dir, node_args=node_args) as cluster:
        # Threshold 0: every prompt is prefilled on the prefill node and its KV blocks shipped.
        cluster.start(1, 1, decode_args=["--local-prefill-threshold", "0"])
        fe = start_frontend("frontend", tmp, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                            "--model", f"{NAME}={smollm2_dir}", "--log-level", "warning")
        try:
            yield Env(cluster, fe, expected, [])
            cluster.wait_clean()  # every KV block on both nodes is accounted for
        finally:
            assert fe.stop() == 0, fe.proc.tail()
            assert "Traceback" not in fe.proc.log_text(), fe.proc.tail(80)


def _ask(env: Env, prompt: str, stream: bool) -> tuple[str, str | None]:
    client = env.client()
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    parts, finish = [], None
    for chunk in client.chat.completions.create(model=NAME, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(parts), finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_eight_concurrent_chats_equal_transformers(env: Env, stream: bool) -> None:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: _ask(env, p, stream), PROMPTS))
    for prompt, (text, finish), want in zip(PROMPTS, answers, env.expected, strict=True):
        assert text == want, f"{prompt!r}: got {text!r}, transformers says {want!r}"
        assert finish in ("stop", "length")
    assert answers[0][0] == "The capital of France is Paris."
    loads = env.cluster.wait_clean()
    assert all(load.kv_blocks_used == 0 and load.in_flight == 0 for load in loads.values()), loads



class Answer(BaseModel):
    answer: str = Field(min_length=1, max_length=40)
    confidence: Literal["low", "medium", "high"]


def test_parse_returns_a_pydantic_object_for_eight_prompts(env: Env) -> None:
    def parse(prompt: str) -> tuple[Answer | None, str]:
        r = env.client().chat.completions.parse(model=NAME, messages=[{"role": "user", "content": prompt}],
                                                response_format=Answer, temperature=0, max_tokens=100)
        return r.choices[0].message.parsed, r.choices[0].finish_reason

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(parse, PROMPTS))
    for prompt, (parsed, finish) in zip(PROMPTS, answers, strict=True):
        assert finish == "stop" and isinstance(parsed, Answer), (prompt, parsed, finish)
        assert 0 < len(parsed.answer) <= 40


def test_json_object_output_parses(env: Env) -> None:
    r = env.client().chat.completions.create(
        model=NAME, temperature=0, max_tokens=60, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give Alice's name and age (30) as JSON."}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                      "parameters": WEATHER_PARAMETERS}}]
QUESTION = {"role": "user", "content": "What's the weather like in Paris today?"}


def _streamed_message(stream: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """Content, tool calls and finish_reason a client assembles from the chunks of one choice."""
    content, calls, finish = [], [], None
    for chunk in stream:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for part in choice.delta.tool_calls or []:
                if part.index == len(calls):  # a call's first chunk: id, type and name
                    assert part.id and part.type == "function" and part.function and part.function.name
                    calls.append({"id": part.id, "type": "function",
                                  "function": {"name": part.function.name, "arguments": ""}})
                calls[part.index]["function"]["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
    return "".join(content), calls, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_two_turn_tool_calling_exchange(env: Env, stream: bool, tool_choice: Any) -> None:
    client = env.client()
    first = dict(model=NAME, messages=[QUESTION], tools=TOOLS, tool_choice=tool_choice, temperature=0,
                 max_tokens=60)
    if stream:
        content, calls, finish = _streamed_message(client.chat.completions.create(**first, stream=True))
    else:
        msg = client.chat.completions.create(**first).choices[0]
        content, finish = msg.message.content or "", msg.finish_reason
        calls = [c.model_dump() for c in msg.message.tool_calls or []]
    assert finish == "tool_calls" and content == ""
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    arguments = json.loads(calls[0]["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER_PARAMETERS)
    assert arguments["city"] == "Paris"
    # the client runs the function and answers with a tool message; the model replies in text
    messages = [QUESTION, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temperature": 18, "sky": "sunny"}'}]
    second = dict(model=NAME, messages=messages, tools=TOOLS, temperature=0, max_tokens=40)
    if stream:
        content, calls, finish = _streamed_message(client.chat.completions.create(**second, stream=True))
    else:
        msg = client.chat.completions.create(**second).choices[0]
        content, finish, calls = msg.message.content or "", msg.finish_reason, msg.message.tool_calls or []
    assert content and not calls and finish in ("stop", "length"), (content, calls, finish)


def test_models_list_and_spec_conformance(env: Env) -> None:
    models = env.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    records = [rec for t in env.transports for rec in t.records]
    checked, problems = conformance_problems(OpenAPISchemas(), records)
    assert problems == [], "\n".join(problems[:20])
    assert checked >= len(records) > 0
