"""The frontend as a real process against real etcd and scripted decode nodes (real gRPC servers that
stream pre-made tokens): the HTTP API through the official openai SDK, OpenAPI conformance of every
response and chunk, errors, tenants and limits, routing, cancellation, metrics and the request log."""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import orjson
import pytest
import tokenizers
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.version import NO_CHAT_TEMPLATE, chat_template_digest, pdserve_version, tokenizer_digest
from pdserve.frontend.tenants import hash_key
from pdserve.registry import EtcdServer
from pdserve.registry.etcd_server import free_port
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as pbg
from testing.bad_inputs import bad_inputs, check_bad_inputs
from testing.openapi import OpenAPISchemas
from testing.procs import FrontendProc, Proc, start_frontend, start_scripted_node
from testing.recording import AsyncRecordingTransport, RecordingTransport, conformance_problems
from testing.tls import issue, make_ca, new_key

pytestmark = pytest.mark.timeout(180)

REPLY = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs."
FAIL_SEED = 4242
HANDOVER_SEED = 7
KEYS = {t: f"sk-{t}-{'x' * 24}" for t in ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")}


@dataclass(eq=False)
class Env:
    """Everything the tests share: etcd, scripted nodes, the frontend and its request log."""

    frontend: FrontendProc
    nodes: dict[str, Proc]
    etcd: EtcdServer
    request_log: Path
    model_dir: Path
    reply_ids: list[int]
    tokenizer: tokenizers.Tokenizer
    schemas: OpenAPISchemas

    def reply_text(self, n: int, offset: int = 0) -> str:
        ids = self.reply_ids
        return self.tokenizer.decode([ids[(offset + i) % len(ids)] for i in range(n)])

    def log_records(self) -> list[dict[str, Any]]:
        data = self.request_log.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written is read on the next call
        return [orjson.loads(line) for line in complete.splitlines() if line.strip()]

    def record_for(self, request_id: str) -> dict[str, Any]:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            for rec in self.log_records():
                if rec.get("request_id") == request_id:
                    return rec
            time.sleep(0.02)  # the poll interval
        raise AssertionError(f"request {request_id} is not in the request log")


def write_configs(tmp: Path, model_dir: Path) -> tuple[Path, Path]:
    tenants = tmp / "tenants.yaml"
    limits: dict[str, dict[str, Any]] = {
        "alpha": {},
        "beta": {"input_tokens_per_minute": 400},
        "gamma": {"models": ["slow-llama"]},
        "delta": {"output_tokens_per_minute": 100},
        "epsilon": {"daily_token_quota": 60},
        "zeta": {"max_concurrent_requests": 1, "max_output_tokens": 20, "max_context_tokens": 200},
        "eta": {"output_tokens_per_minute": 60, "output_tokens_estimate": 8},  # far below the 4096 context
        "theta": {"max_concurrent_requests": 1},
    }
    entries = [{"name": name, "keys_sha256": [hash_key(KEYS[name])], **extra} for name, extra in limits.items()]
    tenants.write_bytes(orjson.dumps({"tenants": entries}))  # JSON is YAML
    models = tmp / "models.yaml"
    entries = [
        {"name": "tiny-llama", "path": str(model_dir), "aliases": ["gpt-test"]},
        {"name": "slow-llama", "path": str(model_dir)},
        {"name": "flaky-llama", "path": str(model_dir), "pool": "flaky"},
        {"name": "lonely", "path": str(model_dir), "pool": "lonely-pool", "fallback": "tiny-llama"},
        {"name": "orphan", "path": str(model_dir), "pool": "orphan-pool"},
        {"name": "fragile", "path": str(model_dir), "pool": "fragile-pool", "fallback": "tiny-llama"},
    ]
    models.write_bytes(orjson.dumps({"models": entries}))
    return tenants, models


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("frontend-http")
    tenants, models = write_configs(tmp, tiny_llama_dir)
    tok = tokenizers.Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    nodes: dict[str, Proc] = {}
    with EtcdServer(tmp / "etcd") as etcd:
        common = ["--tokenizer", str(tiny_llama_dir), "--reply", REPLY]
        try:
            nodes["main"] = start_scripted_node("scripted-main", tmp, etcd.endpoints, *common, "--model", "tiny-llama",
                                                "--node-id", "d", "--num-nodes", "2", "--prefill-ids", "p0,p1",
                                                "--fail-seed", str(FAIL_SEED), "--handover-seed", str(HANDOVER_SEED))
            nodes["slow"] = start_scripted_node("scripted-slow", tmp, etcd.endpoints, *common, "--model", "slow-llama",
                                                "--node-id", "slow", "--token-interval-ms", "40", "--reply-tokens",
                                                "100000", "--first-token-ms", "5")
            nodes["reject"] = start_scripted_node("scripted-reject", tmp, etcd.endpoints, *common, "--model", "flaky",
                                                  "--node-id", "a-reject", "--reject")
            nodes["fragile"] = start_scripted_node("scripted-fragile", tmp, etcd.endpoints, *common, "--model",
                                                   "fragile-pool", "--node-id", "fragile", "--reject")
            nodes["good"] = start_scripted_node("scripted-good", tmp, etcd.endpoints, *common, "--model", "flaky",
                                                "--node-id", "b-good")
            request_log = tmp / "requests.jsonl"
            fe = start_frontend("frontend", tmp, etcd.endpoints, free_port(), "--tenants", str(tenants),
                                "--models", str(models), "--request-log", str(request_log), "--max-body-bytes",
                                "65536", "--log-level", "warning")
            try:
                yield Env(fe, nodes, etcd, request_log, tiny_llama_dir,
                          tok.encode(REPLY, add_special_tokens=False).ids, tok, OpenAPISchemas())
            finally:
                assert_clean_exit(fe)
        finally:
            for proc in nodes.values():
                proc.stop()


def assert_clean_exit(fe: FrontendProc) -> None:
    # uvicorn re-raises the SIGTERM it handled once it has shut down gracefully.
    assert fe.stop() == 0, fe.proc.tail()
    log = fe.proc.log_text()
    assert "Traceback" not in log, fe.proc.tail(80)


def sdk(env: Env, tenant: str = "alpha") -> tuple[openai.OpenAI, RecordingTransport]:
    transport = RecordingTransport()
    client = openai.OpenAI(base_url=f"{env.frontend.base_url}/v1", api_key=KEYS[tenant], max_retries=0,
                           http_client=httpx.Client(transport=transport, timeout=30))
    return client, transport


def assert_conformant(env: Env, *transports: RecordingTransport | AsyncRecordingTransport) -> int:
    records = [r for t in transports for r in t.records]
    checked, problems = conformance_problems(env.schemas, records)
    assert problems == [], "\n".join(problems[:20])
    assert checked >= len(records) > 0
    return checked


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# --- the API through the openai SDK ---------------------------------------------------------------


def test_sdk_sync_chat_completion(env: Env) -> None:
    client, transport = sdk(env)
    resp = client.chat.completions.create(model="tiny-llama", messages=user("Hello"), max_tokens=6)
    choice = resp.choices[0]
    assert choice.message.content == env.reply_text(6) and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and resp.object == "chat.completion" and resp.model == "tiny-llama"
    assert resp.id.startswith("chatcmpl-") and resp.system_fingerprint == "fp_scripted00"
    assert resp.usage is not None and resp.usage.completion_tokens == 6 and resp.usage.prompt_tokens > 5
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 6

    # The reply runs out before max_tokens: a natural "stop". The alias serves the same model.
    full = client.chat.completions.create(model="gpt-test", messages=user("Hello"), max_completion_tokens=500)
    assert full.choices[0].finish_reason == "stop" and full.choices[0].message.content == env.reply_text(
        len(env.reply_ids))
    assert_conformant(env, transport)


def test_sdk_sync_chat_completion_stream(env: Env) -> None:
    client, transport = sdk(env)
    stream = client.chat.completions.create(model="tiny-llama", messages=user("Hello"), max_tokens=5, n=2,
                                            stream=True, stream_options={"include_usage": True}, seed=1,
                                            temperature=0.7)
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    texts: dict[int, str] = {0: "", 1: ""}
    first_seen: dict[int, Any] = {}
    finishes: dict[int, str] = {}
    for c in chunks[:-1]:
        (ch,) = c.choices
        first_seen.setdefault(ch.index, ch.delta)
        texts[ch.index] += ch.delta.content or ""
        if ch.finish_reason:
            finishes[ch.index] = ch.finish_reason
    assert all(delta.role == "assistant" for delta in first_seen.values())  # the first chunk carries the role
    assert finishes == {0: "length", 1: "length"}
    # Seeded sampling: choice i gets seed + i, so the two choices differ (the scripted node rotates by seed).
    assert texts[0] == env.reply_text(5, offset=1) and texts[1] == env.reply_text(5, offset=2)
    assert len({c.id for c in chunks}) == 1

    plain = list(client.chat.completions.create(model="tiny-llama", messages=user("Hi"), max_tokens=3, stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in plain) == env.reply_text(3)
    assert_conformant(env, transport)


def test_sdk_stop_strings(env: Env) -> None:
    client, transport = sdk(env)
    resp = client.chat.completions.create(model="tiny-llama", messages=user("x"), stop=["fox", "zzz"], max_tokens=50)
    text = env.reply_text(len(env.reply_ids))
    assert resp.choices[0].message.content == text[: text.index("fox")] and resp.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny-llama", messages=user("x"), stop="lazy", max_tokens=50, stream=True) if c.choices)
    assert streamed == text[: text.index("lazy")]
    assert_conformant(env, transport)


def test_sdk_logprobs(env: Env) -> None:
    client, transport = sdk(env)
    resp = client.chat.completions.create(model="tiny-llama", messages=user("x"), max_tokens=4, logprobs=True,
                                          top_logprobs=2)
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 for e in content)
    assert "".join(e.token for e in content) == resp.choices[0].message.content
    assert bytes(b for e in content for b in (e.bytes or [])).decode() == resp.choices[0].message.content
    assert content[0].logprob == -0.05 and content[0].top_logprobs[0].token == content[0].token

    comp = client.completions.create(model="tiny-llama", prompt="Once", max_tokens=4, logprobs=3)
    lp = comp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and "".join(lp.tokens) == comp.choices[0].text
    assert lp.text_offset == [0, *[sum(len(t) for t in lp.tokens[:i]) for i in range(1, 4)]]
    assert lp.top_logprobs is not None and all(len(d) == 3 for d in lp.top_logprobs)
    streamed_lp = [c.choices[0].logprobs for c in client.completions.create(
        model="tiny-llama", prompt="Once", max_tokens=4, logprobs=1, stream=True) if c.choices[0].logprobs]
    assert [t for lp in streamed_lp for t in lp.tokens] == lp.tokens  # type: ignore[union-attr]
    assert_conformant(env, transport)


def test_sdk_async_completions_prompt_forms_and_echo(env: Env) -> None:
    async def scenario() -> AsyncRecordingTransport:
        transport = AsyncRecordingTransport()
        client = openai.AsyncOpenAI(base_url=f"{env.frontend.base_url}/v1", api_key=KEYS["alpha"], max_retries=0,
                                    http_client=httpx.AsyncClient(transport=transport, timeout=30))
        ids = env.tokenizer.encode("Count to three", add_special_tokens=False).ids
        forms: list[Any] = ["Count to three", ["one", "two"], ids, [ids, ids[:2]]]
        for prompt in forms:
            resp = await client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=3, n=2)
            n_prompts = 2 if isinstance(prompt, list) and not isinstance(prompt[0], int) else 1
            assert [c.index for c in resp.choices] == list(range(2 * n_prompts))
            assert all(c.text == env.reply_text(3) for c in resp.choices) and resp.object == "text_completion"
            assert resp.usage is not None and resp.usage.completion_tokens == 6 * n_prompts
        resp = await client.completions.create(model="tiny-llama", prompt=ids, max_tokens=3)
        assert resp.usage is not None and resp.usage.prompt_tokens == len(ids)

        echoed = await client.completions.create(model="tiny-llama", prompt="Echo me", max_tokens=2, echo=True)
        assert echoed.choices[0].text == "Echo me" + env.reply_text(2)
        stream = await client.completions.create(model="tiny-llama", prompt="Echo me", max_tokens=2, echo=True,
                                                 stream=True, stream_options={"include_usage": True})
        parts = [c async for c in stream]
        assert "".join(c.choices[0].text for c in parts if c.choices) == "Echo me" + env.reply_text(2)
        assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == 2

        chat = await client.chat.completions.create(model="tiny-llama", messages=user("hi"), max_tokens=4, stream=True)
        assert "".join([c.choices[0].delta.content or "" async for c in chat]) == env.reply_text(4)
        await client.close()
        return transport

    transport = asyncio.run(scenario())
    assert_conformant(env, transport)


