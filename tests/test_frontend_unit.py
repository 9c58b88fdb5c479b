"""Frontend parts on their own: request validation, tenant files, token buckets, routing, rendering."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from pdserve.engine.block_manager import compute_block_hashes
from pdserve.engine.structured_spec import StructuredSpec
from pdserve.frontend.config import ConfigError, FrontendConfig, ModelSpec, load_models_file
from pdserve.frontend.errors import APIError
from pdserve.frontend.limits import TenantLimiter, TokenBucket
from pdserve.frontend.models import ModelCatalog, TokenTexts
from pdserve.frontend.protocol import (
    RequestLimits,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from pdserve.frontend.render import (
    DONE,
    StreamEncoder,
    chat_logprobs,
    completion_logprobs,
    full_response,
    usage_dict,
)
from pdserve.frontend.routing import HashRing, NoRoute, RouteDecision, Router, bounded_pick, ring_hash
from pdserve.frontend.tenants import Tenant, TenantLimits, TenantTable, hash_key
from pdserve.registry import Member, NodeCapacity, NodeLoad, NodeRecord
from pdserve.rpc import pdserve_pb2 as pb
from testing.openapi import COMPLETION_CHUNK, OpenAPISchemas

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def schemas() -> OpenAPISchemas:
    return OpenAPISchemas()


@pytest.fixture(scope="module")
def catalog(tiny_llama_dir: Path) -> ModelCatalog:
    return ModelCatalog((ModelSpec(name="tiny-llama", path=str(tiny_llama_dir), aliases=("gpt-x",)),))


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def api_error(fn: Callable[[], object]) -> APIError:
    with pytest.raises(APIError) as info:
        fn()
    return info.value


# --- request validation ---------------------------------------------------------------------------


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (chat(temperature="hot"), "temperature", "invalid_type"),
        (chat(temperature=2.5), "temperature", "invalid_value"),
        (chat(top_p=1.5), "top_p", "invalid_value"),
        (chat(max_tokens=-1), "max_tokens", "invalid_value"),
        (chat(max_tokens=0), "max_tokens", "invalid_value"),
        (chat(max_tokens=True), "max_tokens", "invalid_type"),
        (chat(max_tokens="5"), "max_tokens", "invalid_type"),
        (chat(max_completion_tokens=-5), "max_completion_tokens", "invalid_value"),
        (chat(n=0), "n", "invalid_value"),
        (chat(n=1000), "n", "invalid_value"),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop", "invalid_value"),
        (chat(stop=[1]), "stop[0]", "invalid_type"),
        (chat(stop=[""]), "stop[0]", "invalid_value"),
        (chat(seed=1 << 70), "seed", "invalid_value"),
        (chat(presence_penalty=3), "presence_penalty", "invalid_value"),
        (chat(top_logprobs=3), "top_logprobs", "invalid_value"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
        (chat(stream_options={"include_usage": True}), "stream_options", "invalid_value"),
        (chat(stream=True, stream_options=[1]), "stream_options", "invalid_type"),
        (chat(stream="yes"), "stream", "invalid_type"),
        (chat(user=5), "user", "invalid_type"),
        (chat(top_k=-2), "top_k", "invalid_value"),
        (chat(functions=[{"name": "f"}]), "functions", "unsupported_parameter"),
        (chat(logit_bias={"five": 1}), "logit_bias", "invalid_value"),
        (chat(logit_bias={"-5": 1}), "logit_bias", "invalid_value"),
        (chat(logit_bias={"5": 101}), "logit_bias.5", "invalid_value"),
        (chat(logit_bias={"5": "up"}), "logit_bias.5", "invalid_type"),
        (chat(logit_bias={str(i): 1 for i in range(301)}), "logit_bias", "invalid_value"),
        (chat(logit_bias=[5]), "logit_bias", "invalid_type"),
        (chat(response_format={"type": "xml"}), "response_format.type", "invalid_value"),
        (chat(response_format="json"), "response_format", "invalid_type"),
        (chat(response_format={"type": "json_schema"}), "response_format.json_schema", "missing_required_parameter"),
        (chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
         "response_format.json_schema.name", "missing_required_parameter"),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
         "response_format.json_schema.name", "invalid_value"),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": "{oops"}}),
         "response_format", "invalid_json_schema"),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {
            "type": "object", "if": {}, "then": {}}}}), "response_format", "invalid_json_schema"),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {
            "type": "string", "pattern": "(?=a)"}}}), "response_format", "invalid_json_schema"),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": nested_schema(150)}}),
         "response_format", "invalid_json_schema"),  # nesting beyond what the grammar compiler parses
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": nested_schema(300)}}),
         "response_format", "invalid_json_schema"),  # nesting beyond what orjson writes back
        (chat(model=5), "model", "invalid_type"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model", "missing_required_parameter"),
        ({"model": "m"}, "messages", "missing_required_parameter"),
        ({"model": "m", "messages": []}, "messages", "invalid_value"),
        ({"model": "m", "messages": "hi"}, "messages", "invalid_type"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
        ({"model": "m", "messages": [{"content": "x"}]}, "messages[0].role", "missing_required_parameter"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0].type", "unsupported_content"),
        ({"model": "m", "messages": ["hi"]}, "messages[0]", "invalid_type"),
        ({"model": "m", "messages": [None]}, "messages[0]", "invalid_type"),
        ({"model": None, "messages": [{"role": "user", "content": "x"}]}, "model", "missing_required_parameter"),
        ({"model": "", "messages": [{"role": "user", "content": "x"}]}, "model", "invalid_value"),
        ({"model": "m", "messages": None}, "messages", "missing_required_parameter"),
        ({"model": "m", "messages": [{"role": None, "content": "x"}]}, "messages[0].role", "missing_required_parameter"),
        ({"model": "m", "messages": [{"role": 5, "content": "x"}]}, "messages[0].role", "invalid_type"),
        ({"model": "m", "messages": [{"role": "user", "content": None}]}, "messages[0].content",
         "missing_required_parameter"),
        ({"model": "m", "messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name", "invalid_type"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages[0].content[0].text", "invalid_type"),
        ({"model": "m", "messages": [{"role": "tool", "content": "r"}]}, "messages[0].tool_call_id",
         "missing_required_parameter"),
        ({"model": "m", "messages": [{"role": "tool", "content": "r", "tool_call_id": 5}]}, "messages[0].tool_call_id",
         "invalid_type"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "wizard"}]}, "messages[1].role",
         "invalid_value"),
        (chat(n=2.5), "n", "invalid_type"),
        (chat(max_tokens=0.0), "max_tokens", "invalid_value"),
        (chat(temperature=float("nan")), "temperature", "invalid_value"),
        (chat(stream=True, stream_options={"include_usage": "yes"}), "include_usage", "invalid_type"),
        (chat(top_logprobs=2, logprobs=False), "top_logprobs", "invalid_value"),
        (chat(function_call="auto"), "function_call", "unsupported_parameter"),
        (chat(audio={"voice": "x"}), "audio", "unsupported_parameter"),
    ],
)
def test_chat_validation_errors(body: dict[str, Any], param: str, code: str) -> None:
    err = api_error(lambda: parse_chat_request(body))
    assert err.status == 400
    assert (err.param, err.code) == (param, code), err.message
    assert err.to_dict()["error"]["type"] == "invalid_request_error" and err.message


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"model": "m"}, "prompt", "missing_required_parameter"),
        ({"model": "m", "prompt": []}, "prompt", "invalid_value"),
        ({"model": "m", "prompt": 5}, "prompt", "invalid_type"),
        ({"model": "m", "prompt": [1, "a"]}, "prompt[1]", "invalid_type"),
        ({"model": "m", "prompt": [1, -2]}, "prompt[1]", "invalid_value"),
        ({"model": "m", "prompt": ["a", 3]}, "prompt[1]", "invalid_type"),
        ({"model": "m", "prompt": [[1], []]}, "prompt[1]", "invalid_value"),
        ({"model": "m", "prompt": "x", "logprobs": 30}, "logprobs", "invalid_value"),
        ({"model": "m", "prompt": "x", "echo": True, "logprobs": 1}, "echo", "unsupported_parameter"),
        ({"model": "m", "prompt": "x", "best_of": 3}, "best_of", "unsupported_parameter"),
        ({"model": "m", "prompt": "x", "suffix": 5}, "suffix", "invalid_type"),
        ({"model": "m", "prompt": ["x"] * 65, "n": 2}, "n", "invalid_value"),
        ({"model": "m", "prompt": None}, "prompt", "missing_required_parameter"),
        ({"model": "m", "prompt": [[1, -1]]}, "prompt[0][1]", "invalid_value"),
        ({"model": "m", "prompt": [[1, True]]}, "prompt[0][1]", "invalid_type"),
        ({"model": "m", "prompt": [1, 2.0]}, "prompt[1]", "invalid_type"),
        ({"model": "m", "prompt": ["x"] * 129}, "prompt", "invalid_value"),
        ({"model": "m", "prompt": "x", "n": 2, "best_of": 3.0}, "best_of", "unsupported_parameter"),
    ],
)
def test_completion_validation_errors(body: dict[str, Any], param: str, code: str) -> None:
    err = api_error(lambda: parse_completion_request(body))
    assert (err.status, err.param, err.code) == (400, param, code), err.message


def test_valid_requests_parse_and_unknown_fields_are_ignored() -> None:
    req = parse_chat_request(chat(max_tokens=7, max_completion_tokens=9, stop="END", top_p=0, seed=3, top_k=0,
                                  logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True},
                                  user="u1", ignore_eos=True, some_future_field={"x": 1}, store=True,
                                  messages=[{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                             {"type": "text", "text": "b"}]},
                                            {"role": "assistant", "content": None},
                                            {"role": "user", "content": "q", "name": "bob"}]))
    s = req.sampling
    assert s.max_tokens == 9 and req.max_tokens_param == "max_completion_tokens"  # the newer field wins
    assert s.stop == ("END",) and s.seed == 3 and s.top_k == -1 and s.logprobs == 2 and s.ignore_eos
    assert (s.temperature, s.top_p) == (0.0, 1.0)  # top_p 0 is greedy
    assert req.stream and req.include_usage and req.user == "u1"
    assert req.messages == [{"role": "system", "content": "ab"}, {"role": "assistant", "content": ""},
                            {"role": "user", "content": "q", "name": "bob"}]
    assert parse_chat_request(chat()).sampling.logprobs is None

    # JSON null is an absent field; an integral float is an integer
    req = parse_chat_request(chat(temperature=None, n=None, stop=None, max_tokens=5.0, seed=-2.0, user=None,
                                  messages=[{"role": "user", "content": "q", "name": None}]))
    assert (req.sampling.temperature, req.n, req.sampling.stop, req.sampling.max_tokens) == (1.0, 1, (), 5)
    assert req.sampling.seed == -2 and isinstance(req.sampling.max_tokens, int) and req.user is None
    assert req.messages == [{"role": "user", "content": "q"}]
    err = api_error(lambda: parse_chat_request(chat(max_tokens=1e30)))
    assert err.message == "Invalid value for 'max_tokens': 1000000000000000019884624838656 is out of range; it must be at least 1."
    err = api_error(lambda: parse_chat_request(chat(temperature=2.5)))
    assert err.message == "Invalid value for 'temperature': 2.5 is out of range; it must be between 0 and 2."
    err = api_error(lambda: parse_chat_request(chat(stop=["a", 7])))
    assert err.message == "Invalid type for 'stop[1]': expected a string, but got an integer instead."
    tool = parse_chat_request(chat(messages=[{"role": "tool", "content": [{"type": "text", "text": "r"}], "tool_call_id": "c1",
                                              "tool_calls": "ignored for this role"}]))
    assert tool.messages == [{"role": "tool", "content": "r", "tool_call_id": "c1"}]

    for prompt, expect in [("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])]:
        req = parse_completion_request({"model": "m", "prompt": prompt, "logprobs": 0, "n": 2, "best_of": 2})
        assert req.prompts == expect and req.sampling.logprobs == 0 and req.n == 2
        assert req.sampling.max_tokens == 16  # the legacy endpoint's default


def test_response_format_and_logit_bias_parse() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "boolean"}, "a": {"enum": ["x", "y"]}},
              "required": ["b", "a"], "additionalProperties": False}
    req = parse_chat_request(chat(response_format={"type": "json_schema", "json_schema": {
        "name": "Pick_1", "schema": schema, "strict": True}}, logit_bias={"5": -100, "7": 2.5}))
    spec = req.sampling.structured
    assert spec is not None and spec.kind == "json_schema"
    assert json.loads(spec.schema_json) == schema and list(json.loads(spec.schema_json)["properties"]) == ["b", "a"]
    assert req.sampling.logit_bias == {5: -100.0, 7: 2.5}
    req = parse_chat_request(chat(response_format={"type": "json_object"}))
    assert req.sampling.structured == StructuredSpec("json_object") and req.sampling.logit_bias is None
    assert parse_chat_request(chat(response_format={"type": "text"})).sampling.structured is None
    big = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(40)}}
    err = api_error(lambda: parse_chat_request(
        chat(response_format={"type": "json_schema", "json_schema": {"name": "big", "schema": big}}),
        RequestLimits(max_schema_bytes=200)))
    assert (err.status, err.param, err.code) == (400, "response_format", "schema_too_large"), err.message
    # the completions endpoint takes logit_bias too (response_format is a chat field)
    assert parse_completion_request({"model": "m", "prompt": "a", "logit_bias": {"3": 1}}).sampling.logit_bias == {3: 1.0}


@pytest.mark.parametrize(
    ("raw", "code"),
    [(b"", "invalid_json"), (b"{", "invalid_json"), (b"[1]", "invalid_json"), (b'{"a": 1,}', "invalid_json"),
     (b'{"model": "\xff\xfe"}', "invalid_encoding"), (b'{"model": "\\ud800"}', "invalid_encoding")],
)
def test_body_decoding_errors(raw: bytes, code: str) -> None:
    err = api_error(lambda: parse_json_body(raw))
    assert (err.status, err.code, err.param) == (400, code, None), err.message


# --- tenants and limits ---------------------------------------------------------------------------


def test_yaml_tenant_file(tmp_path: Path) -> None:
    key_digest = hash_key("sk-acme")
    yaml_file = tmp_path / "t.yaml"
    yaml_file.write_text(f"tenants:\n  - name: acme\n    keys_sha256: ['{key_digest}']\n    models: [m1]\n"
                         f"    requests_per_minute: 10\n    max_output_tokens: 50\n")
    table = TenantTable.from_file(yaml_file)
    acme = table.authenticate("sk-acme")
    assert acme is not None and acme.name == "acme" and not table.open_access
    assert acme.limits.requests_per_minute == 10 and acme.limits.max_output_tokens == 50
    assert acme.limits.input_tokens_per_minute is None
    assert acme.may_use("m1") and not acme.may_use("m2") and acme.may_use("m2", "m1")
    assert table.authenticate("sk-other") is None and table.authenticate(None) is None
    assert table.check_models({"m2"}) == ["m1"]


def test_toml_tenant_file(tmp_path: Path) -> None:
    key_digest = hash_key("sk-acme")
    toml_file = tmp_path / "t.toml"
    toml_file.write_text(f'[[tenants]]\nname = "a"\nkeys_sha256 = ["{key_digest}"]\ninput_tokens_per_minute = 5\n')
    assert TenantTable.from_file(toml_file).authenticate("sk-acme").limits.input_tokens_per_minute == 5  # type: ignore[union-attr]


def test_local_tenant_table_is_open_to_any_key() -> None:
    local = TenantTable.local()
    assert local.open_access and local.authenticate(None) is not None and local.authenticate("anything") is not None


def test_bad_tenant_files_are_refused(tmp_path: Path) -> None:
    key_digest = hash_key("sk-acme")
    yaml_file = tmp_path / "t.yaml"
    bad_cases = [
        ("tenants: []\n", "non-empty"),
        ("tenants:\n  - name: a\n    keys_sha256: ['sk-plaintext']\n", "SHA-256"),
        (f"tenants:\n  - name: a\n    keys_sha256: ['{key_digest}']\n    rpm: 5\n", "unknown field"),
        (f"tenants:\n  - name: a\n    keys_sha256: ['{key_digest}']\n    requests_per_minute: -1\n", "positive"),
        (f"tenants:\n  - name: a\n    keys_sha256: ['{key_digest}']\n  - name: b\n    keys_sha256: ['{key_digest}']\n",
         "also belongs"),
        ("tenants: [\n", "cannot parse"),
        (f"tenants:\n  - name: a\n    keys_sha256: ['{key_digest}']\n  - name: a\n    keys_sha256: ['{'0' * 64}']\n",
         "tenants\\[1\\]: tenant name 'a' is used twice"),
        (f"tenants:\n  - name: a\n    keys_sha256: ['{key_digest}']\n    models: null\n", "models must be a list of model names"),
        ("tenants:\n  - name: a\n    keys_sha256: []\n", "keys_sha256 must be a non-empty list"),
        ("tenants:\n  - [a]\n", "tenants\\[0\\]: each tenant must be a mapping"),
        (f"tenants:\n  - {{name: a, keys_sha256: ['{key_digest}'], ttft_budget_ms: 0}}\n",
         "ttft_budget_ms must be a positive integer or null, got 0"),
        ("tenants: []\nextra: 1\n", "unknown field\\(s\\) \\['extra'\\]; allowed: \\['tenants'\\]"),
    ]
    for text, message in bad_cases:
        yaml_file.write_text(text)
        with pytest.raises(ConfigError, match=message):
            TenantTable.from_file(yaml_file)


class FakeClock:
    """A settable clock: the limiter takes its clocks as parameters."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tenant(**limits: int) -> Tenant:
    return Tenant("t", frozenset({"*"}), TenantLimits(**limits))


