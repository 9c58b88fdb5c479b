"""Structured output and logit_bias through a real cluster (etcd, 1 prefill + 1 decode node process, the
frontend process) and the official openai SDK: `chat.completions.parse` with a pydantic model returns a
parsed object whose greedy tokens equal the colocated engine's for the same request; the prefill node
samples the first token under the grammar and the decode node continues it (also after a resume); each
class of bad schema and bad logit_bias is a 400 in the OpenAI error shape before any node sees it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import grpc
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured_spec import StructuredSpec
from pdserve.engine.tokenizer import Tokenizer
from pdserve.registry.etcd_server import free_port
from testing.cluster import LocalCluster
from testing.procs import FrontendProc, start_frontend

pytestmark = [pytest.mark.timeout(400), pytest.mark.usefixtures("check_integrity_after_each_test")]

MODEL = "tiny-llama"
NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "256", "--block-size", "16",
             "--model-name", MODEL]
MAX_SCHEMA_BYTES = 2048
MAX_TOKENS = 64


class Pick(BaseModel):
    color: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=20)
    ok: bool


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"size": {"enum": ["S", "M", "L"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                   "fresh": {"type": "boolean"}},
    "required": ["size", "n", "fresh"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("structured"), model_dir, node_args=NODE_ARGS) as c:
        # Threshold 0: every prompt is prefilled on the prefill node, which samples the first token.
        c.start(1, 1, decode_args=["--local-prefill-threshold", "0"])
        yield c
        c.wait_clean()


@pytest.fixture(scope="module")
def frontend(cluster: LocalCluster, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontendProc]:
    fe = start_frontend("frontend", tmp_path_factory.mktemp("structured-fe"), cluster.etcd_endpoints, free_port(),
                        "--cluster", cluster.cluster, "--model", f"{MODEL}={model_dir}", "--max-schema-bytes",
                        str(MAX_SCHEMA_BYTES), "--log-level", "warning")
    try:
        yield fe
    finally:
        assert fe.stop() == 0, fe.proc.tail()
        assert "Traceback" not in fe.proc.log_text(), fe.proc.tail(80)


@pytest.fixture
def sent() -> list[dict[str, Any]]:
    return []


@pytest.fixture
def client(frontend: FrontendProc, sent: list[dict[str, Any]]) -> openai.OpenAI:
    """An SDK client that records every request body it sends (to rebuild the same request here)."""
    def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.read()))

    http = httpx.Client(timeout=120, event_hooks={"request": [record]})
    return openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key="sk-test", max_retries=0, http_client=http)


def test_parse_with_a_pydantic_model_equals_the_colocated_engine(
    client: openai.OpenAI, sent: list[dict[str, Any]], reference: LLMEngine, model_dir: Path,
) -> None:
    messages = [{"role": "user", "content": "Pick a color and a count."}]
    completion = client.chat.completions.parse(model=MODEL, messages=messages, response_format=Pick,  # type: ignore[arg-type]
                                               temperature=0, max_tokens=MAX_TOKENS)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    pick = choice.message.parsed
    assert isinstance(pick, Pick) and 0 <= pick.count <= 20
    # the colocated engine, same prompt and the schema exactly as the SDK sent it
    body = sent[-1]
    fmt = body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    spec = StructuredSpec("json_schema", json.dumps(fmt["json_schema"]["schema"]))
    prompt = Tokenizer(model_dir).encode_chat(messages)
    want = reference.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, structured=spec))[0]
    assert choice.message.content == want.text
    assert completion.usage is not None and completion.usage.completion_tokens == len(want.token_ids)
    # streamed, the same request's deltas add up to the same JSON
    stream = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt,  # type: ignore[arg-type]
                                            temperature=0, max_tokens=MAX_TOKENS, stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_and_logit_bias_through_the_frontend(
    client: openai.OpenAI, reference: LLMEngine, model_dir: Path,
) -> None:
    messages = [{"role": "user", "content": "config ="}]
    prompt = Tokenizer(model_dir).encode_chat(messages)
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24,  # type: ignore[arg-type]
                                         response_format={"type": "json_object"})
    want = reference.generate([prompt], SamplingParams(max_tokens=24, structured=StructuredSpec("json_object")))[0]
    assert out.choices[0].message.content == want.text and out.choices[0].finish_reason == want.finish_reason
    if want.finish_reason == "stop":
        assert isinstance(json.loads(want.text), dict)
    # logit_bias bans the unbiased greedy output's first two tokens; both paths agree token for token
    plain = reference.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    bias = {plain[0]: -100.0, plain[1]: -100.0}
    want = reference.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, logit_bias=bias))[0]
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8,  # type: ignore[arg-type]
                                         logit_bias={str(t): b for t, b in bias.items()},
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == want.text
    assert not set(want.token_ids) & set(bias)


@pytest.mark.parametrize("resume_at", [0, 3])
def test_prefill_node_samples_under_the_grammar_and_the_decode_node_continues(
    cluster: LocalCluster, reference: LLMEngine, resume_at: int,
) -> None:
    """Remote prefill (the prefill node's first token) of a json_schema request, from the start and
    resumed after `resume_at` tokens (both nodes replay them through the grammar): token for token the
    colocated engine's output, which validates."""
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    params = SamplingParams(max_tokens=MAX_TOKENS, structured=spec)
    prompt = reference.tokenizer.encode("Describe the order as JSON: " + "item " * 20)
    want = reference.generate([prompt], params)[0]
    assert want.finish_reason == "stop"
    jsonschema.validate(json.loads(want.text), SCHEMA)
    # the grammar decides the prefill node's token: unconstrained, the model would pick another one
    free = reference.generate([prompt + want.token_ids[:resume_at]], SamplingParams(max_tokens=1))[0]
    assert free.token_ids[0] != want.token_ids[resume_at]
    got = cluster.generate("d0", prompt, params, prefill_node_id="p0",
                           resume_token_ids=want.token_ids[:resume_at])
    assert got.error == "" and got.prefill_node_id == "p0"
    assert want.token_ids[:resume_at] + got.token_ids == want.token_ids
    assert got.finish_reason == "stop"


def _bad(client: openai.OpenAI, **kwargs: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],  # type: ignore[arg-type]
                                       max_tokens=4, **kwargs)
    err = info.value
    assert err.status_code == 400 and err.type == "invalid_request_error" and err.message
    assert isinstance(err.body, dict) and set(err.body) >= {"message", "type", "param", "code"}
    return err


