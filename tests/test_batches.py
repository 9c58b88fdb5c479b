"""`/v1/files` and `/v1/batches` (OpenAI's Batch API) on a real cluster: etcd, 1 prefill + 1 decode node
running the default model (SmolLM2-135M-Instruct), frontends with the batch store in SQLite and in a real
PostgreSQL, driven by the official openai SDK.

Files: create, list, retrieve, content, delete. Batches: chat completions, completions and responses
batches polled to completed with each line's greedy text equal to the same request sent on its own; a
batch cancelled mid-way ends cancelled with its finished lines in the output; a bad input file fails
with OpenAI's errors; a frontend SIGKILLed mid-batch -> another one (on the shared PostgreSQL store) and
a restarted one (SQLite) complete it, every custom_id exactly once. Hostile: a too-large upload (413,
declared and streamed), a path-like file name, another tenant's ids (404), errors in the OpenAI shape,
never a 5xx. The pure parts (input validation, the spare-capacity rule) are unit tests at the top.
"""

from __future__ import annotations

import random
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from pdserve.frontend.batches import (
    MAX_BATCH_LINES,
    MAX_REPORTED_ERRORS,
    InputParser,
    parse_input,
    safe_filename,
)
from pdserve.frontend.tenants import hash_key
from pdserve.registry.etcd_server import free_port
from testing.cluster import LocalCluster
from testing.openapi import OpenAPISchemas
from testing.postgres import PostgresServer, postgres_server  # noqa: F401 - the fixture
from testing.procs import FrontendProc, start_frontend

pytest_plugins = ["tests.gguf_fixtures"]  # smollm2_dir
pytestmark = pytest.mark.timeout(600)

NAME = "SmolLM2-135M-Instruct"
KEYS = {"alpha": "sk-alpha-batches-0123456789", "beta": "sk-beta-batches-0123456789"}
MAX_FILE = 65536
CHAT_URL = "/v1/chat/completions"


# --- unit: the pure parts ------------------------------------------------------------------------


def _jsonl(*objs: Any) -> bytes:
    return b"".join((o if isinstance(o, bytes) else orjson.dumps(o)) + b"\n" for o in objs)


def _req(cid: str, content: str = "Hi", model: str = NAME, url: str = CHAT_URL, max_tokens: int = 8,
         **extra: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0, **extra}}


def _known(name: str) -> str | None:
    return None if name in (NAME, "other-model") else f"The model `{name}` does not exist."


def test_parse_input_reports_every_problem_with_its_line() -> None:
    data = _jsonl(_req("a"), b"{not json", {"method": "POST", "url": CHAT_URL, "body": {}}, _req("a"),
                  {**_req("u"), "url": "/v1/completions"}, {**_req("m"), "method": "GET"},
                  {**_req("b"), "body": [1]}, _req("x", model="nope"), _req("o", model="other-model"),
                  {**_req("nm"), "body": {"messages": []}}) + b"\n\n" + _jsonl(_req("last"))
    lines, errors = parse_input(data, CHAT_URL, _known)
    got = [(e["line"], e["code"], e["param"]) for e in errors]
    assert got == [(2, "invalid_json_line", None), (3, "missing_required_parameter", "custom_id"),
                   (4, "duplicate_custom_id", "custom_id"), (5, "invalid_url", "url"), (6, "invalid_method", "method"),
                   (7, "invalid_request", "body"), (8, "model_not_found", "body.model"),
                   (9, "mismatched_model", "body.model"), (10, "missing_required_parameter", "body.model")]
    assert all(isinstance(e["message"], str) and e["message"] for e in errors)
    assert [(ln.no, ln.custom_id) for ln in lines] == [(1, "a"), (13, "last")]
    assert parse_input(b"\n \n", CHAT_URL, _known)[1][0]["code"] == "empty_file"
    assert parse_input(_jsonl(_req("a"), _req("b")), CHAT_URL, _known)[1] == []


