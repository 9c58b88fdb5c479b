"""End-to-end tracing through a real cluster (etcd, 1 prefill + 1 decode node process, the frontend
process) into an in-process OTLP/HTTP receiver, driven by the official openai SDK: one disaggregated
request is one trace whose spans cover the frontend, the decode node and the prefill node with correct
parent links, and whose TTFT stage spans last what the request log's TTFT breakdown says; a client's
traceparent is honoured; errors carry the trace id; without an endpoint nothing is traced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from pdserve.registry.etcd_server import free_port
from testing.cluster import LocalCluster
from testing.procs import FrontendProc, start_frontend

pytestmark = [pytest.mark.timeout(400)]
on_the_cluster = pytest.mark.usefixtures("cluster", "check_integrity_after_each_test")

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-llama"
NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "256", "--block-size", "16",
             "--model-name", MODEL]
STAGES = ("frontend", "prefill_queue", "prefill", "transfer", "reservation_wait", "first_decode_step")
TOLERANCE_MS = 5.0


@dataclass(frozen=True)
class Span:
    service: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: bool

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OTLPReceiver:
    """An OTLP/HTTP receiver on a free loopback port: POST /v1/traces with an ExportTraceServiceRequest
    (protobuf); keeps every span and lets tests wait for a condition on them."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.posts = 0
        self._cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._add(ExportTraceServiceRequest.FromString(body))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _add(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(Span(
                        service=resource.get("service.name", ""), trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(), name=s.name, start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano, attributes={a.key: _value(a.value) for a in s.attributes},
                        error=s.status.code == 2))
        with self._cond:
            self.spans += spans
            self.posts += 1
            self._cond.notify_all()

    def wait(self, condition: Callable[[list[Span]], bool], timeout_s: float = 20.0) -> list[Span]:
        """The spans once `condition(spans)` holds; fails after `timeout_s`."""
        with self._cond:
            ok = self._cond.wait_for(lambda: condition(list(self.spans)), timeout=timeout_s)
            spans = list(self.spans)
        assert ok, f"spans did not arrive: {sorted((s.service, s.name, s.trace_id[:8]) for s in spans)}"
        return spans

    def trace(self, trace_id: str, names: set[str], timeout_s: float = 20.0) -> list[Span]:
        """The spans of one trace once every one of `names` arrived."""
        spans = self.wait(lambda all_: names <= {s.name for s in all_ if s.trace_id == trace_id}, timeout_s)
        return [s for s in spans if s.trace_id == trace_id]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    r = OTLPReceiver()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(scope="module")
def export_fast() -> Iterator[None]:
    """Every process started meanwhile exports its batch of spans within 50 ms (OTEL_BSP_SCHEDULE_DELAY);
    the endpoint comes from the flags alone."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        mp.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
        yield


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, receiver: OTLPReceiver,
            export_fast: None) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("tracing"), model_dir,
                      node_args=[*NODE_ARGS, "--otlp-endpoint", receiver.endpoint]) as c:
        # Threshold 0: every prompt is prefilled on the prefill node, its K/V shipped to the decode node.
        c.start(1, 1, decode_args=["--local-prefill-threshold", "0"])
        yield c
        c.wait_clean()


@dataclass(frozen=True)
class TracedFrontend:
    proc: FrontendProc
    request_log: Path

    def log_line(self, key: str, value: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """The request log line whose `key` is `value` (written as the request ends: waited for)."""
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.request_log.read_text() if self.request_log.exists() else ""
            for line in text.splitlines():
                record = json.loads(line)
                if record.get(key) == value:
                    return record
            assert time.monotonic() < deadline, f"no request log line with {key}={value}: {text[-2000:]}"
            time.sleep(0.02)  # the poll interval


@pytest.fixture(scope="module")
def frontend(cluster: LocalCluster, model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
             receiver: OTLPReceiver) -> Iterator[TracedFrontend]:
    logs = tmp_path_factory.mktemp("tracing-fe")
    request_log = logs / "requests.log"
    fe = start_frontend("frontend", logs, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                        "--model", f"{MODEL}={model_dir}", "--log-level", "warning", "--request-log", str(request_log),
                        "--otlp-endpoint", receiver.endpoint)
    try:
        yield TracedFrontend(fe, request_log)
    finally:
        assert fe.stop() == 0, fe.proc.tail()
        assert "Traceback" not in fe.proc.log_text(), fe.proc.tail(80)


def client_of(fe: FrontendProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key="sk-test", max_retries=0, timeout=120)


FRONTEND_SPANS = {"POST /v1/chat/completions", "frontend.dispatch", "frontend.admission", "frontend.parse",
                  "frontend.tokenize", "frontend.routing", "frontend.limits", "frontend.upstream", "frontend.stream"}
DECODE_SPANS = {"decode.generate", "decode.reservation_wait", "decode.kv_wait", "decode.first_step", "decode.decode"}
PREFILL_SPANS = {"prefill.request", "prefill.queue", "prefill.compute", "prefill.kv_send"}


def one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{len(found)} spans named {name}"
    return found[0]


@on_the_cluster
def test_one_disaggregated_request_is_one_trace_whose_stages_match_the_ttft_breakdown(
    frontend: TracedFrontend, receiver: OTLPReceiver,
) -> None:
    client = client_of(frontend.proc)
    messages = [{"role": "user", "content": "Tell me a story about a fox and a crow in the forest."}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                           temperature=0, max_tokens=12, stream=True)
    trace_id = raw.headers["x-trace-id"]
    chunks = list(raw.parse())
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert len(trace_id) == 32 and int(trace_id, 16)

    spans = receiver.trace(trace_id, FRONTEND_SPANS | DECODE_SPANS | PREFILL_SPANS)
    assert {s.service for s in spans} == {"pdserve-frontend", "pdserve-decode", "pdserve-prefill"}
    # One trace, one root (the frontend's request span), every other span's parent in the trace.
    ids = {s.span_id for s in spans}
    assert len(ids) == len(spans)
    roots = [s for s in spans if not s.parent_id]
    assert [r.name for r in roots] == ["POST /v1/chat/completions"]
    assert all(s.parent_id in ids for s in spans if s.parent_id)
    by_id = {s.span_id: s for s in spans}

    def parent(name: str) -> str:
        return by_id[one(spans, name).parent_id].name

    # The context crossed both gRPC hops: frontend -> decode -> prefill.
    assert parent("decode.generate") == "frontend.upstream"
    assert parent("decode.kv_wait") == "decode.generate"
    assert parent("prefill.request") == "decode.kv_wait"
    assert {parent(n) for n in ("prefill.queue", "prefill.compute", "prefill.kv_send")} == {"prefill.request"}
    assert parent("frontend.admission") == "frontend.dispatch"
    assert parent("frontend.routing") == "frontend.admission"
    assert not any(s.error for s in spans), [s.name for s in spans if s.error]
    for s in spans:  # a parent encloses its children (the processes share the machine's clock)
        if s.parent_id:
            p = by_id[s.parent_id]
            # A server's span may end just after its client saw the last message (the handler returns
            # after sending it): across processes the end is allowed 50 ms of slack.
            slack = 1000 if p.service == s.service else 50_000_000
            assert p.start_ns <= s.start_ns + 1000 and s.end_ns <= p.end_ns + slack, (p.name, s.name)
    root = roots[0]
    assert root.attributes["http.response.status_code"] == 200

    # Each TTFT stage has one span, lasting what the request log's breakdown (the metric's numbers) says.
    record = frontend.log_line("trace_id", trace_id)
    assert record["routes"][0]["path"] == "disaggregated"
    breakdown = record["ttft_breakdown_ms"]
    stage_spans = {s.attributes["pdserve.ttft_stage"]: s for s in spans if "pdserve.ttft_stage" in s.attributes}
    assert set(stage_spans) == set(STAGES) and set(breakdown) == set(STAGES)
    assert breakdown["transfer"] > 0 and breakdown["first_decode_step"] > 0  # the complete timing
    diffs = {stage: round(abs(stage_spans[stage].ms - breakdown[stage]), 4) for stage in STAGES}
    print("span vs TTFT breakdown (ms):", {k: (round(stage_spans[k].ms, 3), breakdown[k], diffs[k]) for k in STAGES})
    assert all(d <= TOLERANCE_MS for d in diffs.values()), diffs
    assert record["routes"][0]["request_id"] == one(spans, "decode.generate").attributes["pdserve.request_id"]


@on_the_cluster
def test_a_client_traceparent_is_honoured(frontend: TracedFrontend, receiver: OTLPReceiver) -> None:
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    client = client_of(frontend.proc)
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0,
        extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
    assert raw.headers["x-trace-id"] == trace_id
    assert raw.parse().choices[0].text
    spans = receiver.trace(trace_id, {"POST /v1/completions", "decode.generate", "prefill.request"})
    root = one(spans, "POST /v1/completions")
    assert root.parent_id == parent_id  # the client's span is the parent of the whole request
    ids = {s.span_id for s in spans}
    assert all(s.parent_id in ids for s in spans if s is not root)
    assert frontend.log_line("trace_id", trace_id)["status"] == 200


@on_the_cluster
def test_an_error_response_carries_the_trace_id(frontend: TracedFrontend, receiver: OTLPReceiver) -> None:
    client = client_of(frontend.proc)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=10**7)
    err = info.value
    trace_id = err.response.headers["x-trace-id"]
    body = err.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["message"].endswith(f"(trace id {trace_id})")
    assert frontend.log_line("trace_id", trace_id)["status"] == 400
    spans = receiver.trace(trace_id, {"POST /v1/chat/completions"})
    assert len(spans) == 1 and spans[0].error and spans[0].attributes["http.response.status_code"] == 400


@on_the_cluster
def test_without_an_endpoint_the_frontend_traces_nothing(
    cluster: LocalCluster, model_dir: Path, tmp_path_factory: pytest.TempPathFactory, receiver: OTLPReceiver,
) -> None:
    """A frontend started without --otlp-endpoint (and without the environment variable) exports
    nothing and sends no traceparent: the traced decode node starts a trace of its own."""
    logs = tmp_path_factory.mktemp("untraced-fe")
    fe = start_frontend("frontend-untraced", logs, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                        "--model", f"{MODEL}={model_dir}", "--log-level", "warning")
    try:
        raw = client_of(fe).completions.with_raw_response.create(model=MODEL, prompt="The crow", max_tokens=3,
                                                                 temperature=0)
        assert "x-trace-id" not in raw.headers
        rid = f"{raw.parse().id}-0"
        def named(all_: list[Span], name: str) -> list[Span]:
            return [s for s in all_ if s.name == name and s.attributes["pdserve.request_id"] == rid]

        spans = receiver.wait(lambda all_: bool(named(all_, "decode.generate") and named(all_, "prefill.request")))
        [generate], [prefill] = named(spans, "decode.generate"), named(spans, "prefill.request")
        assert generate.parent_id == ""  # no context came with the call: the decode node started a trace
        assert prefill.trace_id == generate.trace_id  # which goes on to the prefill node
        assert not [s for s in spans if s.trace_id == generate.trace_id and s.service == "pdserve-frontend"]
    finally:
        assert fe.stop() == 0, fe.proc.tail()


def test_no_tracing_objects_without_an_endpoint(tiny_llama_dir: Path) -> None:
    """In a fresh interpreter: the frontend and node configs without an endpoint make no tracer, and
    the OpenTelemetry SDK is never imported."""
    code = (
        "import sys, time\n"
        "from pdserve.frontend.config import FrontendConfig, ModelSpec\n"
        "from pdserve.frontend.pipeline import Frontend\n"
        "from pdserve.prefill_node.config import PrefillNodeConfig\n"
        "from pdserve.rpc.tracing import start_tracing\n"
        f"fe = Frontend(FrontendConfig(etcd_endpoints=('127.0.0.1:1',), models=(ModelSpec('tiny', {str(tiny_llama_dir)!r}),),"
        " prepare_workers=1))\n"
        f"node, _ = PrefillNodeConfig.from_argv(['--node-id', 'p0', '--etcd', '127.0.0.1:1', '--model', {str(tiny_llama_dir)!r}])\n"
        "assert fe.tracer is None and not node.tracing.enabled\n"
        "assert start_tracing(node.tracing, 'x', {}, time.monotonic) is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk') or m.startswith('opentelemetry.exporter')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OTEL_EXPORTER_OTLP_ENDPOINT"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
    # The environment variable alone turns it on.
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:4318"
    code_env = ("from pdserve.frontend.config import build_parser, config_from_args\n"
                f"args = build_parser().parse_args(['--etcd', 'x:1', '--model', 'tiny={tiny_llama_dir}'])\n"
                "print(config_from_args(args).tracing.traces_url)\n")
    out = subprocess.run([sys.executable, "-c", code_env], cwd=REPO_ROOT, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "http://127.0.0.1:4318/v1/traces"


def test_pdserve_up_passes_the_tracing_options_to_every_process(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`pdserve up --otlp-endpoint URL --trace-sample-ratio R`: every node and the frontend is started with
    them (each process's own parser reads them back); without the flag none is passed, so the processes
    follow the $OTEL_EXPORTER_OTLP_ENDPOINT they inherit."""
    import argparse
    from types import SimpleNamespace

    from pdserve.deploy.cli import build_parser as pdserve_parser
    from pdserve.deploy.launcher.config import build_config
    from pdserve.deploy.launcher.process import Slot, command
    from pdserve.frontend.config import build_parser as frontend_parser
    from pdserve.node_common.config import add_node_args
    from pdserve.rpc.tracing import tracing_config_from_args

    def resolve(_: str | None) -> Any:
        return SimpleNamespace(path=tiny_llama_dir, name="tiny")

    node_parser = argparse.ArgumentParser()
    add_node_args(node_parser)
    for flags, want in ((["--otlp-endpoint", "http://collector:4318", "--trace-sample-ratio", "0.25"],
                         ("http://collector:4318/v1/traces", 0.25)), ([], None)):
        args = pdserve_parser().parse_args(["up", "--model", str(tiny_llama_dir), "--runs-dir", str(tmp_path), *flags])
        cfg = build_config(args, resolve)
        for pool, parser in (("prefill", node_parser), ("decode", node_parser), ("frontend", frontend_parser())):
            argv = command(cfg, Slot(f"{pool}-0", pool, tmp_path / "log"), ["127.0.0.1:2379"], tmp_path)
            module_at = argv.index("-m") + 2
            parsed, _ = parser.parse_known_args(argv[module_at:])
            assert parsed.otlp_endpoint is None if want is None else parsed.otlp_endpoint == "http://collector:4318"
            if want is not None:
                got = tracing_config_from_args(parsed)
                assert (got.traces_url, got.sample_ratio) == want, pool


def test_sampling_follows_the_ratio_and_the_parent_and_shutdown_flushes(receiver: OTLPReceiver) -> None:
    """Ratio 0 records nothing but still propagates the context (flag "not sampled"), and a process
    following such a parent records nothing either; `shutdown` exports what is queued (no schedule delay
    waited for); a span lasts exactly end - start of the clock readings it was given."""
    from pdserve.rpc.tracing import TracingConfig, start_tracing

    never = start_tracing(TracingConfig(receiver.endpoint, 0.0), "unit-never", {}, time.monotonic)
    always = start_tracing(TracingConfig(receiver.endpoint, 1.0), "unit-always", {}, time.monotonic)
    assert never is not None and always is not None
    now = time.monotonic()
    dropped = never.span("unit.dropped", parent=None, start=now, end=now + 0.001)
    metadata = never.metadata(dropped)
    assert [k for k, _ in metadata] == ["traceparent"] and not int(metadata[0][1].split("-")[3], 16) & 1
    always.span("unit.unsampled_child", parent=always.extract(metadata), start=now, end=now + 0.001)
    kept = always.span("unit.kept", parent=None, start=now, end=now + 0.0025)
    always.span("unit.kept_child", parent=always.extract(always.metadata(kept)), start=now, end=now + 0.001)
    never.shutdown()
    always.shutdown()
    with receiver._cond:
        spans = [s for s in receiver.spans if s.name.startswith("unit.")]
    assert sorted(s.name for s in spans) == ["unit.kept", "unit.kept_child"]
    assert one(spans, "unit.kept").end_ns - one(spans, "unit.kept").start_ns == 2_500_000
    assert one(spans, "unit.kept_child").parent_id == one(spans, "unit.kept").span_id


def test_tracing_options_are_validated() -> None:
    from pdserve.rpc.tracing import TracingConfig, add_tracing_args, tracing_config_from_args

    for bad in (dict(otlp_endpoint="collector:4318"), dict(otlp_endpoint="ftp://c"), dict(sample_ratio=1.5)):
        with pytest.raises(ValueError):
            TracingConfig(**bad)  # type: ignore[arg-type]
    import argparse

    parser = argparse.ArgumentParser()
    add_tracing_args(parser)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318/")
        assert tracing_config_from_args(parser.parse_args([])).traces_url == "http://env:4318/v1/traces"
        assert not tracing_config_from_args(parser.parse_args(["--otlp-endpoint", ""])).enabled  # the flag wins
        got = tracing_config_from_args(parser.parse_args(["--otlp-endpoint", "https://c/v1/traces"]))
        assert got.traces_url == "https://c/v1/traces"


def test_shutdown_does_not_wait_for_an_unreachable_receiver() -> None:
    """A process stopping while its receiver is down exits after `shutdown`'s timeout, not after the
    exporter's retries (seconds of backoff)."""
    from pdserve.rpc.tracing import TracingConfig, start_tracing

    tracer = start_tracing(TracingConfig(f"http://127.0.0.1:{free_port()}"), "unit-down", {}, time.monotonic)
    assert tracer is not None
    now = time.monotonic()
    for _ in range(5):
        tracer.span("unit.lost", parent=None, start=now, end=now + 0.001)
    began = time.monotonic()
    tracer.shutdown(timeout_s=0.5)
    assert time.monotonic() - began < 2.0


@pytest.fixture(scope="module")
def decode_only(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, receiver: OTLPReceiver,
                export_fast: None) -> Iterator[tuple[LocalCluster, TracedFrontend]]:
    """A cluster whose decode node prefills every prompt itself (threshold above any prompt here)."""
    with LocalCluster(tmp_path_factory.mktemp("tracing-local"), model_dir,
                      node_args=[*NODE_ARGS, "--otlp-endpoint", receiver.endpoint]) as c:
        c.start(1, 1, decode_args=["--local-prefill-threshold", "100000"])
        logs = tmp_path_factory.mktemp("tracing-local-fe")
        fe = start_frontend("frontend-local", logs, c.etcd_endpoints, free_port(), "--cluster", c.cluster,
                            "--model", f"{MODEL}={model_dir}", "--log-level", "warning", "--request-log",
                            str(logs / "requests.log"), "--otlp-endpoint", receiver.endpoint)
        try:
            yield c, TracedFrontend(fe, logs / "requests.log")
        finally:
            assert fe.stop() == 0, fe.proc.tail()
        c.wait_clean()


def test_a_request_prefilled_on_the_decode_node(decode_only: tuple[LocalCluster, TracedFrontend],
                                                receiver: OTLPReceiver) -> None:
    """Prefilled on the decode node: the trace has no prefill-node spans, and its `prefill` stage span
    (arrival to the first message on the decode node) lasts what the breakdown says, which the last
    message repeats instead of measuring anew."""
    cluster, frontend = decode_only
    client = client_of(frontend.proc)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], temperature=0, max_tokens=16,
        stream=True, extra_body={"ignore_eos": True})
    trace_id = raw.headers["x-trace-id"]
    assert len(list(raw.parse())) > 1
    spans = receiver.trace(trace_id, FRONTEND_SPANS | {"decode.generate", "decode.prefill", "decode.decode"})
    assert {s.service for s in spans} == {"pdserve-frontend", "pdserve-decode"}
    ids = {s.span_id for s in spans}
    assert [s.name for s in spans if not s.parent_id] == ["POST /v1/chat/completions"]
    assert all(s.parent_id in ids for s in spans if s.parent_id)
    record = frontend.log_line("trace_id", trace_id)
    assert record["routes"][0]["path"] == "local_prefill"
    breakdown = record["ttft_breakdown_ms"]
    stage_spans = {s.attributes["pdserve.ttft_stage"]: s for s in spans if "pdserve.ttft_stage" in s.attributes}
    assert set(stage_spans) == {"frontend", "prefill"}
    assert all(breakdown[stage] == 0 for stage in set(STAGES) - set(stage_spans))
    diffs = {stage: round(abs(span.ms - breakdown[stage]), 4) for stage, span in stage_spans.items()}
    print("local prefill, span vs TTFT breakdown (ms):", {k: (round(v.ms, 3), breakdown[k]) for k, v in stage_spans.items()})
    assert all(d <= TOLERANCE_MS for d in diffs.values()), diffs
    # The prefill stage ends at the first message, well before the last of 16 tokens.
    assert stage_spans["prefill"].end_ns < one(spans, "decode.decode").end_ns
    assert breakdown["prefill"] < record["e2e_ms"]
    cluster.check_integrity()