def test_sdk_raises_the_right_exception_classes(env: Env) -> None:
    client, transport = sdk(env)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny-llama", messages=user("x"), max_tokens=-1)
    assert bad.value.status_code == 400 and bad.value.param == "max_tokens" and bad.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-llama", messages=user("x"), stream=True, n=0)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=user("x"))
    assert missing.value.code == "model_not_found"

    wrong_key = openai.OpenAI(base_url=f"{env.frontend.base_url}/v1", api_key="sk-wrong", max_retries=0,
                              http_client=httpx.Client(transport=transport))
    with pytest.raises(openai.AuthenticationError) as auth:
        wrong_key.chat.completions.create(model="tiny-llama", messages=user("x"))
    assert auth.value.status_code == 401 and auth.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()

    gamma, gamma_transport = sdk(env, "gamma")
    with pytest.raises(openai.PermissionDeniedError) as denied:
        gamma.chat.completions.create(model="tiny-llama", messages=user("x"))
    assert denied.value.status_code == 403 and denied.value.code == "model_not_allowed"
    assert [m.id for m in gamma.models.list()] == ["slow-llama"]

    eps, eps_transport = sdk(env, "epsilon")
    with pytest.raises(openai.RateLimitError) as limited:
        eps.chat.completions.create(model="tiny-llama", messages=user("x"), max_tokens=100)
    assert limited.value.status_code == 429 and limited.value.code == "insufficient_quota"
    assert limited.value.response.headers["x-should-retry"] == "false"

    with pytest.raises(openai.InternalServerError) as unavailable:
        client.chat.completions.create(model="orphan", messages=user("x"))
    assert unavailable.value.status_code == 503 and unavailable.value.code == "no_route"

    # An error after the stream started arrives as an error event; the SDK raises it.
    stream = client.chat.completions.create(model="tiny-llama", messages=user("x"), max_tokens=10, stream=True,
                                            seed=FAIL_SEED, temperature=0.5)
    got = []
    with pytest.raises(openai.APIError, match="scripted failure"):
        for chunk in stream:
            got.append(chunk)
    assert got and got[0].choices[0].delta.role == "assistant"
    # The same with two choices, the second one failing (choice k runs with seed + k).
    with pytest.raises(openai.APIError, match="scripted failure"):
        list(client.chat.completions.create(model="tiny-llama", messages=user("x"), max_tokens=10, stream=True, n=2,
                                            seed=FAIL_SEED - 1, temperature=0.5))
    # Not streamed: the failure becomes the status of the response.
    with pytest.raises(openai.InternalServerError) as failed:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=10, seed=FAIL_SEED, temperature=0.5)
    assert failed.value.status_code == 502 and failed.value.code == "upstream_error"
    # Each failure moved the choice to the pool's other node, which failed it too, until the bound
    # (--max-migrations, default 2) was spent.
    assert "could not be moved to another decode node (2 migration(s) already)" in failed.value.message
    failed_rec = env.record_for(failed.value.response.headers["x-request-id"])
    # The request log names the OpenAI error (code, type, HTTP status) and the sampling the request set.
    assert (failed_rec["status"], failed_rec["error_code"], failed_rec["error_type"]) == (
        502, "upstream_error", failed.value.type)
    assert failed_rec["sampling"] == {"max_tokens": 10, "seed": FAIL_SEED, "temperature": 0.5}
    # ... and so do the tenant's error series (alpha is among the 20 tenants that keep their own label).
    metrics = httpx.get(f"{env.frontend.base_url}/metrics").text
    errors = {(s.labels["tenant"], s.labels["status"], s.labels["code"]): s.value
              for fam in text_string_to_metric_families(metrics) for s in fam.samples
              if s.name == "pdserve_frontend_tenant_errors_total" and s.labels["model"] == "tiny-llama"}
    assert errors[("alpha", "502", "upstream_error")] >= 1
    route = failed_rec["routes"][0]
    assert route["migrations"] == 2 and len(route["tried"]) == 3 and set(route["tried"]) == {"d-0", "d-1"}
    assert route["tried"][0] != route["tried"][1] != route["tried"][2]
    assert_conformant(env, transport, gamma_transport, eps_transport)