def test_token_bucket_refill_and_wait() -> None:
    b = TokenBucket.per_minute(60, now=0.0)
    b.take(60)
    b.refill(0.5)
    assert b.level == pytest.approx(0.5)
    assert b.wait_s(2) == pytest.approx(1.5)
    assert math.isinf(b.wait_s(61))
    b.give(1000)
    assert b.level == 60


def test_limiter_input_tokens_retry_after_and_isolation() -> None:
    clock = FakeClock()
    lim = TenantLimiter(clock=clock)
    small, other = tenant(input_tokens_per_minute=600), Tenant("other", frozenset({"*"}), TenantLimits())
    lim.grant(small, 500, 0).release(0)
    err = api_error(lambda: lim.grant(small, 200, 0))
    assert err.status == 429 and err.code == "rate_limit_exceeded"
    assert err.headers["retry-after"] == "10"  # 100 missing tokens at 10 tokens/s
    assert err.headers["x-should-retry"] == "true"
    lim.grant(other, 10_000, 0).release(0)  # another tenant is unaffected
    clock.now += 10.0
    lim.grant(small, 200, 0).release(0)
    hard = api_error(lambda: lim.grant(small, 601, 0))
    assert hard.code == "request_too_large" and hard.headers["x-should-retry"] == "false"
    assert "retry-after" not in hard.headers