def _schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}


def test_a_schema_that_is_not_json_is_a_400(client: openai.OpenAI) -> None:
    err = _bad(client, response_format=_schema_format("{this is not json"))
    assert (err.param, err.code) == ("response_format", "invalid_json_schema")


def test_a_schema_keyword_the_engine_refuses_is_a_400_naming_it(client: openai.OpenAI) -> None:
    err = _bad(client, response_format=_schema_format({"type": "object", "if": {"required": ["a"]}, "then": {}}))
    assert (err.param, err.code) == ("response_format", "invalid_json_schema")
    assert '"if"' in err.message and '"then"' in err.message
    err = _bad(client, response_format=_schema_format({"type": "string", "pattern": "(?=x)y"}))
    assert err.param == "response_format" and "look-around" in err.message


def test_an_oversized_schema_is_a_400(client: openai.OpenAI) -> None:
    big = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(200)}}
    assert len(json.dumps(big)) > MAX_SCHEMA_BYTES
    err = _bad(client, response_format=_schema_format(big))
    assert (err.param, err.code) == ("response_format", "schema_too_large") and str(MAX_SCHEMA_BYTES) in err.message


@pytest.mark.parametrize(("bias", "param", "code"), [
    ({"abc": 1}, "logit_bias", "invalid_value"),
    ({"-3": 1}, "logit_bias", "invalid_value"),
    ({"99999": 1}, "logit_bias", "invalid_value"),  # beyond the tiny model's vocabulary
    ({"5": 150}, "logit_bias.5", "invalid_value"),
    ({"5": "much"}, "logit_bias.5", "invalid_type"),
    ({str(i): 1 for i in range(301)}, "logit_bias", "invalid_value"),
], ids=["not-an-id", "negative", "outside-vocab", "value-out-of-range", "value-not-a-number", "too-many"])
def test_bad_logit_bias_is_a_400(client: openai.OpenAI, bias: dict[str, Any], param: str, code: str) -> None:
    err = _bad(client, logit_bias=bias)
    assert (err.param, err.code) == (param, code), err.message


@pytest.mark.parametrize("prefill_node_id", ["p0", ""], ids=["remote-prefill", "decode-node-decides"])
def test_a_schema_sent_past_the_frontend_is_refused_by_the_node(cluster: LocalCluster, prefill_node_id: str) -> None:
    """Direct gRPC callers skip the frontend's check: the node's engine refuses the grammar itself
    (INVALID_ARGUMENT naming the keyword), holding nothing afterwards."""
    bad = StructuredSpec("json_schema", json.dumps({"type": "object", "if": {}, "then": {}}))
    with pytest.raises(grpc.RpcError) as info:
        cluster.generate("d0", [5, 6, 7], SamplingParams(max_tokens=4, structured=bad),
                         prefill_node_id=prefill_node_id)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "if" in (info.value.details() or "")