# --- bad input ------------------------------------------------------------------------------------


def raw_post(url: str, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(url, content=body, headers={"authorization": f"Bearer {KEYS['alpha']}",
                                                  "content-type": "application/json", **(headers or {})}, timeout=30)


def test_bad_input_gets_clean_4xx_never_500(env: Env) -> None:
    chat_url = f"{env.frontend.base_url}/v1/chat/completions"
    ok = {"model": "tiny-llama", "messages": user("hi")}
    cases = bad_inputs("tiny-llama", max_body_bytes=65536, context_tokens=4096)
    assert check_bad_inputs(env.frontend.base_url, KEYS["alpha"], cases, env.schemas) == []
    # The oversized body is refused from its declared length, and also without one (chunked upload).
    chunked = httpx.post(chat_url, content=iter([b'{"model": "tiny-llama", "pad": "' + b"x" * 70_000 + b'"}']),
                         headers={"authorization": f"Bearer {KEYS['alpha']}"}, timeout=30)
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    # Other routes and methods answer in the same error shape.
    assert httpx.get(f"{env.frontend.base_url}/v1/nothing").json()["error"]["type"] == "not_found_error"
    assert httpx.get(chat_url).status_code == 405
    # Unknown fields are ignored rather than rejected.
    resp = raw_post(chat_url, orjson.dumps({**ok, "max_tokens": 2, "brand_new_sdk_field": {"a": [1]}, "store": False}))
    assert resp.status_code == 200, resp.text
    rejected = [r for r in env.log_records() if r.get("request_id") is None]
    assert {r["status"] for r in rejected} >= {400, 404, 413}
    assert {r["tenant"] for r in rejected if r["status"] == 413} == {"alpha"}


# --- tenants and limits ---------------------------------------------------------------------------


def test_input_tpm_limit_429_while_another_tenant_is_served(env: Env) -> None:
    beta, beta_transport = sdk(env, "beta")
    alpha, alpha_transport = sdk(env, "alpha")
    big = user("lorem ipsum dolor sit amet " * 10)  # ~150 tokens; beta may send 400 per minute
    beta.chat.completions.create(model="tiny-llama", messages=big, max_tokens=2)
    beta.chat.completions.create(model="tiny-llama", messages=big, max_tokens=2)

    def beta_call() -> openai.RateLimitError:
        with pytest.raises(openai.RateLimitError) as info:
            beta.chat.completions.create(model="tiny-llama", messages=big, max_tokens=2)
        return info.value

    def alpha_calls() -> list[str]:
        return [alpha.chat.completions.create(model="tiny-llama", messages=big, max_tokens=3).choices[0].message.content
                or "" for _ in range(5)]

    with ThreadPoolExecutor(2) as pool:
        limited_f, served_f = pool.submit(beta_call), pool.submit(alpha_calls)
        limited, served = limited_f.result(), served_f.result()
    assert served == [env.reply_text(3)] * 5
    assert limited.code == "rate_limit_exceeded" and "input tokens per minute" in limited.message
    retry_after = int(limited.response.headers["retry-after"])
    assert 1 <= retry_after <= 60 and limited.response.headers["x-should-retry"] == "true"
    # A request larger than the whole bucket can never pass: a hard 429 that SDKs must not retry.
    with pytest.raises(openai.RateLimitError) as hard:
        beta.chat.completions.create(model="tiny-llama", messages=user("lorem ipsum " * 300), max_tokens=2)
    assert hard.value.code == "request_too_large" and hard.value.response.headers["x-should-retry"] == "false"
    assert_conformant(env, beta_transport, alpha_transport)


def test_output_budget_reserved_up_front_and_refunded(env: Env) -> None:
    delta, transport = sdk(env, "delta")  # 100 output tokens per minute
    for _ in range(3):
        # 80 reserved each time, 3 used: without the refund the second call would be refused.
        resp = delta.chat.completions.create(model="tiny-llama", messages=user("x"), max_tokens=80, stop="quick")
        assert resp.usage is not None and resp.usage.completion_tokens <= 3
    err = create_error(env, "delta", "tiny-llama", 101)
    assert isinstance(err, openai.RateLimitError) and err.code == "request_too_large"

    zeta, zeta_transport = sdk(env, "zeta")  # max_output_tokens 20, max_context_tokens 200, one at a time
    with pytest.raises(openai.BadRequestError) as too_many:
        zeta.chat.completions.create(model="tiny-llama", messages=user("x"), max_tokens=21)
    assert too_many.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as ctx:
        zeta.chat.completions.create(model="tiny-llama", messages=user("word " * 250), max_tokens=5)
    assert ctx.value.code == "context_length_exceeded"
    assert zeta.chat.completions.create(model="tiny-llama", messages=user("x")).usage.completion_tokens <= 20  # type: ignore[union-attr]

    # Concurrency: a second request while the first still streams is refused with Retry-After.
    zeta_slow = openai.OpenAI(base_url=f"{env.frontend.base_url}/v1", api_key=KEYS["zeta"], max_retries=0)
    stream = zeta_slow.chat.completions.create(model="slow-llama", messages=user("x"), max_tokens=20, stream=True)
    with pytest.raises(openai.RateLimitError) as busy:
        zeta.chat.completions.create(model="tiny-llama", messages=user("x"), max_tokens=3)
    assert busy.value.code == "concurrency_limit_exceeded" and busy.value.response.headers["retry-after"] == "1"
    list(stream)
    zeta.chat.completions.create(model="tiny-llama", messages=user("x"), max_tokens=3)
    assert_conformant(env, transport, zeta_transport)


def test_sdk_without_max_tokens_reserves_an_estimate_and_is_charged_what_it_used(env: Env) -> None:
    eta, transport = sdk(env, "eta")  # 60 output tokens per minute (1/s), estimate 8, context 4096
    started = time.monotonic()
    # The SDK sends no max_tokens: the request may generate up to the context, yet it is admitted (it
    # reserves the estimate, not the 4000-odd tokens left in the context).
    resp = eta.chat.completions.create(model="tiny-llama", messages=user("x"))
    assert resp.choices[0].finish_reason == "stop"
    used = resp.usage.completion_tokens if resp.usage else 0
    assert used == len(env.reply_ids) > 8
    # Charged what it generated (33), not the estimate (8): 40 is more than what is left.
    with pytest.raises(openai.RateLimitError) as err:
        eta.chat.completions.create(model="tiny-llama", messages=user("x"), max_tokens=40)
    assert err.value.code == "rate_limit_exceeded" and err.value.response.headers["x-should-retry"] == "true"
    available = int(str(err.value.message).split("available ")[1].split(".")[0])
    refilled = time.monotonic() - started + 1  # one token per second since the first charge
    assert 60 - used <= available <= 60 - used + refilled
    # The bucket is low but a request without max_tokens still gets in while it holds its estimate.
    assert eta.chat.completions.create(model="tiny-llama", messages=user("x")).choices[0].message.content
    assert_conformant(env, transport)


def test_concurrency_one_shared_by_four_frontends_admits_one_in_total(env: Env, tmp_path: Path) -> None:
    tenants, models = write_configs(tmp_path, env.model_dir)
    frontends: list[FrontendProc] = []
    try:
        for i in range(4):
            frontends.append(start_frontend(f"share-{i}", tmp_path, env.etcd.endpoints, free_port(), "--tenants",
                                            str(tenants), "--models", str(models), "--limit-share", "4",
                                            "--limit-share-index", str(i), "--request-log", "off",
                                            "--log-level", "warning"))
        clients = [openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key=KEYS["theta"], max_retries=0)
                   for fe in frontends]
        # Two long streams per frontend, all open at once: the tenant's one slot is held by one of them.
        streams, refused = [], []
        for client in clients * 2:
            try:
                streams.append(client.chat.completions.create(model="slow-llama", messages=user("x"),
                                                              max_tokens=50, stream=True))
            except openai.RateLimitError as err:
                refused.append(err)
        assert len(streams) == 1 and len(refused) == 7
        assert all(e.response.headers["retry-after"] == "1" and e.response.headers["x-should-retry"] == "true"
                   for e in refused)
        for stream in streams:
            stream.close()
    finally:
        for fe in frontends:
            assert_clean_exit(fe)
    assert any("no share of these tenant limits here" in fe.proc.log_text() and "theta" in fe.proc.log_text()
               for fe in frontends[1:])