def test_limiter_output_reservation_is_refunded() -> None:
    clock = FakeClock()
    lim = TenantLimiter(clock=clock)
    t = tenant(output_tokens_per_minute=100)
    first = lim.grant(t, 1, 80)
    assert api_error(lambda: lim.grant(t, 1, 80)).status == 429  # 20 left while 80 are reserved
    first.release(10)  # used 10: 70 come back
    lim.grant(t, 1, 80).release(80)
    first.release(0)  # a second release is a no-op
    assert lim.state(t).output_tokens is not None and lim.state(t).output_tokens.level == pytest.approx(10)


def test_limiter_estimated_output_is_capped_and_settled_against_use() -> None:
    clock, wall = FakeClock(), FakeClock()
    lim = TenantLimiter(clock=clock, wall_clock=wall)
    t = tenant(output_tokens_per_minute=60)  # 1 token/s refill
    # A request without max_tokens whose estimate exceeds the bucket is never too large: it reserves
    # what the bucket holds, and is charged what it generated when it ends.
    first = lim.grant(t, 1, 0, 4000)
    assert first.output_reserved == 60
    first.release(100)  # generated past the reservation: the bucket owes 40
    bucket = lim.state(t).output_tokens
    assert bucket is not None and bucket.level == pytest.approx(-40)
    err = api_error(lambda: lim.grant(t, 1, 0, 10))
    assert err.code == "rate_limit_exceeded" and err.headers["retry-after"] == "50"  # debt + 10 at 1/s
    clock.now += 50
    second = lim.grant(t, 1, 0, 10)
    second.release(3)  # used less than the estimate: the rest comes back
    assert bucket.level == pytest.approx(7)  # refilled to 10, 10 reserved, 7 back
    # A firm max_tokens larger than the bucket stays a hard refusal.
    assert api_error(lambda: lim.grant(t, 1, 61)).code == "request_too_large"
    # The daily quota: the estimate shrinks to what is left, then the day is charged what was used.
    daily = Tenant("d", frozenset({"*"}), TenantLimits(daily_token_quota=100))
    held = lim.grant(daily, 70, 0, 256)
    assert held.output_reserved == 30
    held.release(50)
    assert lim.state(daily).day_used == 120
    assert api_error(lambda: lim.grant(daily, 1, 0, 5)).code == "insufficient_quota"