def test_input_parser_reads_chunk_by_chunk_within_bounds() -> None:
    """Any chunking gives what the whole file gives; an over-long line is skipped unparsed with its number;
    past MAX_BATCH_LINES requests lines are counted, not kept; at most MAX_REPORTED_ERRORS problems kept."""
    data = _jsonl(_req("a"), _req("long", content="z" * 5000), b"{bad", _req("b")) + orjson.dumps(_req("c"))
    whole = parse_input(data, CHAT_URL, _known, max_line_bytes=1024)
    assert [(e["line"], e["code"]) for e in whole[1]] == [(2, "line_too_large"), (3, "invalid_json_line")]
    assert [ln.custom_id for ln in whole[0]] == ["a", "b", "c"]
    rng = random.Random(7)
    for _ in range(20):
        parser, pos = InputParser(CHAT_URL, _known, 1024), 0
        while pos < len(data):
            step = rng.choice((1, 3, 50, 700, 4096))
            parser.feed(data[pos:pos + step])
            pos += step
        got = parser.finish()
        assert got[1] == whole[1] and [(ln.no, ln.custom_id, ln.body) for ln in got[0]] == \
            [(ln.no, ln.custom_id, ln.body) for ln in whole[0]]
    parser = InputParser(CHAT_URL, _known, 1024)
    one = orjson.dumps(_req("x")).replace(b'"x"', b'"%d"')
    block = b"".join(one.replace(b"%d", str(i).encode()) + b"\n" for i in range(MAX_BATCH_LINES + 10_000))
    for i in range(0, len(block), 1 << 20):
        parser.feed(block[i:i + (1 << 20)])
    lines, errors = parser.finish()
    assert len(lines) == MAX_BATCH_LINES + 1 and [e["code"] for e in errors] == ["too_many_tasks"]
    assert str(MAX_BATCH_LINES + 10_000) in errors[0]["message"]
    lines, errors = parse_input(b"{bad\n" * 5000, CHAT_URL, _known)
    assert lines == [] and len(errors) == MAX_REPORTED_ERRORS and errors[-1]["line"] == MAX_REPORTED_ERRORS


def test_file_names_are_names_only() -> None:
    assert safe_filename("../../etc/passwd") == "passwd"
    assert safe_filename("..\\..\\boot.ini") == "boot.ini"
    assert safe_filename("a\x00b\nc.jsonl") == "abc.jsonl"
    assert safe_filename("..") == "file" and safe_filename(None) == "file" and safe_filename("x/") == "file"
    assert len(safe_filename("é" * 1000)) == 255


# --- the cluster ---------------------------------------------------------------------------------


@dataclass(eq=False)
class Env:
    cluster: LocalCluster
    tmp: Path
    model_dir: Path
    tenants: Path
    pg_dsn: str
    frontend: FrontendProc  # SQLite store
    others: list[FrontendProc]

    def client(self, tenant: str = "alpha", fe: FrontendProc | None = None) -> openai.OpenAI:
        fe = fe or self.frontend
        return openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key=KEYS[tenant], max_retries=0,
                             http_client=httpx.Client(timeout=120))

    def start_frontend(self, name: str, store: str, *extra: str) -> FrontendProc:
        fe = start_frontend(name, self.tmp, self.cluster.etcd_endpoints, free_port(), "--cluster",
                            self.cluster.cluster, "--model", f"{NAME}={self.model_dir}", "--tenants",
                            str(self.tenants), "--response-store", store, "--log-level", "warning",
                            "--max-file-bytes", str(MAX_FILE), "--batch-lease", "2", *extra)
        self.others.append(fe)
        return fe


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path, postgres_server: PostgresServer) -> Iterator[Env]:  # noqa: F811
    tmp = tmp_path_factory.mktemp("batches")
    tenants = tmp / "tenants.yaml"
    tenants.write_bytes(orjson.dumps({"tenants": [{"name": n, "keys_sha256": [hash_key(k)]} for n, k in KEYS.items()]}))
    node_args = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "256", "--model-name", NAME]
    dsn = postgres_server.dsn(postgres_server.create_database("batches"))
    with LocalCluster(tmp / "cluster", smollm2_dir, node_args=node_args) as cluster:
        cluster.start(1, 1, decode_args=["--local-prefill-threshold", "0"])
        e = Env(cluster, tmp, smollm2_dir, tenants, dsn, None, [])  # type: ignore[arg-type]
        e.frontend = e.start_frontend("frontend-sqlite", f"sqlite:///{tmp / 'responses.db'}")
        try:
            yield e
            cluster.wait_clean()
        finally:
            for fe in e.others:
                if fe.proc.popen.poll() is None:
                    assert fe.stop() == 0, fe.proc.tail()
                    assert "Traceback" not in fe.proc.log_text(), fe.proc.tail(80)