def create_error(env: Env, tenant: str, model: str, max_tokens: int) -> Exception | None:
    client, _ = sdk(env, tenant)
    try:
        client.chat.completions.create(model=model, messages=user("x"), max_tokens=max_tokens)
    except openai.APIStatusError as err:
        return err
    return None


# --- cancellation, routing, fallback ----------------------------------------------------------------


def node_stub(proc: Proc, node_id: str) -> tuple[grpc.Channel, pbg.DecodeNodeStub]:
    """A gRPC stub for a scripted node, found from the address it printed."""
    lines = proc.log_text().splitlines()
    address = next(line.split()[-1] for line in lines if line.startswith(f"scripted decode node {node_id} "))
    channel = grpc.insecure_channel(address)
    return channel, pbg.DecodeNodeStub(channel)


@pytest.mark.serial  # the abort within 100 ms
def test_client_disconnect_aborts_upstream_within_100ms(env: Env) -> None:
    client, _ = sdk(env)
    channel, stub = node_stub(env.nodes["slow"], "slow")

    def running() -> int:
        return stub.GetLoad(pb.LoadRequest(), timeout=5).running

    def kv_used() -> int:
        return stub.GetLoad(pb.LoadRequest(), timeout=5).kv_blocks_used

    with channel:
        for streaming in (True, False):
            if streaming:
                stream = client.chat.completions.create(model="slow-llama", messages=user("x"), max_tokens=1000,
                                                        stream=True)
                it = iter(stream)
                next(it), next(it), next(it)
                assert running() == 1 and kv_used() > 0
                t0 = time.perf_counter()
                stream.close()
            else:
                # A non-streamed request whose client gives up (socket closed) is aborted as well.
                sock = socket.create_connection((env.frontend.host, env.frontend.port))
                body = orjson.dumps({"model": "slow-llama", "messages": user("x"), "max_tokens": 1000})
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             b"authorization: Bearer " + KEYS["alpha"].encode() + b"\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                deadline = time.monotonic() + 5
                while running() == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)  # the poll interval
                assert running() == 1
                t0 = time.perf_counter()
                sock.close()
            while running() != 0:
                assert time.perf_counter() - t0 < 2.0, "the upstream request was not cancelled"
                time.sleep(0.001)  # the poll interval (1 ms: the abort's latency is measured)
            elapsed = time.perf_counter() - t0
            print(f"{'streamed' if streaming else 'non-streamed'}: upstream aborted {elapsed * 1e3:.1f} ms after the disconnect")
            assert elapsed < 0.1, f"upstream still running {elapsed * 1e3:.1f} ms after the disconnect"
            assert kv_used() == 0  # its blocks are free again
    disconnects = [r for r in env.log_records() if r.get("status") == 499 and r.get("model") == "slow-llama"]
    assert len(disconnects) == 2 and all(r["routes"][0]["decode_node"] == "slow" for r in disconnects)


