"""The Responses API without a cluster: bodies to chat requests (`frontend.responses`) and deltas to
Response objects and stream events (`frontend.responses_output`), every object and event validated
against the vendored OpenAPI spec."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pdserve.frontend.errors import APIError
from pdserve.frontend.protocol import RequestLimits
from pdserve.frontend.render import Delta
from pdserve.frontend.responses import parse_responses_request
from pdserve.frontend.responses_output import ResponseOutput, response_usage
from pdserve.frontend.tool_calls import ToolEvent
from testing.openapi import OpenAPISchemas
from testing.recording import response_event_schema


@pytest.fixture(scope="module")
def schemas() -> OpenAPISchemas:
    return OpenAPISchemas()


def parse(**body: Any) -> Any:
    return parse_responses_request(orjson.dumps({"model": "m", **body}), RequestLimits())


def test_string_input_is_one_user_message() -> None:
    r = parse(input="Say hi", instructions="Be brief.", max_output_tokens=7, temperature=0.5)
    assert r.generation.messages == [{"role": "user", "content": "Say hi"}]
    assert r.generation.sampling.max_tokens == 7 and r.generation.sampling.temperature == 0.5
    r.conversation([], RequestLimits())
    assert r.generation.messages[0] == {"role": "system", "content": "Be brief."}
    assert r.input_items[0]["content"] == [{"type": "input_text", "text": "Say hi"}]


def test_items_become_the_chat_messages_a_client_would_send() -> None:
    r = parse(input=[
        {"role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
        {"role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "w", "arguments": "{\"a\":1}"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    ])
    msgs = r.generation.messages
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool"]
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["call_1", "call_2"] and msgs[2]["content"] == "Checking."
    assert msgs[4] == {"role": "tool", "content": "rain", "tool_call_id": "call_2"}
    assert [i["type"] for i in r.input_items] == ["message"] * 3 + ["function_call"] * 2 + ["function_call_output"] * 2


def test_stored_context_goes_before_the_input_and_truncation_may_drop_it() -> None:
    r = parse(input="Next?", instructions="Sys.", truncation="auto")
    r.conversation([{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}], RequestLimits())
    assert [m["content"] for m in r.generation.messages] == ["Sys.", "A", "B", "Next?"]
    assert r.generation.droppable == 2  # not the instructions, not the new input


def test_tools_text_format_and_tool_choice_map_to_chat() -> None:
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    r = parse(input="x", tools=[tool], tool_choice={"type": "function", "name": "f"})
    assert r.generation.tools is not None and r.generation.tools.mode == "named"
    assert r.generation.sampling.structured is not None  # the call's arguments are constrained
    r = parse(input="x", text={"format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}}})
    assert r.generation.sampling.structured is not None
    assert parse(input="x", text={"format": {"type": "text"}}).generation.sampling.structured is None


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "o", "schema": {"type": "nope"}}}},
     "text.format"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "x", "reasoning": {"summary": "detailed"}}, "reasoning.summary"),
    ({"input": "x", "n": 2}, "n"),
    ({"input": "x", "prompt": {"id": "p"}}, "prompt"),
    ({"input": "x", "background": True, "stream": True}, "background"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        parse(**body)
    assert info.value.status == 400 and info.value.param == param, info.value.to_dict()


def _events(chunks: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for chunk in chunks:
        for block in chunk.decode().split("\n\n"):
            if block:
                head, data = block.split("\n", 1)
                event = orjson.loads(data.removeprefix("data: "))
                assert head == f"event: {event['type']}"
                out.append(event)
    return out


def _usage() -> dict[str, Any]:
    return response_usage({"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                           "prompt_tokens_details": {"cached_tokens": 4}})


@pytest.mark.parametrize("stream", [True, False])
def test_text_reasoning_and_calls_become_items_and_valid_events(schemas: OpenAPISchemas, stream: bool) -> None:
    rreq = parse(input="x")
    out = ResponseOutput("resp_1", 1.0, "m", rreq, stream=stream)
    chunks = out.start()
    chunks += out.take(Delta("", None, None, None, reasoning="Let me think."))
    chunks += out.take(Delta("", None, [ToolEvent("content", "I will call. ")], None))
    chunks += out.take(Delta("", None, [ToolEvent("call", call=0, call_id="call_a", name="f"),
                                        ToolEvent("arguments", '{"a":', call=0)], None))
    chunks += out.take(Delta("", None, [ToolEvent("arguments", " 1}", call=0), ToolEvent("content", "\n")], None))
    chunks += out.finish("completed", _usage())
    final = out.final
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][2]["arguments"] == '{"a": 1}' and final["output"][1]["content"][0]["text"] == "I will call. "
    assert schemas.errors("Response", final) == []
    events = _events(chunks)
    if not stream:
        assert events == []
        return
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        assert schemas.errors(response_event_schema(schemas, e), e) == [], e
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert text == "I will call. " and args == '{"a": 1}'
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == final["output"]


def test_an_empty_answer_is_an_empty_message_and_a_failure_has_its_error(schemas: OpenAPISchemas) -> None:
    out = ResponseOutput("resp_2", 1.0, "m", parse(input="x"), stream=True)
    chunks = out.start() + out.finish("incomplete", _usage(), incomplete="max_output_tokens")
    assert out.final["output"][0]["content"][0]["text"] == ""
    assert out.final["incomplete_details"] == {"reason": "max_output_tokens"}
    failed = ResponseOutput("resp_3", 1.0, "m", parse(input="x"), stream=True)
    chunks += failed.start() + failed.take(Delta("Hel", None, None, None))
    chunks += failed.finish("failed", None, error={"code": "server_error", "message": "the node died"})
    for e in _events(chunks):
        assert schemas.errors(response_event_schema(schemas, e), e) == [], e
    assert failed.final["status"] == "failed" and failed.final["error"]["message"] == "the node died"
    assert schemas.errors("Response", failed.final) == []