def test_limiter_requests_concurrency_daily_and_share() -> None:
    clock, wall = FakeClock(), FakeClock()
    lim = TenantLimiter(clock=clock, wall_clock=wall)
    rpm = tenant(requests_per_minute=2)
    lim.grant(rpm, 1, 1).release(1)
    lim.grant(rpm, 1, 1).release(1)
    assert api_error(lambda: lim.precheck(rpm)).headers["retry-after"] == "30"

    conc = Tenant("c", frozenset({"*"}), TenantLimits(max_concurrent_requests=1))
    held = lim.grant(conc, 1, 1)
    err = api_error(lambda: lim.grant(conc, 1, 1))
    assert err.code == "concurrency_limit_exceeded" and err.headers["retry-after"] == "1"
    held.release(1)
    lim.grant(conc, 1, 1).release(1)

    daily = Tenant("d", frozenset({"*"}), TenantLimits(daily_token_quota=100))
    lim.grant(daily, 50, 40).release(10)  # 60 charged
    quota = api_error(lambda: lim.grant(daily, 30, 20))
    assert quota.code == "insufficient_quota" and quota.type == "insufficient_quota"
    assert quota.headers["x-should-retry"] == "false" and int(quota.headers["retry-after"]) > 0
    wall.now += 86400
    lim.grant(daily, 30, 20).release(20)  # a new day

    shared = TenantLimiter(share=4, clock=clock)
    assert api_error(lambda: shared.grant(tenant(input_tokens_per_minute=400), 101, 0)).code == "request_too_large"


def test_limit_share_concurrency_one_over_four_frontends_admits_one_in_total() -> None:
    clock, wall = FakeClock(), FakeClock()
    frontends = [TenantLimiter(share=4, index=i, clock=clock, wall_clock=wall) for i in range(4)]
    one = Tenant("one", frozenset({"*"}), TenantLimits(max_concurrent_requests=1))
    admitted, refused = [], []
    for _ in range(3):  # every frontend is asked three times while nothing ends
        for lim in frontends:
            try:
                admitted.append(lim.grant(one, 1, 1))
            except APIError as err:
                refused.append(err)
    assert len(admitted) == 1 and len(refused) == 11
    # Refusals are soft: a client or balancer retries, and another frontend (or this one later) serves it.
    assert all(e.status == 429 and e.headers["retry-after"] == "1" and e.headers["x-should-retry"] == "true"
               for e in refused)
    assert frontends[0].concurrent("one") == 1  # index 0 holds the remainder of 1 // 4

    # Every shared limit splits exactly: floor(limit / K), one more for indices below limit % K.
    limits = TenantLimits(requests_per_minute=10, input_tokens_per_minute=7, output_tokens_per_minute=3,
                          max_concurrent_requests=6, daily_token_quota=4001)
    t = Tenant("split", frozenset({"*"}), limits)
    for field_name, total in ((f, getattr(limits, f)) for f in ("requests_per_minute", "input_tokens_per_minute",
                                                                "output_tokens_per_minute", "max_concurrent_requests",
                                                                "daily_token_quota")):
        assert sum(lim._scaled(total) or 0 for lim in frontends) == total, field_name
    # Input tokens: 7 over 4 is 2, 2, 2, 1: 2 tokens are beyond frontend 3's share but not another's (soft),
    # 3 are beyond every share (hard).
    assert api_error(lambda: frontends[3].grant(t, 2, 1)).headers["x-should-retry"] == "true"
    assert api_error(lambda: frontends[3].grant(t, 3, 1)).code == "request_too_large"
    frontends[2].grant(t, 2, 1).release(1)
    # Output tokens: 3 over 4 leaves frontend 3 none: a soft 429, never "too large".
    zero = api_error(lambda: frontends[3].grant(t, 1, 1))
    assert zero.code == "rate_limit_exceeded" and zero.headers["retry-after"] == "1", zero.message
    assert frontends[3].zero_shares([t]) == ["split.output_tokens_per_minute"]
    # Without an index each process takes the floor: never more than the limit in total.
    floors = [TenantLimiter(share=4, clock=clock) for _ in range(4)]
    assert sum(lim._scaled(6) or 0 for lim in floors) == 4


