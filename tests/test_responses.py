"""The Responses API (/v1/responses) on a real cluster: etcd, 1 prefill + 1 decode node process running the
default model (SmolLM2-135M-Instruct), frontends storing responses in SQLite and in a real PostgreSQL,
the official openai SDK and the OpenAI Agents SDK.

Create (string input, items, instructions), stream (every event type, in order, the assembled text equal
to the final response's), parse into a pydantic model, a function-tool round trip continued with
previous_response_id, retrieve / delete / input_items, background responses polled and cancelled; every
body and event validated against the vendored OpenAPI spec; greedy text equal to chat completions'; the
stored conversation across a frontend restart and from a second frontend on the shared PostgreSQL store;
tenant isolation, expiry, the store down (503 for responses, chat completions unaffected); hostile input.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from pydantic import BaseModel, Field

from pdserve.frontend.tenants import hash_key
from pdserve.registry.etcd_server import free_port
from testing.cluster import LocalCluster
from testing.openapi import OpenAPISchemas
from testing.postgres import PostgresServer, postgres_server  # noqa: F401 - the fixture
from testing.procs import FrontendProc, start_frontend
from testing.recording import RecordingTransport, conformance_problems

pytest_plugins = ["tests.gguf_fixtures"]  # smollm2_dir
pytestmark = pytest.mark.timeout(900)

NAME = "SmolLM2-135M-Instruct"
KEYS = {"alpha": "sk-alpha-responses-0123456789", "beta": "sk-beta-responses-0123456789",
        "small": "sk-small-responses-0123456789"}  # small: a 160-token context
STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                 "response.content_part.done", "response.output_item.done", "response.completed"]


@dataclass(eq=False)
class Env:
    cluster: LocalCluster
    tmp: Path
    model_dir: Path
    tenants: Path
    pg: PostgresServer
    pg_dsn: str
    frontend: FrontendProc  # SQLite store
    shared: list[FrontendProc]  # two frontends on the PostgreSQL store
    transports: list[RecordingTransport]
    schemas: OpenAPISchemas

    def client(self, tenant: str = "alpha", fe: FrontendProc | None = None) -> openai.OpenAI:
        transport = RecordingTransport()
        self.transports.append(transport)
        fe = fe or self.frontend
        return openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key=KEYS[tenant], max_retries=0,
                             http_client=httpx.Client(transport=transport, timeout=300))

    def start_frontend(self, name: str, store: str, *extra: str) -> FrontendProc:
        return start_frontend(name, self.tmp, self.cluster.etcd_endpoints, free_port(), "--cluster",
                              self.cluster.cluster, "--model", f"{NAME}={self.model_dir}", "--tenants",
                              str(self.tenants), "--response-store", store, "--log-level", "warning", *extra)


def _stop(fe: FrontendProc) -> None:
    assert fe.stop() == 0, fe.proc.tail()
    assert "Traceback" not in fe.proc.log_text(), fe.proc.tail(80)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path, postgres_server: PostgresServer) -> Iterator[Env]:  # noqa: F811
    tmp = tmp_path_factory.mktemp("responses")
    tenants = tmp / "tenants.yaml"
    tenants.write_bytes(orjson.dumps({"tenants": [
        {"name": n, "keys_sha256": [hash_key(k)], **({"max_context_tokens": 160} if n == "small" else {})}
        for n, k in KEYS.items()]}))
    node_args = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "256", "--model-name", NAME]
    dsn = postgres_server.dsn(postgres_server.create_database("responses"))
    with LocalCluster(tmp / "cluster", smollm2_dir, node_args=node_args) as cluster:
        cluster.start(1, 1, decode_args=["--local-prefill-threshold", "0"])
        e = Env(cluster, tmp, smollm2_dir, tenants, postgres_server, dsn, None, [], [], OpenAPISchemas())  # type: ignore[arg-type]
        e.frontend = e.start_frontend("frontend-sqlite", f"sqlite:///{tmp / 'responses.db'}")
        try:
            yield e
            cluster.wait_clean()  # every KV block on both nodes is accounted for
            checked, problems = conformance_problems(e.schemas, [r for t in e.transports for r in t.records])
            assert not problems, problems[:10]
            assert checked > 0
        finally:
            for fe in [e.frontend, *e.shared]:
                if fe.proc.popen.poll() is None:
                    _stop(fe)


@pytest.fixture(autouse=True)
def _integrity(env: Env) -> Iterator[None]:
    yield
    env.cluster.check_integrity()


def _chat_text(env: Env, messages: list[dict[str, Any]], max_tokens: int) -> str:
    r = env.client().chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content or ""


# --- create ----------------------------------------------------------------------------------------


def test_string_input_equals_chat_completions(env: Env) -> None:
    client = env.client()
    r = client.responses.create(model=NAME, input="What is the capital of France?", max_output_tokens=24,
                                temperature=0)
    assert r.status in ("completed", "incomplete") and r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == _chat_text(env, [{"role": "user", "content": "What is the capital of France?"}], 24)
    assert r.output_text.startswith("The capital of France is Paris")
    assert r.usage is not None and r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_items_and_instructions_equal_chat_completions(env: Env) -> None:
    client = env.client()
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
             {"role": "user", "content": "Name another one."}]
    r = client.responses.create(model=NAME, input=items, instructions="You answer in one word.",
                                max_output_tokens=16, temperature=0)
    chat = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Name another one."}]
    assert r.output_text == _chat_text(env, chat, 16)
    assert r.instructions == "You answer in one word."


def test_max_output_tokens_makes_it_incomplete(env: Env) -> None:
    r = env.client().responses.create(model=NAME, input="Write a long story about the sea.", max_output_tokens=4,
                                      temperature=0)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens" and r.usage is not None and r.usage.output_tokens == 4


def test_stream_sends_every_event_in_order(env: Env) -> None:
    client = env.client()
    seen: list[str] = []
    deltas: list[str] = []
    with client.responses.stream(model=NAME, input="Name three primary colors.", max_output_tokens=24,
                                 temperature=0) as stream:
        for event in stream:
            seen.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    order = [t for i, t in enumerate(seen) if i == 0 or t != seen[i - 1]]  # deltas collapsed
    assert order == STREAM_EVENTS[:-1] + [order[-1]] and order[-1] in ("response.completed", "response.incomplete")
    assert "".join(deltas) == final.output_text
    assert final.output_text == _chat_text(env, [{"role": "user", "content": "Name three primary colors."}], 24)
    numbers = [r for t in env.transports[-1:] for r in t.records]
    events = [orjson.loads(x) for x in numbers[0].events()]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


class Capital(BaseModel):
    country: str = Field(min_length=1, max_length=40)
    capital: str = Field(min_length=1, max_length=40)


def test_parse_returns_a_pydantic_object(env: Env) -> None:
    r = env.client().responses.parse(model=NAME, input="What is the capital of France? Answer in JSON.",
                                     text_format=Capital, temperature=0, max_output_tokens=60)
    assert isinstance(r.output_parsed, Capital), r.output_text


# --- tools -----------------------------------------------------------------------------------------

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}, "strict": True}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_function_tool_round_trip(env: Env, stream: bool) -> None:
    client = env.client()
    ask = {"model": NAME, "input": "What is the weather in Paris?", "tools": [WEATHER],
           "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0, "max_output_tokens": 40}
    if stream:
        kinds: list[str] = []
        with client.responses.stream(**ask) as s:
            for event in s:
                kinds.append(event.type)
            first = s.get_final_response()
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    else:
        first = client.responses.create(**ask)
    calls = [i for i in first.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", first.output
    assert isinstance(orjson.loads(calls[0].arguments)["city"], str)
    answer = client.responses.create(
        model=NAME, previous_response_id=first.id, tools=[WEATHER], temperature=0, max_output_tokens=24,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 C"}])
    assert answer.previous_response_id == first.id and answer.output_text.strip()
    # The continued conversation reuses the first turn's prefix: the prefill node's prefix cache.
    assert answer.usage is not None and answer.usage.input_tokens_details.cached_tokens > 0


def test_truncation_auto_drops_the_oldest_items_to_fit(env: Env) -> None:
    client = env.client("small")
    turns: list[dict[str, Any]] = []
    for i in range(8):
        turns += [{"role": "user", "content": f"Tell me fact number {i} about the sea, in detail please."},
                  {"role": "assistant", "content": f"Fact {i}: the sea is large, deep, salty and very old."}]
    turns.append({"role": "user", "content": "Which fact was the last?"})
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=NAME, input=turns, max_output_tokens=8, temperature=0)
    assert info.value.code == "context_length_exceeded"
    r = client.responses.create(model=NAME, input=turns, max_output_tokens=8, temperature=0, truncation="auto")
    dropped = r.model_extra["truncated_input_items"] if r.model_extra else 0
    assert r.truncation == "auto" and 1 <= dropped < len(turns)
    assert r.usage is not None and r.usage.input_tokens + 8 <= 160
    assert r.output_text == _chat_text(env, turns[dropped:], 8)


# --- stored responses ------------------------------------------------------------------------------


def test_retrieve_input_items_and_delete(env: Env) -> None:
    client = env.client()
    r = client.responses.create(model=NAME, input=[{"role": "user", "content": "Hi"},
                                                   {"role": "assistant", "content": "Hello!"},
                                                   {"role": "user", "content": "How are you?"}],
                                max_output_tokens=8, temperature=0, metadata={"run": "test"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"run": "test"}
    items = client.responses.input_items.list(r.id, order="asc")
    assert [i.type for i in items.data] == ["message"] * 3 and items.data[-1].content[0].text == "How are you?"
    assert [i.id for i in client.responses.input_items.list(r.id).data] == [i.id for i in items.data][::-1]
    assert len(client.responses.input_items.list(r.id, limit=1).data) == 1
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_another_tenant_gets_404(env: Env) -> None:
    r = env.client("alpha").responses.create(model=NAME, input="Hi", max_output_tokens=4, temperature=0)
    beta = env.client("beta")
    for call in (lambda: beta.responses.retrieve(r.id), lambda: beta.responses.delete(r.id),
                 lambda: beta.responses.input_items.list(r.id),
                 lambda: beta.responses.create(model=NAME, input="Go on", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert env.client("alpha").responses.retrieve(r.id).id == r.id


def test_background_polled_to_completion_and_another_cancelled(env: Env) -> None:
    client = env.client()
    done = client.responses.create(model=NAME, input="Name a fruit.", background=True, max_output_tokens=12,
                                   temperature=0)
    assert done.status in ("queued", "in_progress") and done.background
    long = client.responses.create(model=NAME, input="Write a very long story.", background=True,
                                   max_output_tokens=2000, temperature=0)
    deadline = time.monotonic() + 120
    while (got := client.responses.retrieve(done.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert got.status in ("completed", "incomplete") and got.output_text == _chat_text(
        env, [{"role": "user", "content": "Name a fruit."}], 12)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    time.sleep(1.5)  # the run stopped: its status stays cancelled and its blocks are freed
    assert client.responses.retrieve(long.id).status == "cancelled"
    env.cluster.wait_clean()


# --- the shared store, restarts, expiry, the store down ----------------------------------------


def test_conversation_survives_a_restart_and_is_shared_through_postgresql(env: Env) -> None:
    store = env.pg_dsn
    a = env.start_frontend("frontend-pg-a", store)
    b = env.start_frontend("frontend-pg-b", store)
    env.shared += [a, b]
    first = env.client(fe=a).responses.create(model=NAME, input="My name is Ada. Say hi.", max_output_tokens=12,
                                              temperature=0)
    second = env.client(fe=b).responses.create(model=NAME, input="What is my name?", previous_response_id=first.id,
                                               max_output_tokens=12, temperature=0)
    chat = [{"role": "user", "content": "My name is Ada. Say hi."}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"}]
    assert second.output_text == _chat_text(env, chat, 12)
    # SQLite store: the frontend restarts and continues the conversation it stored before.
    sq = env.client().responses.create(model=NAME, input="My name is Ada. Say hi.", max_output_tokens=12,
                                       temperature=0)
    _stop(env.frontend)
    env.frontend = env.start_frontend("frontend-sqlite-2", f"sqlite:///{env.tmp / 'responses.db'}")
    again = env.client().responses.create(model=NAME, input="What is my name?", previous_response_id=sq.id,
                                          max_output_tokens=12, temperature=0)
    assert again.output_text == second.output_text
    assert env.client().responses.retrieve(sq.id).output_text == sq.output_text


def test_expired_responses_are_gone(env: Env) -> None:
    fe = env.start_frontend("frontend-ttl", f"sqlite:///{env.tmp / 'ttl.db'}", "--response-ttl", "1")
    env.shared.append(fe)
    client = env.client(fe=fe)
    r = client.responses.create(model=NAME, input="Hi", max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(r.id).id == r.id
    time.sleep(1.5)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=NAME, input="Go on", previous_response_id=r.id, max_output_tokens=4)


def test_store_down_gives_503_and_chat_still_answers(env: Env) -> None:
    fe = env.start_frontend("frontend-pg-down", env.pg_dsn)
    env.shared.append(fe)
    client = env.client(fe=fe)
    kept = client.responses.create(model=NAME, input="Hi", max_output_tokens=4, temperature=0)
    env.pg.stop()
    try:
        for call in (lambda: client.responses.create(model=NAME, input="Hi", max_output_tokens=4),
                     lambda: client.responses.retrieve(kept.id),
                     lambda: client.responses.create(model=NAME, input="Hi", previous_response_id=kept.id)):
            with pytest.raises(openai.InternalServerError) as info:
                call()
            assert info.value.status_code == 503 and "response store is unavailable" in str(info.value)
        r = client.responses.create(model=NAME, input="Hi", max_output_tokens=4, temperature=0, store=False)
        assert r.output_text and r.store is False
        assert client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4).choices[0].message.content
    finally:
        env.pg.start()
    assert client.responses.retrieve(kept.id).id == kept.id  # back with the server


# --- the Agents SDK --------------------------------------------------------------------------------


def test_agents_sdk_runs_an_agent_with_a_function_tool(env: Env) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=f"{env.frontend.base_url}/v1", api_key=KEYS["alpha"], max_retries=0)
        agent = Agent(name="weather", instructions="You answer questions about the weather.", tools=[get_weather],
                      model=OpenAIResponsesModel(model=NAME, openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48))
        try:
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert calls and isinstance(result.final_output, str) and result.final_output.strip()


# --- hostile input ---------------------------------------------------------------------------------


def _post(env: Env, body: Any, tenant: str = "alpha") -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.post(f"{env.frontend.base_url}/v1/responses", content=content, timeout=60,
                      headers={"authorization": f"Bearer {KEYS[tenant]}", "content-type": "application/json"})


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi"}, "model"),
    ({"model": NAME}, "input"),
    ({"model": NAME, "input": []}, "input"),
    ({"model": NAME, "input": 5}, "input"),
    ({"model": NAME, "input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
    ({"model": NAME, "input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"model": NAME, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"model": NAME, "input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
    ({"model": NAME, "input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"model": NAME, "input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": NAME, "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "nope"}}]},
     "tools[0].parameters"),
    ({"model": NAME, "input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"model": NAME, "input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": "{"}}},
     "text.format"),
    ({"model": NAME, "input": "hi", "truncation": "sometimes"}, "truncation"),
    ({"model": NAME, "input": "hi", "background": True, "store": False}, "background"),
    ({"model": NAME, "input": "hi", "include": ["file_search_call.results"]}, "include[0]"),
    ({"model": NAME, "input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"model": NAME, "input": "hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"model": NAME, "input": "hi", "metadata": {"k": 5}}, "metadata.k"),
    ({"model": NAME, "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": NAME, "input": "hi", "previous_response_id": "resp_doesnotexist"}, "previous_response_id"),
    ({"model": NAME, "input": "x" * 1_000_000 * 2}, None),
])
def test_hostile_inputs_get_4xx_in_the_error_shape(env: Env, body: dict[str, Any], param: str | None) -> None:
    r = _post(env, body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param or err["param"].startswith(param + "."), err


def test_hostile_bodies_and_clients(env: Env) -> None:
    for raw in (b"", b"{", b"[1]", b'{"model": "x", "input": "\xff"}'):
        assert _post(env, raw).status_code == 400
    assert _post(env, {"model": "no-such-model", "input": "hi"}).status_code == 404
    r = httpx.get(f"{env.frontend.base_url}/v1/responses/resp_x/input_items?limit=1000",
                  headers={"authorization": f"Bearer {KEYS['alpha']}"})
    assert r.status_code in (400, 404)
    # A client that reads a few events of a stream and hangs up: nothing leaks, the next request is served.
    with httpx.stream("POST", f"{env.frontend.base_url}/v1/responses", timeout=60,
                      headers={"authorization": f"Bearer {KEYS['alpha']}"},
                      json={"model": NAME, "input": "Write a long story.", "stream": True,
                            "max_output_tokens": 500}) as s:
        for n, _ in enumerate(s.iter_lines()):
            if n > 10:
                break
    env.cluster.wait_clean()
    assert env.client().responses.create(model=NAME, input="Hi", max_output_tokens=4).output_text is not None


def test_responses_are_metered_like_chat_completions(env: Env) -> None:
    env.client().responses.create(model=NAME, input="Hi", max_output_tokens=4, temperature=0)
    _post(env, {"model": NAME, "input": []})  # a refusal is counted too
    text = httpx.get(f"{env.frontend.base_url}/metrics").text
    served = [line for line in text.splitlines()
              if line.startswith("pdserve_frontend_requests_total{") and 'endpoint="responses"' in line]
    assert any('status="200"' in line for line in served) and any('status="400"' in line for line in served), served