def test_shared_prefixes_meet_on_one_prefill_node_unrelated_prompts_spread(env: Env) -> None:
    client, _ = sdk(env)
    ids = env.tokenizer.encode("alpha beta gamma delta epsilon zeta eta theta iota kappa " * 80,
                               add_special_tokens=False).ids[:512]
    system = env.tokenizer.decode(ids)
    shared = []
    for i in range(20):
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-llama", max_tokens=2,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}])
        shared.append(env.record_for(raw.headers["x-request-id"]))
    prefill_nodes = {r["routes"][0]["prefill_node"] for r in shared}
    assert len(prefill_nodes) == 1, prefill_nodes
    assert all("prefix affinity" in r["routes"][0]["prefill_reason"] for r in shared)
    assert all(r["routes"][0]["served_by"]["prefill"] in prefill_nodes for r in shared)
    assert all(r["prompt_tokens"] > 500 for r in shared)

    unrelated = []
    for i in range(20):
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-llama", max_tokens=2, messages=user(f"{i} unrelated topic number {i * 7919} " * 3))
        unrelated.append(env.record_for(raw.headers["x-request-id"]))
    assert {r["routes"][0]["prefill_node"] for r in unrelated} == {"p0", "p1"}
    assert {r["routes"][0]["decode_node"] for r in shared + unrelated} == {"d-0", "d-1"}


def test_a_session_key_pins_the_decode_node_across_prompts(env: Env) -> None:
    client, _ = sdk(env)
    pinned = set()
    for i in range(6):
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-llama", max_tokens=2, messages=user(f"turn {i}"), extra_headers={"x-session-id": "conv-42"})
        rec = env.record_for(raw.headers["x-request-id"])
        assert "session affinity" in rec["routes"][0]["decode_reason"]
        pinned.add(rec["routes"][0]["decode_node"])
    assert len(pinned) == 1


def test_unreachable_node_is_retried_and_fallback_model_serves(env: Env) -> None:
    client, transport = sdk(env)
    retries = frontend_metric(env, "pdserve_frontend_upstream_retries_total", model="flaky-llama")
    tried = []
    for _ in range(2):  # idle nodes take turns, so one of two requests goes to the refusing node first
        raw = client.chat.completions.with_raw_response.create(model="flaky-llama", messages=user("x"), max_tokens=3)
        assert raw.parse().choices[0].message.content == env.reply_text(3)
        rec = env.record_for(raw.headers["x-request-id"])
        assert rec["routes"][0]["decode_node"] == "b-good"
        tried.append(rec["routes"][0]["tried"])
    assert ["a-reject", "b-good"] in tried
    assert frontend_metric(env, "pdserve_frontend_upstream_retries_total", model="flaky-llama") - retries == \
        sum(len(t) - 1 for t in tried)  # one retry counted per node that failed a choice before its first token

    raw = client.chat.completions.with_raw_response.create(model="lonely", messages=user("x"), max_tokens=3)
    resp = raw.parse()
    assert resp.model == "tiny-llama" and raw.headers["x-pdserve-model"] == "tiny-llama"
    rec = env.record_for(raw.headers["x-request-id"])
    assert rec["requested_model"] == "lonely" and "fallback" in rec["fallback"]
    assert_conformant(env, transport)


def frontend_metric(env: Env, sample: str, **labels: str) -> float:
    text = httpx.get(f"{env.frontend.base_url}/metrics").text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_handed_over_stream_continues_on_the_other_node(env: Env) -> None:
    """Injects the drain hand-over: the decode node ends the stream after two tokens with finish_reason
    HAND_OVER. The frontend resumes the choice on the other node (resume_token_ids checked by that node)
    and the client sees the text of an uninterrupted run, one finish and usage counting every token once."""
    client, transport = sdk(env)
    before = frontend_metric(env, "pdserve_frontend_migrations_total", model="tiny-llama", reason="hand_over")
    # The scripted reply is rotated by seed mod its length: this seed gives the same text, never handed over.
    same_text_seed = HANDOVER_SEED + len(env.reply_ids)
    for endpoint in ("chat", "completions"):
        texts, usages = [], []
        for seed in (HANDOVER_SEED, same_text_seed):
            if endpoint == "chat":
                chunks = list(client.chat.completions.create(
                    model="tiny-llama", messages=user("x"), max_tokens=12, temperature=0.7, seed=seed, stream=True,
                    stream_options={"include_usage": True}))
                texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
                assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
                    ["length"]
                usages.append(chunks[-1].usage.completion_tokens)
                request_id = chunks[0].id
            else:
                raw = client.completions.with_raw_response.create(model="tiny-llama", prompt="x", max_tokens=12,
                                                                  temperature=0.7, seed=seed)
                resp = raw.parse()
                texts.append(resp.choices[0].text)
                assert resp.choices[0].finish_reason == "length"
                usages.append(resp.usage.completion_tokens)
                request_id = raw.headers["x-request-id"]
            route = env.record_for(request_id)["routes"][0]
            assert len(route["tried"]) == (2 if seed == HANDOVER_SEED else 1), route
            assert route["migrations"] == (1 if seed == HANDOVER_SEED else 0)
        assert texts[0] == texts[1] and len(texts[0]) > 0
        assert usages == [12, 12]
    # Two choices (choice k samples with seed + k): only choice 0 is handed over; both streams stay whole.
    texts2 = []
    for seed in (HANDOVER_SEED, same_text_seed):
        chunks = list(client.chat.completions.create(model="tiny-llama", messages=user("x"), max_tokens=12, n=2,
                                                     temperature=0.7, seed=seed, stream=True,
                                                     stream_options={"include_usage": True}))
        by_choice = ["", ""]
        for c in chunks:
            for ch in c.choices:
                by_choice[ch.index] += ch.delta.content or ""
        texts2.append(by_choice)
        assert chunks[-1].usage.completion_tokens == 24
    assert texts2[0] == texts2[1] and texts2[0][0] == texts[0] and texts2[0][0] != texts2[0][1]
    after = frontend_metric(env, "pdserve_frontend_migrations_total", model="tiny-llama", reason="hand_over")
    assert after - before == 3
    assert_conformant(env, transport)