# --- routing --------------------------------------------------------------------------------------


def member(node_id: str, role: str = "decode", *, queue: int = 0, running: int = 0, free: int = 1000,
           pool: str = "m", block_size: int = 16) -> Member:
    rec = NodeRecord(role=role, node_id=node_id, cluster="c", grpc_address=f"{node_id}:1", kv_address="x:1",  # type: ignore[arg-type]
                     model=pool, model_fingerprint="abc123", dtype="float32", block_size=block_size,
                     prefix_hash_seed=7, capacity=NodeCapacity(num_kv_blocks=1000, max_num_seqs=16,
                                                               max_num_batched_tokens=512))
    return Member(rec, NodeLoad(queue_len=queue, running=running, kv_blocks_free=free,
                                kv_blocks_used=1000 - free), 0.0)


def make_router(members: list[Member], **kw: Any) -> Router:
    def lookup(role: str, pool: str) -> list[Member]:
        return [m for m in members if m.role == role and m.record.model == pool]

    opts = {"load_factor": 1.25, "affinity_blocks": 1, "decode_max_queue": 8, **kw}
    return Router(lookup, **opts)


def test_hash_ring_is_stable_and_bounded_load_spills() -> None:
    ring = HashRing(["a", "b", "c"])
    order = list(ring.walk(ring_hash(b"key")))
    assert sorted(order) == ["a", "b", "c"] and order == list(HashRing(["c", "a", "b"]).walk(ring_hash(b"key")))
    # Removing a node only moves the keys it owned.
    keys = [ring_hash(str(i).encode()) for i in range(300)]
    small = HashRing(["a", "b"])
    moved = sum(1 for k in keys if next(ring.walk(k)) != "c" and next(small.walk(k)) != next(ring.walk(k)))
    assert moved == 0
    owner = order[0]
    pick = bounded_pick(ring, ring_hash(b"key"), {"a": 0, "b": 0, "c": 0}, 1.25)
    assert pick.node_id == owner and not pick.spilled
    pick = bounded_pick(ring, ring_hash(b"key"), {"a": 0, "b": 0, "c": 0, owner: 5}, 1.25)
    assert pick.node_id == order[1] and pick.spilled and "spilled" in pick.reason


def test_router_prefix_affinity_spread_and_spill() -> None:
    members = [member("d0"), member("d1"), *(member(f"p{i}", "prefill") for i in range(3))]
    router = make_router(members)
    system = list(range(100, 200))
    chosen = {router.route("m", [*system, i, i + 1], 16).prefill_hint for i in range(20)}
    assert len(chosen) == 1  # same first block, idle cluster: one prefill node
    decision = router.route("m", system, 16)
    assert decision.prefill_reason.startswith("prefix affinity") and "ring owner" in decision.prefill_reason
    assert decision.prefill_rule == "prefix_owner" and decision.decode_rule == "least_loaded"
    expect_key = compute_block_hashes(system[:16], 16, 7)[0][:8].hex()
    assert decision.prefix_key == expect_key  # keyed on the nodes' own chained block hash
    spread = {router.route("m", [i * 7 + j for j in range(40)], 16).prefill_hint for i in range(40)}
    assert len(spread) == 3  # unrelated prefixes use every node
    # Requests in flight count as load: the owner's share is bounded, the rest spill along the ring.
    leases = [router.lease(router.route("m", system, 16)) for _ in range(9)]
    owners = [lease.decision.prefill_hint for lease in leases]
    assert len(set(owners)) > 1 and max(owners.count(o) for o in owners) <= math.ceil(1.25 * 9 / 3) + 1
    assert {lease.decision.prefill_rule for lease in leases} == {"prefix_owner", "prefix_spill"}
    for lease in leases:
        lease.release()
    assert router.prefill_outstanding == {} and router.decode_outstanding == {}
    short = router.route("m", [1, 2, 3], 16)
    assert "shorter than one block" in short.prefill_reason


def test_router_picks_the_least_loaded_decode_node() -> None:
    members = [member("d0", running=10, free=100), member("d1", running=2, free=900), member("p0", "prefill")]
    router = make_router(members)
    decision = router.route("m", list(range(40)), 16)
    assert decision.decode_id == "d1" and decision.decode_address == "d1:1" and "least loaded" in decision.decode_reason
    leases = [router.lease(router.route("m", list(range(40)), 16)) for _ in range(30)]
    assert {lease.decision.decode_id for lease in leases} == {"d0", "d1"}  # own outstanding counts as load
    for lease in leases:
        lease.release()
    # Not enough free KV blocks ranks a node last.
    tight = make_router([member("d0", free=2), member("d1", running=8, free=900)])
    assert tight.route("m", list(range(100)), 100).decode_id == "d1"
    assert make_router(members).route("m", [1, 2], 4, exclude=frozenset({"d1"})).decode_id == "d0"


def test_router_tells_an_overloaded_pool_from_an_empty_one() -> None:
    busy = make_router([member("d0", queue=8)])
    with pytest.raises(NoRoute) as info:
        busy.route("m", [1], 1)
    assert info.value.overloaded
    with pytest.raises(NoRoute) as info:
        busy.route("other", [1], 1)
    assert not info.value.overloaded


def test_router_session_key_pins_a_conversation_to_one_decode_node() -> None:
    router = make_router([member("d0"), member("d1"), member("d2")])
    pinned = {router.route("m", list(range(i, i + 30)), 8, session_key="conv-1").decode_id for i in range(10)}
    assert len(pinned) == 1 and "session affinity" in router.route("m", [1], 1, session_key="conv-1").decode_reason


def test_router_without_prefill_nodes_lets_the_decode_node_prefill() -> None:
    router = make_router([member("d0"), member("d1"), member("d2")])
    no_prefill = router.route("m", [1], 1)
    assert no_prefill.prefill_hint == "" and "decode node prefills" in no_prefill.prefill_reason


# --- models and rendering -------------------------------------------------------------------------


