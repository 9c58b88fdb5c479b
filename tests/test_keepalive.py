"""SSE keep-alive: a streamed request that waits longer for its first token (or for its next one) than a
proxy's idle timeout survives, because the frontend sends an SSE comment line every `--sse-keepalive-s`
seconds while nothing else flows. Real parts: etcd, a scripted decode node (a real gRPC upstream whose
first token takes 5 s), the frontend process, a TCP proxy that cuts connections idle for 2 s, and the
official openai SDK."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import tokenizers
from prometheus_client.parser import text_string_to_metric_families

from pdserve.registry import EtcdServer
from pdserve.registry.etcd_server import free_port
from testing.idle_proxy import IdleProxy
from testing.openapi import OpenAPISchemas
from testing.procs import FrontendProc, start_frontend, start_scripted_node
from testing.recording import RecordingTransport, conformance_problems

pytestmark = pytest.mark.timeout(120)

REPLY = "Patience is a virtue, and waiting is an art."
WAIT_S = 5.0  # the scripted node's time to first token
IDLE_S = 2.0  # the proxy's idle timeout


@pytest.fixture(scope="module")
def frontend(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Iterator[FrontendProc]:
    tmp = tmp_path_factory.mktemp("keepalive")
    with EtcdServer(tmp / "etcd") as etcd:
        node = start_scripted_node("scripted-patient", tmp, etcd.endpoints, "--tokenizer", str(tiny_llama_dir),
                                   "--reply", REPLY, "--model", "tiny-llama", "--node-id", "patient", "--prefill-ids", "p0",
                                   "--first-token-ms", str(int(WAIT_S * 1000)), "--token-interval-ms", "10")
        try:
            fe = start_frontend("frontend", tmp, etcd.endpoints, free_port(), "--model",
                                f"tiny-llama={tiny_llama_dir}", "--sse-keepalive-s", "1", "--log-level", "warning")
            try:
                yield fe
            finally:
                assert fe.stop() == 0, fe.proc.tail()
                assert "Traceback" not in fe.proc.log_text(), fe.proc.tail(80)
        finally:
            node.stop()


def keepalives(fe: FrontendProc) -> float:
    text = httpx.get(f"{fe.base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "pdserve_frontend_sse_keepalives":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("no pdserve_frontend_sse_keepalives metric")


def test_stream_waiting_past_the_proxy_idle_timeout_completes(frontend: FrontendProc, tiny_llama_dir: Path) -> None:
    tok = tokenizers.Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    n = len(tok.encode(REPLY, add_special_tokens=False).ids)
    before = keepalives(frontend)
    with IdleProxy("127.0.0.1", frontend.port, idle_s=IDLE_S) as proxy:
        transport = RecordingTransport()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key="none", max_retries=0,
                               http_client=httpx.Client(transport=transport, timeout=60))
        start = time.monotonic()
        stream = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "wait"}],
                                                stream=True, max_tokens=n)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        waited = time.monotonic() - start
        assert text == tok.decode(tok.encode(REPLY, add_special_tokens=False).ids)
        assert waited >= WAIT_S and proxy.cuts == 0
        body = bytes(transport.records[0].body)
        assert body.startswith(b": keep-alive\n\n")  # the response started with comments, not data
        assert body.count(b": keep-alive\n\n") >= int(WAIT_S) - 1
        checked, problems = conformance_problems(OpenAPISchemas(), transport.records)
        assert problems == [] and checked >= 1

        # The control: the same wait without a stream (nothing can be sent before the body) is cut.
        with pytest.raises(openai.APIConnectionError):
            client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "wait"}],
                                           max_tokens=n)
        assert proxy.cuts == 1
    assert keepalives(frontend) - before >= int(WAIT_S) - 1