def test_runtime_fallback_when_every_node_of_the_pool_fails_at_open(env: Env) -> None:
    """Injects a pool whose only decode node refuses every Generate call (UNAVAILABLE) although it is
    registered and unloaded, so admission routes to it: the fallback model serves the request."""
    client, transport = sdk(env)
    for stream in (False, True):
        raw = client.chat.completions.with_raw_response.create(model="fragile", messages=user("x"), max_tokens=3,
                                                               stream=stream)
        assert raw.headers["x-pdserve-model"] == "tiny-llama"
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        else:
            resp = raw.parse()
            assert resp.model == "tiny-llama"
            text = resp.choices[0].message.content
        assert text == env.reply_text(3)
        rec = env.record_for(raw.headers["x-request-id"])
        assert rec["requested_model"] == "fragile" and rec["model"] == "tiny-llama"
        assert "failed the request" in rec["fallback"] and "fallback 'tiny-llama'" in rec["fallback"]
        assert rec["routes"][0]["decode_node"] in ("d-0", "d-1")
    assert_conformant(env, transport)


def test_deadline_mid_stream_is_not_migrated(env: Env, tmp_path: Path) -> None:
    """Injects: the request's deadline (--request-timeout 1) passing while the slow node streams. A deadline
    is the request's own end, not a node failure: the client gets the timeout error, nothing moves."""
    fe = start_frontend("frontend-deadline", tmp_path, env.etcd.endpoints, free_port(), "--models",
                        str(env.request_log.parent / "models.yaml"),
                        "--request-timeout", "1", "--request-log", "off", "--log-level", "warning")
    try:
        client = openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key="any", max_retries=0)
        got = []
        with pytest.raises(openai.APIError) as timed_out:
            for chunk in client.chat.completions.create(model="slow-llama", messages=user("x"), max_tokens=1000,
                                                        stream=True):
                got.append(chunk)
        assert got and timed_out.value.code == "timeout" and "timed out" in timed_out.value.message
        metrics = httpx.get(f"{fe.base_url}/metrics").text
        assert "pdserve_frontend_migrations_total{" not in metrics
    finally:
        assert_clean_exit(fe)


# --- operations -----------------------------------------------------------------------------------


def model_entry(env: Env, model: str) -> dict[str, Any]:
    """/v1/models/<model> as JSON."""
    return dict(httpx.get(f"{env.frontend.base_url}/v1/models/{model}",
                          headers={"authorization": f"Bearer {KEYS['alpha']}"}).json())


def test_models_lists_every_name_and_describes_what_it_serves(env: Env) -> None:
    client, transport = sdk(env)
    ids = [m.id for m in client.models.list()]
    assert {"tiny-llama", "gpt-test", "slow-llama", "lonely"} <= set(ids)
    assert client.models.retrieve("gpt-test").id == "gpt-test"
    # Versions: what each name serves, as extra fields (the spec's Model allows them).
    tok = Tokenizer(env.model_dir)
    entry = model_entry(env, "tiny-llama")
    assert entry["pool"] == "tiny-llama" and entry["max_model_len"] > 0
    assert entry["tokenizer_digest"] == tokenizer_digest(tok)
    assert entry["chat_template_digest"] == chat_template_digest(tok.chat_template) != NO_CHAT_TEMPLATE
    assert entry["pdserve_version"] == pdserve_version() and entry["model_fingerprint"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    assert_conformant(env, transport)


def test_health_is_ok(env: Env) -> None:
    assert httpx.get(f"{env.frontend.base_url}/health").json() == {"status": "ok"}


def test_ready_says_which_pools_can_serve(env: Env) -> None:
    ready = httpx.get(f"{env.frontend.base_url}/ready")
    assert ready.status_code == 200 and ready.json()["models"]["tiny-llama"] == {
        "pool": "tiny-llama", "prefill": 2, "decode": 2, "ready": True}
    assert ready.json()["models"]["slow-llama"]["ready"] is False  # a decode node but no prefill node


def test_metrics_name_the_series_of_a_served_request(env: Env) -> None:
    client, _ = sdk(env)
    entry = model_entry(env, "tiny-llama")
    client.chat.completions.create(model="tiny-llama", messages=user("metrics"), max_tokens=3)
    metrics = httpx.get(f"{env.frontend.base_url}/metrics").text
    for needle in ['pdserve_frontend_tokens_total{kind="prompt",model="tiny-llama",node=',
                   'pdserve_frontend_ttft_seconds_bucket{le="0.005",model="tiny-llama"',
                   'pdserve_frontend_requests_total{endpoint="chat.completions",finish_reason="length",model="tiny-llama"',
                   "# TYPE pdserve_frontend_rate_limited_total counter", 'pdserve_frontend_slo_requests_total{met="true",model="tiny-llama"',
                   'slo="both"', "pdserve_frontend_goodput_tokens_total{", 'pdserve_ttft_breakdown_seconds_count{',
                   'stage="prefill"', 'stage="frontend"', 'pool="frontend"',
                   "pdserve_frontend_itl_seconds_count", "pdserve_frontend_route_decisions_total{",
                   'pdserve_build_info{node="', f'version="{pdserve_version()}"',
                   f'pdserve_model_info{{chat_template="{entry["chat_template_digest"]}"',
                   f'tokenizer="{entry["tokenizer_digest"]}"',
                   'pdserve_frontend_request_input_tokens_bucket{le="16.0",model="tiny-llama",model_pool="tiny-llama"',
                   'pdserve_frontend_request_output_tokens_bucket{le="32768.0",model="tiny-llama",model_pool="tiny-llama"',
                   'pdserve_frontend_tenant_requests_total{model="tiny-llama",node=',
                   'pdserve_frontend_tenant_ttft_seconds_bucket{le="0.005",model="tiny-llama",node=']:
        assert needle in metrics, needle
    # The token-length histograms: one observation per finished request, 3 completion tokens here.
    samples = {(s.name, s.labels.get("le", "")): s.value for fam in text_string_to_metric_families(metrics)
               for s in fam.samples if s.labels.get("model") == "tiny-llama"
               and s.name.startswith(("pdserve_frontend_request_output_tokens", "pdserve_frontend_request_input_tokens"))}
    for kind in ("input", "output"):
        count = samples[(f"pdserve_frontend_request_{kind}_tokens_count", "")]
        assert count >= 1 and samples[(f"pdserve_frontend_request_{kind}_tokens_bucket", "+Inf")] == count
    assert samples[("pdserve_frontend_request_output_tokens_bucket", "16.0")] >= 1  # short replies
    assert 'tenant="alpha"' in "".join(line for line in metrics.splitlines()
                                        if line.startswith("pdserve_frontend_tenant_requests_total{"))


def test_request_log_line_describes_the_request_without_its_prompt(env: Env) -> None:
    client, _ = sdk(env)
    entry = model_entry(env, "tiny-llama")
    raw = client.chat.completions.with_raw_response.create(model="tiny-llama", messages=user("metrics"),
                                                           max_tokens=3)
    rec = env.record_for(raw.headers["x-request-id"])
    assert rec["tenant"] == "alpha" and rec["model"] == "tiny-llama" and rec["finish_reasons"] == ["length"]
    assert rec["key_sha256"] == hash_key(KEYS["alpha"])[:16] and KEYS["alpha"] not in env.request_log.read_text()
    assert rec["completion_tokens"] == 3 and rec["ttft_ms"] > 0 and rec["e2e_ms"] >= rec["ttft_ms"]
    assert set(rec["ttft_breakdown_ms"]) >= {"frontend", "prefill_queue", "prefill", "transfer", "first_decode_step"}
    assert rec["routes"][0]["decode_node"] in ("d-0", "d-1") and rec["routes"][0]["timing_ms"]["prefill"] >= 0
    assert "prompt" not in rec and "metrics" not in env.request_log.read_text()  # no prompt text by default
    assert rec["model_fingerprint"] == entry["model_fingerprint"] and rec["pdserve_version"] == pdserve_version()
    assert (rec["tokenizer_digest"], rec["chat_template_digest"]) == (entry["tokenizer_digest"],
                                                                        entry["chat_template_digest"])
    assert rec["sampling"] == {"max_tokens": 3} and rec["error_code"] is None and rec["error_type"] is None
    # Every sampling parameter the request set, under the field's own name; stop sequences only as "given".
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=user("sampled"), max_completion_tokens=4, temperature=0.3, top_p=0.9, n=2,
        seed=11, presence_penalty=0.5, frequency_penalty=0.25, stop=["zqzqzq"])
    rec = env.record_for(raw.headers["x-request-id"])
    assert rec["sampling"] == {"max_completion_tokens": 4, "temperature": 0.3, "top_p": 0.9, "n": 2, "seed": 11,
                               "presence_penalty": 0.5, "frequency_penalty": 0.25, "stop": True}
    assert "zqzqzq" not in env.request_log.read_text() and "sampled" not in env.request_log.read_text()