@pytest.fixture(autouse=True)
def _integrity(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "env" in request.fixturenames:
        request.getfixturevalue("env").cluster.check_integrity()


def _wait(client: openai.OpenAI, batch_id: str, until: tuple[str, ...] = ("completed", "failed", "cancelled",
                                                                           "expired"), timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while (b := client.batches.retrieve(batch_id)).status not in until:
        assert time.monotonic() < deadline, b
        time.sleep(0.1)
    return b


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [orjson.loads(line) for line in client.files.content(file_id).read().splitlines()]


def _submit(client: openai.OpenAI, requests: list[dict[str, Any]], endpoint: str = CHAT_URL, **kw: Any) -> Any:
    f = client.files.create(file=("input.jsonl", _jsonl(*requests)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h", **kw)  # type: ignore[arg-type]


def test_files_create_list_retrieve_content_delete(env: Env) -> None:
    client = env.client()
    data = _jsonl(_req("a"), _req("b"))
    f = client.files.create(file=("../../etc/passwd", data), purpose="batch")
    assert f.id.startswith("file-") and f.object == "file" and f.purpose == "batch" and f.bytes == len(data)
    assert f.filename == "passwd"  # a name only, never a path
    assert client.files.retrieve(f.id).model_dump() == f.model_dump()
    assert client.files.content(f.id).read() == data
    g = client.files.create(file=("second.jsonl", b"{}\n"), purpose="batch")
    listed = client.files.list(purpose="batch", order="desc", limit=100)
    ids = [x.id for x in listed.data]
    assert ids.index(g.id) < ids.index(f.id)
    page = client.files.list(limit=1, order="asc")
    assert len(page.data) == 1 and page.has_more
    after = client.files.list(limit=100, order="asc", after=page.data[0].id)
    assert page.data[0].id not in [x.id for x in after.data]
    deleted = client.files.delete(g.id)
    assert deleted.deleted and deleted.id == g.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(g.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(g.id)
    assert g.id not in [x.id for x in client.files.list(limit=100).data]


def test_files_expire_as_openai_says(env: Env) -> None:
    """Batch uploads expire after 30 days unless `expires_after` says otherwise (1 hour to 30 days from
    created_at); output files only with the batch's `output_expires_after`."""
    client = env.client()
    f = client.files.create(file=("a.jsonl", _jsonl(_req("a"))), purpose="batch")
    assert f.expires_at == f.created_at + 30 * 24 * 3600
    g = client.files.create(file=("b.jsonl", _jsonl(_req("b"))), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 3600})
    assert g.expires_at == g.created_at + 3600 and client.files.retrieve(g.id).expires_at == g.expires_at
    for bad, param in (({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor"),
                       ({"anchor": "created_at", "seconds": 60}, "expires_after.seconds"),
                       ({"anchor": "created_at", "seconds": 31 * 24 * 3600}, "expires_after.seconds")):
        with pytest.raises(openai.BadRequestError) as info:
            client.files.create(file=("c.jsonl", b"{}"), purpose="batch", expires_after=bad)  # type: ignore[arg-type]
        assert info.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        client.batches.create(input_file_id=g.id, endpoint=CHAT_URL, completion_window="24h",
                              output_expires_after={"anchor": "created_at", "seconds": 5})
    assert info.value.body["param"] == "output_expires_after.seconds"  # type: ignore[index]
    kept = _wait(client, client.batches.create(input_file_id=f.id, endpoint=CHAT_URL, completion_window="24h").id)
    assert client.files.retrieve(kept.output_file_id).expires_at is None  # type: ignore[arg-type]
    b = client.batches.create(input_file_id=g.id, endpoint=CHAT_URL, completion_window="24h",
                              output_expires_after={"anchor": "created_at", "seconds": 7200})
    assert "output_expires_after" not in b.model_dump(exclude_none=True) and "_output_ttl_s" not in b.model_dump()
    out = client.files.retrieve(_wait(client, b.id).output_file_id)  # type: ignore[arg-type]
    assert out.expires_at == out.created_at + 7200


def test_chat_batch_completes_with_the_greedy_text_of_each_request(env: Env) -> None:
    client = env.client()
    prompts = {"c1": "What is the capital of France?", "c2": "Name a color.", "c3": "Count to three.",
               "c4": "Say hello."}
    b = _submit(client, [_req(cid, p) for cid, p in prompts.items()], metadata={"job": "nightly"})
    assert b.status == "validating" and b.endpoint == CHAT_URL and b.metadata == {"job": "nightly"}
    done = _wait(client, b.id)
    assert done.status == "completed", done
    assert done.request_counts is not None and (done.request_counts.total, done.request_counts.completed,
                                                done.request_counts.failed) == (4, 4, 0)
    assert done.error_file_id is None and done.output_file_id is not None
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.model == NAME
    out = client.files.retrieve(done.output_file_id)
    assert out.purpose == "batch_output"
    lines = _lines(client, done.output_file_id)
    assert sorted(ln["custom_id"] for ln in lines) == sorted(prompts)
    for ln in lines:
        assert ln["id"].startswith("batch_req_") and ln["error"] is None
        assert ln["response"]["status_code"] == 200 and ln["response"]["request_id"].startswith("chatcmpl-")
        single = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompts[ln["custom_id"]]}],
                                                max_tokens=8, temperature=0)
        assert ln["response"]["body"]["choices"][0]["message"]["content"] == single.choices[0].message.content
    assert b.id in [x.id for x in client.batches.list(limit=100).data]
    assert _gauge(env.frontend, "pdserve_frontend_batch_lines_total", 'outcome="ok"') >= 4
    usage = [ln["response"]["body"]["usage"] for ln in lines]
    assert done.usage is not None and done.usage.input_tokens == sum(u["prompt_tokens"] for u in usage)
    assert done.usage.output_tokens == sum(u["completion_tokens"] for u in usage) and done.usage.total_tokens == \
        done.usage.input_tokens + done.usage.output_tokens


def test_completions_and_responses_batches(env: Env) -> None:
    client = env.client()
    comp = _submit(client, [{"custom_id": "p", "method": "POST", "url": "/v1/completions",
                             "body": {"model": NAME, "prompt": "The sky is", "max_tokens": 8, "temperature": 0}}],
                   endpoint="/v1/completions")
    resp = _submit(client, [{"custom_id": "r", "method": "POST", "url": "/v1/responses",
                             "body": {"model": NAME, "input": "Name a fruit.", "max_output_tokens": 8,
                                      "temperature": 0, "store": False}}], endpoint="/v1/responses")
    c, r = _wait(client, comp.id), _wait(client, resp.id)
    assert c.status == r.status == "completed"
    [cl] = _lines(client, c.output_file_id)
    single = client.completions.create(model=NAME, prompt="The sky is", max_tokens=8, temperature=0)
    assert cl["response"]["body"]["choices"][0]["text"] == single.choices[0].text
    [rl] = _lines(client, r.output_file_id)
    alone = client.responses.create(model=NAME, input="Name a fruit.", max_output_tokens=8, temperature=0, store=False)
    body = rl["response"]["body"]
    assert body["object"] == "response" and body["output"][-1]["content"][0]["text"] == alone.output_text


def test_embeddings_batch(env: Env) -> None:
    client = env.client()
    texts = ["The quick brown fox.", "Hello"]
    b = _submit(client, [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                          "body": {"model": NAME, "input": t}} for i, t in enumerate(texts)], endpoint="/v1/embeddings")
    done = _wait(client, b.id)
    assert done.status == "completed" and done.error_file_id is None, (done, _lines(client, done.error_file_id))
    for ln in _lines(client, done.output_file_id):
        alone = client.embeddings.create(model=NAME, input=texts[int(ln["custom_id"][1:])])
        got = ln["response"]["body"]["data"][0]["embedding"]
        assert max(abs(a - b) for a, b in zip(got, alone.data[0].embedding, strict=True)) < 1e-5


def test_a_cancelled_batch_keeps_its_finished_lines(env: Env) -> None:
    client = env.client()
    # One short line finishes first; the others (all in flight: 8 batch slots) are far from done then.
    reqs = [_req(f"k{i}", f"Write a long story about the number {i}.", max_tokens=2 if i == 0 else 256,
                 ignore_eos=True) for i in range(8)]
    b = _submit(client, reqs)
    deadline = time.monotonic() + 120
    while True:
        got = client.batches.retrieve(b.id)
        if got.request_counts is not None and got.request_counts.completed >= 1:
            break
        assert got.status in ("validating", "in_progress") and time.monotonic() < deadline, got
        time.sleep(0.05)
    cancelling = client.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = _wait(client, b.id)
    assert done.status == "cancelled" and done.cancelled_at, done
    out, err = _lines(client, done.output_file_id), _lines(client, done.error_file_id)
    assert 1 <= len(out) < 8 and all(ln["response"]["status_code"] == 200 for ln in out)
    assert done.request_counts is not None and done.request_counts.completed == len(out)
    assert sorted(ln["custom_id"] for ln in out + err) == sorted(r["custom_id"] for r in reqs)  # each exactly once
    assert all(ln["error"]["code"] == "batch_cancelled" and ln["response"] is None for ln in err)
    with pytest.raises(openai.BadRequestError):  # a completed batch cannot be cancelled; a cancelled one again
        client.batches.cancel(_wait(client, _submit(client, [_req("z")]).id).id)
    assert client.batches.cancel(b.id).status == "cancelled"
    env.cluster.wait_clean()


def test_a_bad_input_file_fails_with_openai_errors(env: Env) -> None:
    client = env.client()
    bad = _submit(client, [_req("a"), b"not json", _req("a"), {**_req("w"), "url": "/v1/completions"},
                           {**_req("g"), "method": "GET"}, {**_req("o"), "body": "text"}])
    failed = _wait(client, bad.id)
    assert failed.status == "failed" and failed.failed_at and failed.errors is not None
    assert [(e.line, e.code) for e in failed.errors.data or []] == [
        (2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "invalid_url"), (5, "invalid_method"),
        (6, "invalid_request")]
    unknown = _wait(client, _submit(client, [_req("a", model="no-such-model")]).id)
    assert unknown.status == "failed" and unknown.errors is not None
    assert [(e.line, e.code, e.param) for e in unknown.errors.data or []] == [(1, "model_not_found", "body.model")]
    # A request the model cannot serve is the line's error, not the batch's.
    mixed = _wait(client, _submit(client, [_req("ok"), _req("long", max_tokens=10**6)]).id)
    assert mixed.status == "completed" and mixed.request_counts is not None
    assert (mixed.request_counts.completed, mixed.request_counts.failed) == (1, 1)
    [e] = _lines(client, mixed.error_file_id)
    assert e["custom_id"] == "long" and e["response"]["status_code"] == 400
    assert set(e["response"]["body"]["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("store", ["postgres", "sqlite"])
def test_a_frontend_killed_mid_batch_is_resumed(env: Env, store: str) -> None:
    url = env.pg_dsn if store == "postgres" else f"sqlite:///{env.tmp / 'kill.db'}"
    first = env.start_frontend(f"frontend-kill-{store}", url, "--batch-max-inflight", "1")
    client = env.client(fe=first)
    reqs = [_req(f"r{i}", f"Tell me about the number {i}.", max_tokens=4 if i < 2 else 32, ignore_eos=True)
            for i in range(6)]  # one line at a time: killed while r2 runs
    b = _submit(client, reqs)
    deadline = time.monotonic() + 120
    while (got := client.batches.retrieve(b.id)).request_counts is None or got.request_counts.completed < 2:
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    first.proc.popen.kill()
    first.proc.popen.wait(timeout=30)
    # Postgres: another frontend of the cluster takes it over; SQLite: the frontend restarted on its file.
    second = env.start_frontend(f"frontend-resume-{store}", url)
    client = env.client(fe=second)
    done = _wait(client, b.id)
    assert done.status == "completed", done
    out = _lines(client, done.output_file_id)
    assert sorted(ln["custom_id"] for ln in out) == sorted(r["custom_id"] for r in reqs)  # exactly once each
    assert done.error_file_id is None and done.request_counts is not None and done.request_counts.completed == 6
    served = [orjson.loads(ln) for ln in second.proc.log_text().splitlines() if ln.startswith('{"ts"')]
    assert 1 <= len([r for r in served if r.get("endpoint") == "chat.completions"]) <= 4  # recorded lines never rerun
    env.cluster.wait_clean()


def test_an_expired_batch_keeps_its_finished_lines(env: Env) -> None:
    path = env.tmp / "expire.db"
    fe = env.start_frontend("frontend-expire", f"sqlite:///{path}", "--batch-max-inflight", "1")
    client = env.client(fe=fe)
    reqs = [_req(f"x{i}", f"Tell me about the number {i}.", max_tokens=2 if i == 0 else 96, ignore_eos=True)
            for i in range(5)]  # one line at a time: x1 is far from done when x0 is
    b = _submit(client, reqs)
    deadline = time.monotonic() + 120
    while (got := client.batches.retrieve(b.id)).request_counts is None or got.request_counts.completed < 1:
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    with sqlite3.connect(env.tmp / "expire-batches.db", timeout=10) as db:  # the 24 hours are over
        db.execute("UPDATE pdserve_batches SET batch = json_set(batch, '$.expires_at', 1) WHERE id = ?", (b.id,))
    done = _wait(client, b.id)
    assert done.status == "expired" and done.expired_at, done
    out, err = _lines(client, done.output_file_id), _lines(client, done.error_file_id)
    assert len(out) >= 1 and err and all(ln["error"]["code"] == "batch_expired" for ln in err)
    assert sorted(ln["custom_id"] for ln in out + err) == sorted(r["custom_id"] for r in reqs)
    assert fe.stop() == 0
    env.cluster.wait_clean()


def _assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def test_hostile_uploads_and_other_tenants_ids(env: Env) -> None:
    base = f"{env.frontend.base_url}/v1"
    auth = {"authorization": f"Bearer {KEYS['alpha']}"}
    alpha, beta = env.client("alpha"), env.client("beta")
    with httpx.Client(timeout=60) as http:
        big = b"x" * (MAX_FILE + 1)
        _assert_error(http.post(f"{base}/files", headers=auth, files={"file": ("big.jsonl", big)},
                                data={"purpose": "batch"}), 413)

        def streamed() -> Iterator[bytes]:  # chunked: no Content-Length to refuse it by
            yield b'--B\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
            for _ in range(40):
                yield b"y" * 8192
            yield b'\r\n--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B--\r\n'
        r = http.post(f"{base}/files", headers={**auth, "content-type": "multipart/form-data; boundary=B"},
                      content=streamed())
        _assert_error(r, 413)
        _assert_error(http.post(f"{base}/files", headers=auth, files={"file": ("a.jsonl", b"{}")},
                                data={"purpose": "fine-tune"}), 400, "purpose")
        _assert_error(http.post(f"{base}/files", headers=auth, data={"purpose": "batch"}), 400)
        _assert_error(http.post(f"{base}/files", headers=auth, files={"file": ("a.jsonl", b"{}")}), 400, "purpose")
        _assert_error(http.post(f"{base}/files", headers=auth, content=b"{}"), 400)
        _assert_error(http.post(f"{base}/files", headers={**auth, "content-type": "multipart/form-data; boundary=B"},
                                content=b"--B\r\ngarbage"), 400)
        _assert_error(http.post(f"{base}/files", files={"file": ("a.jsonl", b"{}")}, data={"purpose": "batch"}), 401)
        _assert_error(http.get(f"{base}/files", headers=auth, params={"limit": "0"}), 400, "limit")
        _assert_error(http.get(f"{base}/files", headers=auth, params={"order": "sideways"}), 400, "order")
        _assert_error(http.get(f"{base}/batches", headers=auth, params={"limit": "x"}), 400, "limit")
        f = alpha.files.create(file=("in.jsonl", _jsonl(_req("a"))), purpose="batch")
        for body, param in (({"input_file_id": f.id, "endpoint": "/v1/moderations", "completion_window": "24h"}, "endpoint"),
                            ({"input_file_id": f.id, "endpoint": CHAT_URL, "completion_window": "1h"}, "completion_window"),
                            ({"endpoint": CHAT_URL, "completion_window": "24h"}, "input_file_id"),
                            ({"input_file_id": f.id, "endpoint": CHAT_URL, "completion_window": "24h",
                              "metadata": {"k": 1}}, "metadata.k"),
                            ({"input_file_id": 7, "endpoint": CHAT_URL, "completion_window": "24h"}, "input_file_id")):
            _assert_error(http.post(f"{base}/batches", headers=auth, json=body), 400, param)
        _assert_error(http.post(f"{base}/batches", headers=auth, content=b"{nope"), 400)
        _assert_error(http.get(f"{base}/batches/batch_nope", headers=auth), 404)
        _assert_error(http.get(f"{base}/files/file-nope/content", headers=auth), 404)
    b = alpha.batches.create(input_file_id=f.id, endpoint=CHAT_URL, completion_window="24h")
    for call in (lambda: beta.files.retrieve(f.id), lambda: beta.files.content(f.id), lambda: beta.files.delete(f.id),
                 lambda: beta.batches.retrieve(b.id), lambda: beta.batches.cancel(b.id),
                 lambda: beta.batches.create(input_file_id=f.id, endpoint=CHAT_URL, completion_window="24h")):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert set(info.value.body) == {"message", "type", "param", "code"}  # type: ignore[arg-type]
    assert f.id not in [x.id for x in beta.files.list().data] and b.id not in [x.id for x in beta.batches.list().data]
    assert _wait(alpha, b.id).status == "completed"
    assert "Traceback" not in env.frontend.proc.log_text()


def _multipart(parts: Iterator[bytes], counter: list[int], name: str = "in.jsonl") -> Iterator[bytes]:
    """A chunked multipart upload of `parts` (never held whole); counts the file bytes handed to the client."""
    yield f'--B\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n\r\n'.encode()
    for part in parts:
        counter[0] += len(part)
        yield part
    yield b'\r\n--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B--\r\n'


def test_hostile_sizes_at_the_default_limits(env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the default --max-file-bytes (200 MiB): a 2 GiB upload (declared, and chunked without a length)
    is a 413 after at most the limit is read; a JSONL of a million lines and one with a 100 MB line upload
    and fail validation with OpenAI-shaped errors, read in bounded memory. No 5xx, and nothing is left
    outside the store (the frontend's temporary directory is empty after)."""
    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setenv("TMPDIR", str(spool))
    store = tmp_path / "limits.db"
    fe = env.start_frontend("frontend-limits", f"sqlite:///{store}", "--max-file-bytes", str(200 << 20))
    base, auth = f"{fe.base_url}/v1", {"authorization": f"Bearer {KEYS['alpha']}"}
    mib = b"y" * (1 << 20)
    with httpx.Client(timeout=300) as http:
        for declared in (True, False):
            sent = [0]
            headers = {**auth, "content-type": "multipart/form-data; boundary=B"}
            if declared:
                headers["content-length"] = str(sum(len(p) for p in _multipart(iter([mib] * 2048), [0])))
            r = http.post(f"{base}/files", headers=headers, content=_multipart(iter([mib] * 2048), sent))
            _assert_error(r, 413)
            assert sent[0] <= (208 << 20), sent[0]  # cut off at the limit, not read to the end
        assert http.get(f"{base}/files", headers=auth).json()["data"] == []
        alpha = openai.OpenAI(base_url=base, api_key=KEYS["alpha"], max_retries=0)

        def upload_and_fail(parts: Iterator[bytes]) -> list[dict[str, Any]]:
            r = http.post(f"{base}/files", headers={**auth, "content-type": "multipart/form-data; boundary=B"},
                          content=_multipart(parts, [0]))
            assert r.status_code == 200, r.text
            file_id = r.json()["id"]
            b = alpha.batches.create(input_file_id=file_id, endpoint=CHAT_URL, completion_window="24h")
            done = _wait(alpha, b.id, timeout=180)
            assert done.status == "failed" and done.request_counts.total == 0
            alpha.files.delete(file_id)
            return [e.model_dump() for e in done.errors.data]

        line = orjson.dumps(_req("%d", content="", max_tokens=1))

        def million() -> Iterator[bytes]:
            for start in range(0, 1_000_000, 10_000):
                yield b"".join(line.replace(b'"%d"', f'"{i}"'.encode()) + b"\n" for i in range(start, start + 10_000))
        errors = upload_and_fail(million())
        assert [e["code"] for e in errors] == ["too_many_tasks"] and "1000000" in errors[0]["message"]

        def long_line() -> Iterator[bytes]:
            head, tail = orjson.dumps(_req("big", content="#")).split(b"#")
            yield head
            yield from [b"z" * (1 << 20)] * 100
            yield tail + b"\n" + orjson.dumps(_req("small")) + b"\n"
        errors = upload_and_fail(long_line())
        assert [(e["code"], e["line"]) for e in errors] == [("line_too_large", 1)]
    assert alpha.files.list().data == []
    assert fe.stop() == 0 and "Traceback" not in fe.proc.log_text(), fe.proc.tail(40)
    assert list(spool.iterdir()) == []
    stores = {f"limits{db}.db{end}" for db in ("", "-batches", "-limits") for end in ("", "-wal", "-shm")}
    assert {p.name for p in tmp_path.iterdir()} <= {"spool", *stores}


def _gauge(fe: FrontendProc, name: str, has: str = "") -> float:
    text = httpx.get(f"{fe.base_url}/metrics", timeout=30).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + "{") and has in line))


def test_interactive_requests_gate_batch_slots(env: Env) -> None:
    """Idle: every slot. An interactive request in flight: none without a baseline of interactive
    latencies, the first probe (1) with one (the earlier tests' requests), never more before a loaded
    sample (frontend.spare_capacity). All come back once interactive traffic has been gone 2 s."""
    assert _gauge(env.frontend, "pdserve_frontend_batch_slots") == 8  # the default --batch-max-inflight, idle
    body = {"model": NAME, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as http, http.stream(
            "POST", f"{env.frontend.base_url}/v1/chat/completions", json=body,
            headers={"authorization": f"Bearer {KEYS['alpha']}"}) as streaming:
        chunks = streaming.iter_bytes()
        next(chunks)  # one interactive request in flight
        assert _gauge(env.frontend, "pdserve_frontend_batch_slots") in (0, 1)
    deadline = time.monotonic() + 30
    while _gauge(env.frontend, "pdserve_frontend_batch_slots") != 8:  # the client hung up: idle again
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert _gauge(env.frontend, "pdserve_frontend_batch_lines_in_flight") == 0
    env.cluster.wait_clean()


def test_objects_match_the_openai_spec(env: Env) -> None:
    schemas = OpenAPISchemas()
    client = env.client()
    ok = _wait(client, _submit(client, [_req("s1"), _req("s2", max_tokens=10**6)], metadata={"a": "b"}).id)
    bad = _wait(client, _submit(client, [b"{", _req("s")]).id)
    base = f"{env.frontend.base_url}/v1"
    auth = {"authorization": f"Bearer {KEYS['alpha']}"}
    with httpx.Client(timeout=60, headers=auth) as http:
        checks = [("Batch", http.get(f"{base}/batches/{ok.id}")), ("Batch", http.get(f"{base}/batches/{bad.id}")),
                  ("ListBatchesResponse", http.get(f"{base}/batches", params={"limit": "3"})),
                  ("OpenAIFile", http.get(f"{base}/files/{ok.output_file_id}")),
                  ("ListFilesResponse", http.get(f"{base}/files", params={"limit": "3"})),
                  ("ErrorResponse", http.get(f"{base}/files/file-nope")),
                  ("DeleteFileResponse", http.delete(f"{base}/files/{ok.error_file_id}"))]
        for name, r in checks:
            assert r.status_code < 500, r.text
            assert schemas.errors(name, r.json()) == [], (name, r.json(), schemas.errors(name, r.json()))
