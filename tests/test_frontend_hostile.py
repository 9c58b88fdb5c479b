"""Hostile input against a frontend with a real local cluster behind it (etcd, one prefill and one decode
node running the tiny llama): invalid UTF-8, 10k-deep JSON, a 100 MB body (declared and chunked), a body
trickled over 60 s (cut at the frontend's body timeout, 2 s here), 10,000 stop strings, 100,000 messages,
oversized headers, stop strings and prompts. Every answer is a 4xx in the OpenAI error shape, never a 5xx,
and the server answers a normal request (through the openai SDK) after each one.

Then a schemathesis fuzz run against the frontend's own OpenAPI document (/openapi.json, built from the
vendored OpenAI spec): a bounded number of generated requests per operation, no 5xx, every error in the
OpenAI shape, and the server fine afterwards.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import checks

from pdserve.registry.etcd_server import free_port
from testing.cluster import LocalCluster
from testing.procs import FrontendProc, start_frontend

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny-llama"
NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "1024", "--block-size", "16",
             "--model-name", MODEL]
BODY_TIMEOUT_S = 2.0
ERROR_KEYS = {"message", "type", "param", "code"}
FUZZ_EXAMPLES = 30  # per operation: about a minute for the four


@dataclass(eq=False)
class Env:
    cluster: LocalCluster
    frontend: FrontendProc

    @property
    def address(self) -> tuple[str, int]:
        return self.frontend.host, self.frontend.port

    def sdk_works(self) -> None:
        client = openai.OpenAI(base_url=f"{self.frontend.base_url}/v1", api_key="sk-any", max_retries=0, timeout=60)
        resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=3, temperature=0)
        assert resp.choices[0].message.content is not None and resp.usage is not None
        assert resp.usage.completion_tokens >= 1


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("frontend-hostile")
    models = tmp / "models.yaml"
    # Short outputs keep fuzzed requests that are valid cheap to generate.
    models.write_bytes(orjson.dumps({"models": [{"name": MODEL, "path": str(tiny_llama_dir),
                                                 "max_output_tokens": 4}]}))
    with LocalCluster(tmp / "cluster", tiny_llama_dir, node_args=NODE_ARGS) as cluster:
        cluster.start(1, 1)
        fe = start_frontend("frontend", tmp, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                            "--models", str(models), "--request-log", "off", "--body-timeout", str(BODY_TIMEOUT_S),
                            "--log-level", "warning")
        try:
            yield Env(cluster, fe)
            cluster.wait_clean()
        finally:
            assert fe.stop() == 0, fe.proc.tail()
            assert "Traceback" not in fe.proc.log_text(), fe.proc.tail(80)


@pytest.fixture(autouse=True)
def _serves_normally_afterwards(env: Env) -> Iterator[None]:
    yield
    env.sdk_works()
    env.cluster.check_integrity()


# --- raw HTTP over a socket: the client controls every byte and its timing ----------------------------


@dataclass(frozen=True)
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes
    elapsed_s: float  # from the first byte sent to the whole response read

    def error(self) -> dict[str, Any]:
        obj = orjson.loads(self.body)
        assert set(obj) == {"error"} and set(obj["error"]) == ERROR_KEYS, obj
        return obj["error"]


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed before a response head: {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return status, headers, rest[:length]


def raw_post(env: Env, path: str, head_lines: list[str], body_parts: Iterator[bytes], pause_s: float = 0.0) -> RawResponse:
    """Sends a request (head lines after the request line, then the body parts with `pause_s` between
    them) from a thread while reading the response here: a server may answer before the body is done."""
    sock = socket.create_connection(env.address, timeout=120)
    stop = threading.Event()

    def send() -> None:
        try:
            for part in body_parts:
                if stop.is_set():
                    return
                sock.sendall(part)
                if pause_s:
                    stop.wait(pause_s)
        except OSError:
            return  # the server answered and closed: the rest is not wanted

    start = time.perf_counter()
    head = f"POST {path} HTTP/1.1\r\nHost: {env.address[0]}\r\n" + "".join(f"{h}\r\n" for h in head_lines) + "\r\n"
    sock.sendall(head.encode("latin-1"))
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        status, headers, body = _read_response(sock)
        return RawResponse(status, headers, body, time.perf_counter() - start)
    finally:
        stop.set()
        sock.close()
        sender.join(5)


def post(env: Env, body: bytes, path: str = "/v1/chat/completions", **headers: str) -> httpx.Response:
    return httpx.post(f"{env.frontend.base_url}{path}", content=body, timeout=60,
                      headers={"content-type": "application/json", **headers})


def assert_openai_error(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, (resp.status_code, resp.text[:300])
    obj = resp.json()
    assert set(obj) == {"error"} and set(obj["error"]) == ERROR_KEYS, obj
    assert obj["error"]["code"] == code, obj
    return obj["error"]


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


# --- the cases -----------------------------------------------------------------------------------------


def test_invalid_utf8(env: Env) -> None:
    body = orjson.dumps(chat()).replace(b'"hi"', b'"h\xff\xfei"')
    assert_openai_error(post(env, body), 400, "invalid_encoding")


def test_json_nested_ten_thousand_deep(env: Env) -> None:
    deep = b"[" * 10_000 + b"]" * 10_000
    assert_openai_error(post(env, b'{"model": "tiny-llama", "messages": ' + deep + b"}"), 400, "invalid_json")
    assert_openai_error(post(env, b"{\"a\":" * 10_000 + b"1" + b"}" * 10_000), 400, "invalid_json")


def test_hundred_megabyte_body_declared_and_chunked(env: Env) -> None:
    size, piece = 100 << 20, b"x" * (1 << 20)
    declared = raw_post(env, "/v1/chat/completions", ["Content-Type: application/json", f"Content-Length: {size}"],
                        iter([piece] * 100))
    assert declared.status == 413 and declared.error()["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:
        yield b"%x\r\n%b\r\n" % (len(piece), piece)  # no length declared: cut at the limit while reading
        for _ in range(99):
            yield b"%x\r\n%b\r\n" % (len(piece), piece)
        yield b"0\r\n\r\n"

    chunked = raw_post(env, "/v1/chat/completions", ["Content-Type: application/json", "Transfer-Encoding: chunked"],
                       chunks())
    assert chunked.status == 413 and chunked.error()["code"] == "request_too_large"


def test_body_trickled_over_sixty_seconds_is_cut_at_the_body_timeout(env: Env) -> None:
    body = orjson.dumps(chat(stop=["x" * 40]))
    pause = 60.0 / len(body)  # the whole body would take 60 s
    resp = raw_post(env, "/v1/chat/completions", ["Content-Type: application/json", f"Content-Length: {len(body)}"],
                    iter([body[i:i + 1] for i in range(len(body))]), pause_s=pause)
    assert resp.status == 408 and resp.error()["code"] == "body_timeout"
    assert BODY_TIMEOUT_S <= resp.elapsed_s < BODY_TIMEOUT_S + 1.5, resp.elapsed_s


def test_ten_thousand_stop_strings_and_long_stop_strings(env: Env) -> None:
    err = assert_openai_error(post(env, orjson.dumps(chat(stop=[f"s{i}" for i in range(10_000)]))), 400,
                              "invalid_value")
    assert err["param"] == "stop"
    err = assert_openai_error(post(env, orjson.dumps(chat(stop=["y" * 10_000]))), 400, "invalid_value")
    assert err["param"] == "stop[0]"


def test_hundred_thousand_messages(env: Env) -> None:
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 100_000})
    err = assert_openai_error(post(env, body), 400, "invalid_value")
    assert err["param"] == "messages" and "100000" in err["message"]


def test_prompt_too_long_before_tokenizing(env: Env) -> None:
    body = orjson.dumps(chat(messages=[{"role": "user", "content": "z" * (1 << 20)}, {"role": "user", "content": "z"}]))
    assert_openai_error(post(env, body), 400, "prompt_too_long")
    body = orjson.dumps({"model": MODEL, "prompt": [1] * ((1 << 20) + 1), "max_tokens": 1})
    assert_openai_error(post(env, body, "/v1/completions"), 400, "prompt_too_long")


def test_oversized_headers(env: Env) -> None:
    resp = raw_post(env, "/v1/chat/completions", ["Content-Type: application/json", "Content-Length: 2",
                                                  f"X-Filler: {'f' * 40_000}"], iter([b"{}"]))
    assert resp.status == 431 and resp.error()["code"] == "headers_too_large"
    many = [f"X-H{i}: {'v' * 60}" for i in range(400)]
    resp = raw_post(env, "/v1/models", many + ["Content-Length: 0"], iter([]))
    assert resp.status == 431 and resp.error()["code"] == "headers_too_large"


# --- fuzzing the frontend's own OpenAPI document -----------------------------------------------------------


def test_openapi_document_is_served_and_current(env: Env) -> None:
    from testing.openapi import frontend_document

    served = httpx.get(f"{env.frontend.base_url}/openapi.json", timeout=30).json()
    assert served == frontend_document(), "frontend/openapi.json is stale: run scripts/build_frontend_openapi.py"
    chat_body = served["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert chat_body["schema"] == {"$ref": "#/components/schemas/CreateChatCompletionRequest"}
    assert "messages" in served["components"]["schemas"]["CreateChatCompletionRequest"]["allOf"][-1]["properties"]


FUZZ_CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
               checks.response_schema_conformance]


def fuzz_operation(operation: Any, seen: dict[int, int]) -> None:
    """Runs FUZZ_EXAMPLES generated cases of one operation (hypothesis; deterministic), counting statuses."""

    @given(case=operation.as_strategy())
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    def fuzz(case: Any) -> None:
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = MODEL  # a served model, so that generated bodies get past the lookup
        response = case.call_and_validate(checks=FUZZ_CHECKS, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, response.text[:500]
        if response.status_code >= 400:
            obj = response.json()
            assert set(obj) == {"error"} and set(obj["error"]) == ERROR_KEYS, obj

    fuzz()


def test_fuzz_no_5xx_and_errors_in_the_openai_shape(env: Env) -> None:
    # Each operation's generated cases are run by hypothesis here rather than through schemathesis'
    # pytest plugin, whose lazy loader does not work with this pytest.
    schema = schemathesis.openapi.from_url(f"{env.frontend.base_url}/openapi.json")
    statuses: dict[str, dict[int, int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        fuzz_operation(operation, statuses.setdefault(operation.label, {}))
    print(statuses)
    from testing.openapi import frontend_document

    operations = sum(len(methods) for methods in frontend_document()["paths"].values())
    assert len(statuses) == operations and sum(statuses["POST /v1/chat/completions"].values()) >= FUZZ_EXAMPLES // 2
    assert sum(statuses["POST /v1/embeddings"].values()) >= FUZZ_EXAMPLES // 2, statuses
    assert sum(statuses["POST /v1/responses"].values()) >= FUZZ_EXAMPLES // 2, statuses
    assert sum(statuses["POST /v1/completions"].values()) >= FUZZ_EXAMPLES // 2, statuses