def _tenant_series(fe: FrontendProc) -> dict[tuple[str, str], float]:
    """(metric sample name, tenant) -> value of the per-tenant request counter and TTFT histogram count."""
    text = httpx.get(f"{fe.base_url}/metrics", timeout=10).text
    return {(s.name, s.labels["tenant"]): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name in ("pdserve_frontend_tenant_requests_total",
                                               "pdserve_frontend_tenant_ttft_seconds_count")}


def test_per_tenant_series_keep_only_the_top_tenants_the_rest_are_other(env: Env, tmp_path: Path) -> None:
    """With --metrics-tenant-series 1 one tenant holds its own label: the first comes, others count as
    "other" until one has more than twice its requests, which takes the label (the old one's series go)."""
    tenants, models = write_configs(tmp_path, env.model_dir)
    fe = start_frontend("tenant-series", tmp_path, env.etcd.endpoints, free_port(), "--tenants", str(tenants),
                        "--models", str(models), "--request-log", "off", "--metrics-tenant-series", "1")

    def ask(tenant: str) -> None:
        client = openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key=KEYS[tenant], max_retries=0)
        client.chat.completions.create(model="tiny-llama", messages=user("x"), max_tokens=2)

    req, ttft = "pdserve_frontend_tenant_requests_total", "pdserve_frontend_tenant_ttft_seconds_count"
    try:
        for tenant in ("alpha", "alpha", "theta"):
            ask(tenant)
        assert _tenant_series(fe) == {(req, "alpha"): 2, (req, "other"): 1, (ttft, "alpha"): 2, (ttft, "other"): 1}
        for _ in range(4):  # theta: 5 requests > 2 x alpha's 2, its fifth takes the label
            ask("theta")
        assert _tenant_series(fe) == {(req, "theta"): 1, (req, "other"): 4, (ttft, "theta"): 1, (ttft, "other"): 4}
        ask("alpha")  # 3 requests, not more than twice theta's 5: "other"
        assert _tenant_series(fe) == {(req, "theta"): 1, (req, "other"): 5, (ttft, "theta"): 1, (ttft, "other"): 5}
    finally:
        assert_clean_exit(fe)


def _reloads(fe: FrontendProc, outcome: str) -> float:
    verify = ssl.create_default_context(cafile=fe.ca) if fe.ca else True
    text = httpx.get(f"{fe.base_url}/metrics", timeout=10, verify=verify).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "pdserve_frontend_config_reloads_total" and s.labels.get("outcome") == outcome)


