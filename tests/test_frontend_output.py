"""The exact bytes `Frontend.stream` (each SSE write) and `Frontend.collect` (the JSON body) make of
scripted upstream messages: chat and completions, echo, both logprobs styles, tool calls streamed and
whole, stop reasons, n > 1 over several prompts, usage, hand-overs to another decode node, and choices
that fail mid-way; the Generate calls are scripted (`ScriptedNodes`), the rest is the frontend's. The expected
bytes are tests/golden/frontend_output.json; rewrite it (after checking the difference is meant) with

    PDSERVE_RECORD_GOLDEN=1 .venv/bin/python -m pytest -q tests/test_frontend_output.py
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest

from pdserve.frontend import tool_calls
from pdserve.frontend.config import FrontendConfig, ModelSpec
from pdserve.frontend.errors import APIError
from pdserve.frontend.job import Job
from pdserve.frontend.pipeline import Frontend
from pdserve.registry import Member, NodeCapacity, NodeLoad, NodeRecord
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc.enums import finish_reason_value

pytestmark = pytest.mark.timeout(60)

GOLDEN = Path(__file__).with_name("golden") / "frontend_output.json"
RECORD = os.environ.get("PDSERVE_RECORD_GOLDEN") == "1"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}

Script = list[tuple[int, dict[str, Any] | str]]  # (choice index, GenerateResponse fields or "fail")


def lp(token: int, value: float, *tops: tuple[int, float]) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=token, logprob=value, top_token_ids=[t for t, _ in tops],
                           top_logprobs=[v for _, v in tops])


def done(reason: str = "stop", tokens: int = 0, cached: int = 0, **fields: Any) -> dict[str, Any]:
    return {"finished": True, "finish_reason": finish_reason_value(reason), "num_completion_tokens": tokens, "num_cached_tokens": cached,
            "decode_node_id": "d0", **fields}


TIMING = pb.Timing(prefill_queue_s=0.001, prefill_s=0.002)
LOGPROB_TEXT: Script = [
    (0, {"token_ids": [450], "text": " The", "logprobs": [lp(450, -0.05, (450, -0.05), (319, -3.25))],
         "timing": TIMING, "prefill_node_id": "d0", "decode_node_id": "d0"}),
    (0, {"token_ids": [4996, 17354], "text": " quick brown",
         "logprobs": [lp(4996, -1.5, (4996, -1.5), (13, -2.0)), lp(17354, float("-inf"), (13, -0.5), (17354, -1e30))]}),
    (0, {**done("stop", 3, 4, stop_reason="."), "token_ids": [29889], "text": ".",
         "logprobs": [lp(29889, -0.25, (29889, -0.25), (13, -1.75))]}),
]
TWO_BY_TWO: Script = [  # two prompts, n=2: choices 0, 1 of the first prompt, 2, 3 of the second
    (2, {"token_ids": [319], "text": " A", "timing": TIMING}),
    (0, {"token_ids": [450], "text": " The"}),
    (1, {"token_ids": [], "text": ""}),
    (3, {**done("length", 1, 2), "token_ids": [350], "text": " B"}),
    (1, {"token_ids": [4996], "text": " quick"}),
    (0, done("stop", 1, 3, stop_reason="2")),
    (2, done("length", 1, 2)),
    (1, {**done("length", 2, 3), "token_ids": [17354], "text": " brown"}),
]
TOOL_CALL: Script = [
    (0, {"token_ids": [1, 2], "text": '[{"name":"get_weather","arg'}),
    (0, {"token_ids": [3, 4], "text": 'uments":{"city":"Os'}),
    (0, {**done("stop", 6), "token_ids": [5, 6], "text": 'lo"}}]'}),
]
TAGGED_CALL: Script = [
    (0, {"token_ids": [1], "text": "Let me check. <tool"}),
    (0, {"token_ids": [2], "text": '_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'}),
    (0, done("stop", 2)),
]
CASES: dict[str, tuple[str, dict[str, Any], Script]] = {
    "chat": ("chat", {}, [(0, {"token_ids": [450], "text": " The"}),
                          (0, {**done("stop", 2, 1), "token_ids": [4996], "text": " quick"})]),
    "chat_usage_logprobs": ("chat", {"logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True}},
                            LOGPROB_TEXT),
    "chat_n2_length": ("chat", {"n": 2, "max_tokens": 2}, [
        (1, {"token_ids": [319], "text": " A"}), (0, {"token_ids": [450], "text": " The"}),
        (1, {**done("length", 2), "token_ids": [350], "text": " B"}), (0, done("length", 2))]),
    "chat_tool_required": ("chat", {"tools": [WEATHER], "tool_choice": "required"}, TOOL_CALL),
    "chat_tool_required_length": ("chat", {"tools": [WEATHER], "tool_choice": "required",
                                           "stream_options": {"include_usage": True}},
                                  [*TOOL_CALL[:2], (0, done("length", 4))]),
    "chat_tool_named_logprobs": ("chat", {"tools": [WEATHER], "logprobs": True, "top_logprobs": 1, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}, [
        (0, {"token_ids": [450], "text": '{"city":', "logprobs": [lp(450, -0.5, (450, -0.5))]}),
        (0, {**done("stop", 2), "token_ids": [4996], "text": '"Oslo"}', "logprobs": [lp(4996, -1.0, (4996, -1.0))]})]),
    "chat_tool_auto": ("chat", {"tools": [WEATHER]}, TAGGED_CALL),
    "chat_tool_auto_text": ("chat", {"tools": [WEATHER]}, [
        (0, {"token_ids": [1], "text": "It is a < b"}), (0, {**done("stop", 2), "token_ids": [2], "text": " <tool"})]),
    "completion": ("completion", {"prompt": "Hello"}, [
        (0, {"token_ids": [450], "text": " The"}), (0, {**done("stop", 1, 1, stop_reason="x")})]),
    "completion_logprobs_usage": ("completion", {"prompt": "Hello", "logprobs": 2,
                                                 "stream_options": {"include_usage": True}}, LOGPROB_TEXT),
    "completion_echo_first_empty": ("completion", {"prompt": "Hi there", "echo": True}, [
        (0, {"token_ids": [], "text": "", "timing": TIMING}), (0, {"token_ids": [450], "text": " The"}),
        (0, done("length", 1))]),
    "completion_prompts_n2_echo_usage": ("completion", {"prompt": ["one", "two two"], "n": 2, "echo": True,
                                                        "stream_options": {"include_usage": True}}, TWO_BY_TWO),
    "completion_prompts_n2_logprobs": ("completion", {"prompt": ["one", "two two"], "n": 2, "logprobs": 0},
                                       TWO_BY_TWO),
    "chat_abort_midway": ("chat", {"n": 2}, [
        (0, {"token_ids": [450], "text": " The"}), (1, {"token_ids": [319], "text": " A"}),
        (1, done("abort", 1))]),
    "completion_error_midway": ("completion", {"prompt": "Hello"}, [(0, {"token_ids": [450], "text": " The"}),
                                                                   (0, "fail")]),
    "completion_handover_logprobs": ("completion", {"prompt": "Hello", "logprobs": 1}, [
        (0, {"token_ids": [450], "text": " The", "logprobs": [lp(450, -0.5, (450, -0.5))]}),
        (0, {**done("hand_over", 1), "token_ids": [4996], "text": " quick", "logprobs": [lp(4996, -1.0, (4996, -1.0))]}),
        (0, {**done("stop", 3), "token_ids": [17354], "text": " brown", "logprobs": [lp(17354, -2.0, (13, -1.0))]})]),
    "chat_handover_tool": ("chat", {"tools": [WEATHER], "tool_choice": "required"}, [
        TOOL_CALL[0], (0, done("hand_over", 2)), *TOOL_CALL[1:]]),
}


def member(node_id: str, role: str = "decode") -> Member:
    rec = NodeRecord(role=role, node_id=node_id, cluster="c", grpc_address=f"{node_id}:1", kv_address="x:1",  # type: ignore[arg-type]
                     model="m", model_fingerprint="abc123", dtype="float32", block_size=16, prefix_hash_seed=7,
                     capacity=NodeCapacity(num_kv_blocks=1000, max_num_seqs=16, max_num_batched_tokens=512))
    return Member(rec, NodeLoad(queue_len=0, running=0, kv_blocks_free=1000, kv_blocks_used=0), 0.0)


@pytest.fixture(scope="module")
def frontend(tiny_llama_dir: Path) -> Iterator[Frontend]:
    config = FrontendConfig(etcd_endpoints=("127.0.0.1:1",), models=(ModelSpec("m", str(tiny_llama_dir)),),
                            request_log=None, prepare_workers=1)
    fe = Frontend(config)  # its registry view is never started: the members below are all it sees
    members = [member("d0"), member("d1"), member("p0", "prefill")]
    fe.view.members = lambda role=None, model=None: [  # type: ignore[method-assign]
        m for m in members if role in (None, m.record.role)]
    try:
        yield fe
    finally:
        fe.workers.close()


class ScriptedNodes:
    """Stands in for the decode nodes' Generate calls: each call of choice i reads the script's next
    messages of choice i, and a message is released only after the one before it in the script was read,
    so the messages reach the frontend in the script's order (first messages aside: the calls open
    together, and their first messages are rendered in choice order)."""

    def __init__(self, job: Job, script: Script) -> None:
        self._index = {c.request_id: c.index for c in job.choices}
        self._steps = script
        self._released = [asyncio.Event() for _ in range(len(script) + 1)]
        self._released[0].set()
        self.calls: list[list[Any]] = []  # [choice, attempt, resume_token_ids, resume_text_chars] of each call

    def stub(self, address: str) -> ScriptedNodes:
        return self

    def Generate(self, request: pb.GenerateRequest, timeout: float, metadata: Any) -> ScriptedCall:  # noqa: N802
        index = self._index[request.request_id]  # one id for the choice's life, whatever the attempt
        self.calls.append([index, str(request.attempt) if request.attempt else "", list(request.resume_token_ids),
                           request.resume_text_chars])
        return ScriptedCall(self, index)

    async def read(self, index: int) -> pb.GenerateResponse:
        at = next(k for k, (i, _) in enumerate(self._steps) if i == index and not self._released[k + 1].is_set())
        await self._released[at].wait()
        self._released[at + 1].set()
        fields = self._steps[at][1]
        if fields == "fail":
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, details="deadline")
        return pb.GenerateResponse(**fields)


class ScriptedCall:
    def __init__(self, nodes: ScriptedNodes, index: int) -> None:
        self._nodes, self._index, self._done = nodes, index, False

    async def read(self) -> pb.GenerateResponse:
        msg = await self._nodes.read(self._index)
        self._done = msg.finished
        return msg

    def cancel(self) -> None:
        self._done = True

    def done(self) -> bool:
        return self._done


async def _run(fe: Frontend, kind: str, body: dict[str, Any], script: Script, stream: bool) -> Any:
    full = {"model": "m", "max_tokens": 8, **body, "stream": stream}
    if kind == "chat":
        full.setdefault("messages", [{"role": "user", "content": "weather in Paris?"}])
    if not stream:
        full.pop("stream_options", None)
    job = await fe.admit(kind, fe.tenants.authenticate(None), orjson.dumps(full), {})
    job.id, job.created = f"{kind}-1", 1700000000  # the random and the clock-dependent parts of a response
    nodes = ScriptedNodes(job, script)
    fe.connections.stub = nodes.stub  # type: ignore[method-assign]
    try:
        firsts = await fe.open(job)
        if stream:
            out: Any = [chunk.decode() async for chunk in fe.stream(job, firsts)]
        else:
            try:
                out = (await fe.collect(job, firsts)).decode()
            except APIError as err:
                out = {"status": err.status, "error": err.to_dict()}
    finally:
        fe.end(job)
    return {"output": out, "calls": nodes.calls}


def _golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


def _record(name: str, got: dict[str, Any]) -> None:
    golden = _golden()
    golden[name] = got
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("name", list(CASES))
def test_stream_and_collect_bytes_are_unchanged(frontend: Frontend, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kind, body, script = CASES[name]
    got: dict[str, Any] = {}
    for stream in (True, False):
        monkeypatch.setattr(tool_calls, "new_call_id", map("call_{}".format, itertools.count()).__next__)
        got["stream" if stream else "whole"] = asyncio.run(_run(frontend, kind, body, script, stream))
    if RECORD:
        _record(name, got)
    assert got == _golden()[name]