def test_catalog_and_token_texts(catalog: ModelCatalog, tiny_llama_dir: Path) -> None:
    model = catalog.resolve("gpt-x")
    assert model.name == "tiny-llama" and model.max_context == 4096 and catalog.resolve("tiny-llama") is model
    err = api_error(lambda: catalog.resolve("nope"))
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    ids = model.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == model.tokenizer.bos_token_id and model.tokenizer.decode(ids, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n")
    texts: TokenTexts = model.texts
    assert texts.get(model.tokenizer.bos_token_id).text == "<|begin_of_text|>"
    # Each token's bytes concatenate to the exact UTF-8 of the text, even across a split character.
    text = "naïve café — 日本"
    pieces = [texts.get(t) for t in model.tokenizer.encode(text, add_special_tokens=False)]
    assert bytes(b for p in pieces for b in p.bytes).decode("utf-8").strip() == text
    assert any(p.text.startswith("bytes:\\x") for p in pieces)  # partial characters are named by their bytes
    with pytest.raises(APIError):
        model.check_token_ids([1, 10**6], "prompt")
    spec = ModelSpec(name="x", path=str(tiny_llama_dir), max_context=64)
    assert ModelCatalog((spec,)).resolve("x").max_context == 64


def test_config_validation(tmp_path: Path, tiny_llama_dir: Path) -> None:
    models = tmp_path / "models.yaml"
    models.write_text(f"models:\n  - name: a\n    path: {tiny_llama_dir}\n    aliases: [b]\n    fallback: c\n"
                      f"  - name: c\n    path: {tiny_llama_dir}\n    pool: pool-c\n")
    specs = load_models_file(models)
    assert specs[1].pool == "pool-c" and specs[0].pool == "a"
    FrontendConfig(etcd_endpoints=("h:1",), models=tuple(specs))
    with pytest.raises(ConfigError, match="used twice"):
        FrontendConfig(etcd_endpoints=("h:1",), models=(specs[0], specs[0]))
    with pytest.raises(ConfigError, match="fallback"):
        FrontendConfig(etcd_endpoints=("h:1",), models=(specs[0],))
    with pytest.raises(ConfigError, match="etcd"):
        FrontendConfig(etcd_endpoints=(), models=tuple(specs))
    assert FrontendConfig(etcd_endpoints=("h:1",), models=tuple(specs), max_migrations=0).max_migrations == 0
    with pytest.raises(ConfigError, match="max_migrations"):
        FrontendConfig(etcd_endpoints=("h:1",), models=tuple(specs), max_migrations=-1)
    with pytest.raises(ConfigError, match="not a directory"):
        ModelSpec(name="z", path=str(tmp_path / "missing"))
    models.write_text("models:\n  - name: a\n    path: /x\n    colour: red\n")
    with pytest.raises(ConfigError, match="unknown field"):
        load_models_file(models)
    for entry, message in (("- 5", "each model must be a mapping"), ("- {path: /x}", "name is required and must be a string"),
                           ("- {name: a, path: /x, aliases: [b, '']}", "aliases must be a list of names"),
                           ("- {name: a, path: /x, weight: null}", "weight must be a number, got None"),
                           ("- {name: a, path: /x, pool: 5}", "pool must be a string"),
                           ("- {name: a, path: /x, max_context: 2.0}", "max_context must be a positive integer or null, got 2.0")):
        models.write_text(f"models:\n  {entry}\n")
        with pytest.raises(ConfigError) as info:
            load_models_file(models)
        assert str(info.value) == f"{models}: models[0]: {message}"
    models.write_text(f"models:\n  - {{name: a, path: {tiny_llama_dir}, aliases: null, pool: '', weight: 2}}\n")
    assert load_models_file(models) == [ModelSpec(name="a", path=str(tiny_llama_dir), weight=2.0)]
    # The admission settings are validated too.
    base = {"etcd_endpoints": ("h:1",), "models": tuple(specs)}
    ok = FrontendConfig(**base, limit_share=4, limit_share_index=3, max_messages=10, max_stop_strings=8)
    assert ok.request_limits.max_messages == 10 and ok.request_limits.max_stop_strings == 8
    for bad, match in (({"limit_share": 4, "limit_share_index": 4}, "limit_share_index"),
                       ({"limit_share_index": -1}, "limit_share_index"), ({"output_estimate": 0}, "output_estimate"),
                       ({"body_timeout_s": 0}, "body_timeout_s"), ({"max_header_bytes": 10}, "max_header_bytes"),
                       ({"max_stop_strings": 0}, "max_stop_strings"), ({"max_prompt_chars": 0}, "max_prompt_chars"),
                       ({"prepare_workers": 0}, "prepare_workers"), ({"ttft_headroom": 1.5}, "ttft_headroom")):
        with pytest.raises(ConfigError, match=match):
            FrontendConfig(**base, **bad)  # type: ignore[arg-type]
    for bad, message in (({"port": 65536}, "port must be in [0, 65535], got 65536"),
                         ({"batch_inflight_fraction": 0}, "batch_inflight_fraction must be in (0, 1], got 0"),
                         ({"load_factor": 1.0}, "load_factor must be > 1, got 1.0"),
                         ({"max_body_bytes": 10}, "max_body_bytes must be >= 1024, got 10")):
        with pytest.raises(ConfigError) as info:
            FrontendConfig(**base, **bad)  # type: ignore[arg-type]
        assert str(info.value) == f"FrontendConfig: {message}"


def test_rendered_chunks_and_bodies_match_the_spec(schemas: OpenAPISchemas, catalog: ModelCatalog) -> None:
    texts = catalog.resolve("tiny-llama").texts
    entries = [pb.TokenLogprob(token_id=300, logprob=-0.25, top_token_ids=[300, 301], top_logprobs=[-0.25, -2.0]),
               pb.TokenLogprob(token_id=301, logprob=float("-inf"), top_token_ids=[5], top_logprobs=[-1.0])]
    usage = usage_dict(10, 2, 4)
    for kind, chunk_schema, body_schema in [("chat", "CreateChatCompletionStreamResponse", "CreateChatCompletionResponse"),
                                            ("completion", COMPLETION_CHUNK, "CreateCompletionResponse")]:
        for include_usage in (False, True):
            enc = StreamEncoder(kind, "id-1", 123, "tiny-llama", "fp_abc", include_usage)  # type: ignore[arg-type]
            if kind == "chat":
                lp: dict[str, Any] = {"content": chat_logprobs(entries, texts, 1), "refusal": None}
            else:
                lp = completion_logprobs(entries, texts, 1, 0).logprobs
            events = [enc.text(0, 'a "quoted"\n text', lp), enc.text(1, "é"), enc.finish(0, "stop")]
            if kind == "chat":
                events.insert(0, enc.role(0))
            if include_usage:
                events.append(enc.usage(usage))
            for event in events:
                assert event.startswith(b"data: ") and event.endswith(b"\n\n")
                obj = orjson.loads(event[6:])
                assert schemas.errors(chunk_schema, obj) == []
                assert ("usage" in obj) == (include_usage and (kind == "chat" or event is events[-1]))
            assert orjson.loads(events[-1][6:]).get("usage") == (usage if include_usage else None)
        choices: list[dict[str, Any]]
        if kind == "chat":
            choices = [{"index": 0, "message": {"role": "assistant", "content": "x", "refusal": None},
                        "logprobs": {"content": chat_logprobs(entries, texts, 2), "refusal": None},
                        "finish_reason": "length"}]
        else:
            choices = [{"index": 0, "text": "x", "logprobs": completion_logprobs(entries, texts, 2, 0).logprobs,
                        "finish_reason": "stop"}]
        body = orjson.loads(full_response(kind == "chat", "id-1", 1, "tiny-llama", "fp_abc", choices, usage))
        assert schemas.errors(body_schema, body) == []
    assert chat_logprobs(entries, texts, 1)[1]["logprob"] == -9999.0  # -inf has no JSON form
    assert DONE == b"data: [DONE]\n\n"
    assert schemas.errors("ErrorResponse", APIError(400, "m", param="p", code="c").to_dict()) == []


# --- admission off the event loop -------------------------------------------------------------------


async def _max_loop_lag_during(work: Any) -> tuple[float, float, Any]:
    """(largest event-loop stall in s, the work's duration in s, its outcome) while `work` is awaited,
    measured by a 1 ms ticker on the same loop."""
    import asyncio
    import time

    lags: list[float] = []
    done = False
    ticking = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)  # the probe's period
            now = time.perf_counter()
            lags.append(now - last)
            last = now
            ticking.set()

    probe = asyncio.ensure_future(ticker())
    await ticking.wait()
    start = time.perf_counter()
    try:
        outcome: Any = await work
    except APIError as err:
        outcome = err
    took = time.perf_counter() - start
    done = True
    await probe
    return max(lags), took, outcome