def test_tenants_file_reloads_live(env: Env, tmp_path: Path) -> None:
    """A key revoked in the tenants file is refused within 2 s (two 1 s polls) while the frontend keeps
    serving the others, the revoked tenant's stream in flight included; a key added works as soon; a file
    that cannot be read keeps the table in force, with a log line and the error counter."""
    tenants, models = write_configs(tmp_path, env.model_dir)
    fe = start_frontend("tenants-live", tmp_path, env.etcd.endpoints, free_port(), "--tenants", str(tenants),
                        "--models", str(models), "--request-log", "off")

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key=key, max_retries=0)

    def reply(key: str) -> str | None:
        return client(key).chat.completions.create(model="tiny-llama", messages=user("x"),
                                                   max_tokens=2).choices[0].message.content

    def rewrite(data: bytes) -> None:
        (tmp_path / "next.yaml").write_bytes(data)
        (tmp_path / "next.yaml").replace(tenants)  # atomically, as a config-map update or an editor does

    try:
        assert reply(KEYS["alpha"]) == reply(KEYS["beta"]) == env.reply_text(2)
        stream = client(KEYS["alpha"]).chat.completions.create(model="slow-llama", messages=user("x"),
                                                               max_tokens=20, stream=True)
        chunks = iter(stream)
        next(chunks)  # alpha has a request in flight when its key is revoked
        newcomer = "sk-newcomer-" + "n" * 24
        entries = [e for e in orjson.loads(tenants.read_bytes())["tenants"] if e["name"] != "alpha"]
        rewrite(orjson.dumps({"tenants": [*entries, {"name": "newcomer", "keys_sha256": [hash_key(newcomer)]}]}))
        start = time.monotonic()
        while True:
            try:
                reply(KEYS["alpha"])
            except openai.AuthenticationError as err:
                assert err.body["code"] == "invalid_api_key"  # type: ignore[index]
                break
            assert time.monotonic() - start < 2.5, "the revoked key is still admitted"
            time.sleep(0.05)
        assert reply(KEYS["beta"]) == reply(newcomer) == env.reply_text(2)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["length"]  # the revoked tenant's stream in flight ran to its end
        rewrite(b"tenants: [ {name: broken")  # a syntax error while live
        deadline = time.monotonic() + 5
        while _reloads(fe, "error") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert reply(KEYS["beta"]) == reply(newcomer) == env.reply_text(2)
        with pytest.raises(openai.AuthenticationError):
            reply(KEYS["alpha"])
        assert _reloads(fe, "ok") == 1
        assert "cannot be used; keeping the tenants in force" in fe.proc.log_text()
        assert "added ['newcomer'], removed ['alpha']" in fe.proc.log_text()
    finally:
        assert_clean_exit(fe)


def _served_serial(fe: FrontendProc) -> int:
    """The serial of the certificate a new TLS connection to the frontend gets."""
    ctx = ssl.create_default_context(cafile=fe.ca)
    with socket.create_connection((fe.host, fe.port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname=fe.host) as tls:
        return int(tls.getpeercert()["serialNumber"], 16)  # type: ignore[index, arg-type]


def test_https_with_the_clusters_ca_and_a_renewed_certificate(env: Env, tmp_path: Path) -> None:
    """The openai SDK over HTTPS trusting the cluster's CA; plain HTTP and an untrusted client get no
    answer; a renewed certificate is served to new connections within 2 s; a renewal that cannot be used
    (expired, or another key's) keeps the one in force, with the error counter."""
    tenants, models = write_configs(tmp_path, env.model_dir)
    ca = make_ca(tmp_path)
    key = new_key(tmp_path / "tls.key")
    first = issue(ca, key, tmp_path / "tls.pem")
    fe = start_frontend("tls", tmp_path, env.etcd.endpoints, free_port(), "--tenants", str(tenants), "--models",
                        str(models), "--request-log", "off", "--tls-cert", str(tmp_path / "tls.pem"), "--tls-key",
                        str(tmp_path / "tls.key"), tls_ca=ca.path)
    try:
        assert fe.base_url.startswith("https://")
        client = openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key=KEYS["alpha"], max_retries=0,
                               http_client=httpx.Client(verify=ssl.create_default_context(cafile=ca.path)))
        reply = client.chat.completions.create(model="tiny-llama", messages=user("x"), max_tokens=2)
        assert reply.choices[0].message.content == env.reply_text(2)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://{fe.host}:{fe.port}/health", timeout=5)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{fe.base_url}/health", timeout=5)  # the system's CAs do not know the cluster's
        assert _served_serial(fe) == first

        def renew(valid_from_h: float = -1.0, with_key: Any = key) -> int:
            serial = issue(ca, with_key, tmp_path / "next.pem", valid_from_h=valid_from_h)
            (tmp_path / "next.pem").replace(tmp_path / "tls.pem")
            return serial

        second = renew()
        deadline = time.monotonic() + 3
        while _served_serial(fe) != second:
            assert time.monotonic() < deadline, "the renewed certificate is not served"
            time.sleep(0.1)
        assert client.models.list().data
        renew(valid_from_h=-48.0)  # expired (valid for 24 h from two days ago)
        renew_other = new_key(tmp_path / "other.key")
        deadline = time.monotonic() + 5
        while _reloads(fe, "error") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        renew(with_key=renew_other)  # a certificate that is not the served key's
        deadline = time.monotonic() + 5
        while _reloads(fe, "error") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert _served_serial(fe) == second and client.models.list().data
        log = fe.proc.log_text()
        assert "expired at" in log and "does not go with certificate" in log and "TLS certificate reloaded" in log
        client.close()  # an idle TLS connection would hold the graceful stop until its close_notify times out
    finally:
        assert_clean_exit(fe)


def test_tls_start_up_errors_are_clear(tmp_path: Path) -> None:
    ca = make_ca(tmp_path)
    key = new_key(tmp_path / "k.pem")
    issue(ca, key, tmp_path / "expired.pem", valid_from_h=-48.0)
    issue(ca, key, tmp_path / "future.pem", valid_from_h=24.0)
    issue(ca, key, tmp_path / "good.pem")
    cases = {
        ("expired.pem", "k.pem"): "expired at",
        ("future.pem", "k.pem"): "is not valid before",
        ("good.pem", "missing.pem"): "No such file",
        ("missing.pem", "k.pem"): "No such file",
        ("good.pem", ""): "--tls-cert and --tls-key go together",
        ("k.pem", "k.pem"): "not a PEM certificate",
    }
    for (cert, key_file), message in cases.items():
        args = ["--tls-cert", str(tmp_path / cert)] + (["--tls-key", str(tmp_path / key_file)] if key_file else [])
        done = subprocess.run([sys.executable, "-m", "pdserve.frontend", "--etcd", "127.0.0.1:9", *args],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, (cert, key_file, done.stderr[-500:])


def test_local_mode_accepts_any_key_and_says_so(env: Env, tmp_path: Path) -> None:
    log_path = tmp_path / "local.jsonl"
    fe = start_frontend("frontend-local", tmp_path, env.etcd.endpoints, free_port(), "--model",
                        f"tiny-llama={env.model_dir}", "--request-log", str(log_path), "--log-prompts")
    try:
        for key in ("anything", "sk-whatever"):
            client = openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key=key, max_retries=0)
            assert client.chat.completions.create(model="tiny-llama", messages=user("x"),
                                                  max_tokens=2).choices[0].message.content == env.reply_text(2)
        no_key = httpx.post(f"{fe.base_url}/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 1})
        assert no_key.status_code == 200
    finally:
        assert_clean_exit(fe)
    assert "NO TENANTS FILE" in fe.proc.log_text()
    records = [orjson.loads(line) for line in log_path.read_bytes().splitlines()]
    assert [r["tenant"] for r in records] == ["local"] * 3
    assert records[0]["prompt"] == user("x") and records[2]["prompt"] == ["x"]  # --log-prompts