def test_migrations_and_a_mid_stream_error_event_in_the_trace(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path, receiver: OTLPReceiver, export_fast: None,
) -> None:
    """Against scripted decode nodes that fail a seeded request after its second token: each Generate call
    (the first and the two migrations) is a span of its own, the superseded ones marked failed; the SSE
    error event that ends the stream names the trace (the stream's x-trace-id header does too)."""
    from pdserve.registry import EtcdServer
    from testing.procs import start_scripted_node

    fail_seed = 4242
    tmp = tmp_path_factory.mktemp("tracing-scripted")
    with EtcdServer(tmp / "etcd") as etcd:
        node = start_scripted_node("scripted", tmp, etcd.endpoints, "--tokenizer", str(tiny_llama_dir), "--reply",
                                   "The quick brown fox jumps over the lazy dog.", "--model", MODEL, "--node-id", "d",
                                   "--num-nodes", "2", "--prefill-ids", "p0", "--fail-seed", str(fail_seed))
        try:
            fe = start_frontend("frontend-scripted", tmp, etcd.endpoints, free_port(), "--model",
                                f"{MODEL}={tiny_llama_dir}", "--log-level", "warning", "--request-log", "off",
                                "--otlp-endpoint", receiver.endpoint)
            try:
                raw = client_of(fe).chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10, stream=True,
                    seed=fail_seed, temperature=0.5)
                trace_id = raw.headers["x-trace-id"]
                with pytest.raises(openai.APIError) as failed:
                    list(raw.parse())
            finally:
                assert fe.stop() == 0, fe.proc.tail()
        finally:
            node.stop()
    assert failed.value.message.endswith(f"(trace id {trace_id})")
    spans = receiver.trace(trace_id, {"POST /v1/chat/completions", "frontend.upstream", "frontend.stream"})
    calls = sorted((s for s in spans if s.name == "frontend.upstream"), key=lambda s: s.start_ns)
    assert [c.attributes["pdserve.migrations"] for c in calls] == [0, 1, 2]
    assert all(c.error for c in calls)  # two superseded, the last one ended without finishing
    root = one(spans, "POST /v1/chat/completions")
    assert root.error and root.attributes["http.response.status_code"] == 502