def test_prepare_tokenizes_off_the_event_loop(tiny_llama_dir: Path) -> None:
    import asyncio

    from pdserve.frontend.pipeline import Frontend

    words = "The quick brown fox jumps over the lazy dog, again and again; "
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": words * 12000}], "max_tokens": 1})

    def lag_of(inline_bytes: int) -> tuple[float, float, Any]:
        config = FrontendConfig(etcd_endpoints=("127.0.0.1:1",), models=(ModelSpec("m", str(tiny_llama_dir)),),
                                request_log=None, prepare_inline_bytes=inline_bytes, prepare_workers=2)
        fe = Frontend(config)  # its registry view is never started: a cluster without nodes
        try:
            return asyncio.run(_max_loop_lag_during(fe.admit("chat", fe.tenants.authenticate(None), body, {})))
        finally:
            fe.workers.close()

    inline_lag, inline_took, inline_err = lag_of(len(body))  # the whole body inline: the old behaviour
    lag, took, err = lag_of(0)
    # Either way the request is tokenized (the prompt is far over the context) and refused the same way.
    for e in (inline_err, err):
        assert isinstance(e, APIError) and e.code == "context_length_exceeded", e
        assert "resulted in 2" in e.message  # ~230k tokens counted
    assert inline_lag > 0.8 * inline_took > 0.05  # the probe sees a stall the length of the work
    assert lag < max(0.02, 0.25 * took), (lag, took, inline_lag)


# --- TTFT prediction ---------------------------------------------------------------------------------


def test_ttft_backlog_counts_the_prompts_leased_to_a_prefill_node() -> None:
    from pdserve.frontend.routing import Backlog
    from pdserve.frontend.ttft import TTFTEstimator

    router = make_router([member("d0"), member("p0", "prefill", queue=3)])
    est = TTFTEstimator()
    router.on_first_token = est.observe_lease
    first = router.route("m", list(range(100)), 4)
    assert first.prefill_target == "p0" and first.prompt_tokens == 100
    lease1 = router.lease(first)
    lease2 = router.lease(router.route("m", list(range(300)), 4))
    assert router.backlog(first) == Backlog(ours_tokens=400, reported_queue=3)
    assert lease2.work_ahead == 400  # 100 ahead of it plus its own 300
    assert est.estimate("m", router.backlog(first), 50) is None  # no sample yet: nothing to judge by
    lease1.prefill_done()  # its first token: a sample of 100 tokens over the time since its lease
    rate = est.rate("m")
    assert rate is not None and rate > 0
    assert router.prefill_tokens == {"p0": 300}
    lease2.release()  # ended without a first token: no sample, its tokens leave the backlog
    assert router.prefill_tokens == {} and est.rate("m") == rate
    lease1.release()


def test_ttft_estimate_prices_the_work_ahead() -> None:
    from pdserve.frontend.routing import Backlog
    from pdserve.frontend.ttft import TTFTEstimator

    est = TTFTEstimator()
    est.observe("x", 1000, 200, 2.0)  # 500 tokens/s, prompts of 200
    got = est.estimate("x", Backlog(ours_tokens=400, reported_queue=0), 100)
    assert got is not None and got.work_tokens == 500 and got.seconds == pytest.approx(1.0)
    # Another frontend's requests show only in the node's queue: priced at the mean prompt.
    got = est.estimate("x", Backlog(ours_tokens=0, reported_queue=5), 100)
    assert got is not None and got.work_tokens == 1100
    assert est.estimate("x", Backlog(0, 0), 100) is None  # nothing ahead: always admitted


def test_ttft_budget_comes_from_the_tenant_or_the_header() -> None:
    from pdserve.frontend.admission import TTFT_BUDGET_HEADER, ttft_budget_ms

    t = Tenant("t", frozenset({"*"}), TenantLimits(ttft_budget_ms=800))
    assert ttft_budget_ms(t, {}) == 800 and ttft_budget_ms(t, {TTFT_BUDGET_HEADER: "250.5"}) == 250.5
    assert ttft_budget_ms(tenant(), {}) is None
    for bad in ("0", "-3", "soon", "nan", "1e12"):
        err = api_error(lambda b=bad: ttft_budget_ms(t, {TTFT_BUDGET_HEADER: b}))  # type: ignore[misc]
        assert err.status == 400 and err.param == TTFT_BUDGET_HEADER


async def api_error_async(coro: Any) -> APIError:
    """The APIError `coro` raises (fails the test if it raises none)."""
    try:
        await coro
    except APIError as err:
        return err
    raise AssertionError("no APIError")


def test_prepare_workers_are_bounded_and_refuse_at_once() -> None:
    import asyncio
    import time

    from pdserve.frontend.workers import PrepareWorkers

    workers = PrepareWorkers(processes=1, queue_limit=1)

    async def scenario() -> list[object]:
        await workers.start()
        running = [asyncio.ensure_future(workers.run(time.sleep, 0.5)) for _ in range(2)]  # one runs, one waits
        await asyncio.sleep(0)  # one loop turn, not a timed wait: each run counts itself pending at once
        assert workers.pending == 2
        err = await api_error_async(workers.run(time.sleep, 0.5))
        return [err, *(await asyncio.gather(*running))]

    try:
        err, *results = asyncio.run(scenario())
    finally:
        workers.close()
    assert isinstance(err, APIError) and err.status == 503 and err.headers["retry-after"] == "1"
    assert results == [None, None] and workers.pending == 0


def test_prepare_workers_close_promptly_on_busy_cores() -> None:
    """A stopping frontend does not wait out its nice +19 workers' exit: beside busy processes that took
    17 s; close ends them after a second's grace."""
    import asyncio
    import subprocess
    import sys
    import time

    from pdserve.frontend.workers import PrepareWorkers

    workers = PrepareWorkers(processes=2, queue_limit=1)
    asyncio.run(workers.start())
    processes = list(workers._executor._processes.values())  # type: ignore[attr-defined]
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 2))]
    try:
        start = time.monotonic()
        workers.close()
        took = time.monotonic() - start
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert took < 8.0, took
    assert processes and not any(p.is_alive() for p in processes)


def test_prepare_worker_errors_and_deaths(tiny_llama_dir: Path) -> None:
    """An APIError raised in a worker reaches the caller whole; a worker that dies fails its job with 503
    and the pool serves the next job from fresh processes."""
    import asyncio
    import signal

    from pdserve.frontend.prepare import parse_request, tokenize
    from pdserve.frontend.protocol import RequestLimits
    from pdserve.frontend.workers import PrepareWorkers

    spec = ModelSpec("m", str(tiny_llama_dir))
    workers = PrepareWorkers(processes=1, queue_limit=4, models=(spec,))
    catalog = ModelCatalog((spec,))
    limits = RequestLimits()
    good = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello there"}]})

    async def scenario() -> tuple[APIError, APIError, list[int], list[int]]:
        await workers.start()
        bad = await api_error_async(workers.parse("chat", b'{"model": "m", "messages": [', limits))
        req = await workers.parse("chat", good, limits)
        ids = (await workers.tokenize(req, catalog.resolve("m"))).prompts[0]
        pid = await workers.run(os.getpid)
        died = await api_error_async(workers.run(os.kill, pid, signal.SIGKILL))
        again = (await workers.tokenize(req, catalog.resolve("m"))).prompts[0]
        return bad, died, ids, again

    try:
        bad, died, ids, again = asyncio.run(scenario())
    finally:
        workers.close()
    inline = parse_request("chat", good, limits)
    assert bad.status == 400 and bad.code and bad.message
    assert died.status == 503 and died.headers["retry-after"] == "1" and workers.restarts == 1
    assert ids == again == tokenize(inline, catalog.resolve("m")).prompts[0]
    assert workers.pending == 0


def test_serving_path_of_a_choice() -> None:
    from pdserve.frontend.job import Choice, Progress, serving_path

    def choice(prefill_id: str, node_said: int | None, tried: int = 1, migrations: int = 0) -> Choice:
        decision = RouteDecision("m", "d0", "addr", "", "least_loaded", prefill_id, "", "local", "", "fp")
        c = Choice(index=0, prompt_index=0, request_id="r", prompt_ids=[1], max_tokens=1,
                   params=pb.SamplingParams(), decision=decision, lease=None,  # type: ignore[arg-type]
                   tried=[f"d{i}" for i in range(tried)], migrations=migrations, progress=Progress())
        if node_said is not None:  # the decode node's first message says who prefilled the call
            c.progress.record(pb.GenerateResponse(token_ids=[5], serving_path=node_said), 1.0, migrated=False)
        return c

    disaggregated, local = pb.SERVING_PATH_DISAGGREGATED, pb.SERVING_PATH_LOCAL_PREFILL
    assert serving_path(choice("p0", disaggregated)) == "disaggregated"
    assert serving_path(choice("", local)) == "local_prefill"
    assert serving_path(choice("p0", local)) == "local_prefill"  # routed to p0, prefilled by the decode node
    assert serving_path(choice("p0", None)) == "local_prefill"  # no message: nothing was served remotely
    assert serving_path(choice("p0", disaggregated, tried=2)) == "retried"
    assert serving_path(choice("p0", disaggregated, tried=2, migrations=1)) == "migrated"


def test_proto_enums_speak_the_clusters_words() -> None:
    from pdserve.engine.stopping import FinishReason
    from pdserve.rpc.enums import (
        FINISH_REASONS,
        SERVING_PATHS,
        finish_reason_name,
        finish_reason_value,
        serving_path_name,
    )

    assert FINISH_REASONS == tuple(r.value for r in FinishReason)  # the engine's words are the proto's
    assert SERVING_PATHS == ("disaggregated", "local_prefill", "retried", "migrated")
    for name in FINISH_REASONS:
        assert finish_reason_name(finish_reason_value(name)) == name
    assert finish_reason_value(FinishReason.HAND_OVER) == pb.FINISH_REASON_HAND_OVER
    assert finish_reason_name(pb.FINISH_REASON_UNSPECIFIED) is None and finish_reason_value(None) == 0
    assert serving_path_name(pb.SERVING_PATH_MIGRATED) == "migrated" and serving_path_name(0) is None
    with pytest.raises(ValueError):
        finish_reason_value("migrate")
