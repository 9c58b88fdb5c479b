"""The load generator (`pdserve bench`): distributions, arrival schedules, synthetic prompts, traces,
percentiles, SLO and goodput arithmetic, the streamed client against scripted responses; then a smoke
run of the command against a real `pdserve up --model tiny`. No timing assertions: only counts,
orderings and arithmetic on hand-made records."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.planner.loadgen.client import RequestRecord, Target, api_base, send
from pdserve.planner.loadgen.metrics import SLO, is_good, parse_duration, parse_slos, percentile, summarize
from pdserve.planner.loadgen.runner import next_auto_rate
from pdserve.planner.loadgen.workload import (
    LengthDist,
    MixtureDist,
    RequestSpec,
    TextMaker,
    TraceError,
    Workload,
    WorkloadConfig,
    parse_dist,
    poisson_arrivals,
    read_trace,
)
from testing.up_cluster import REPO_ROOT, UpCluster

# --- distributions and schedules ------------------------------------------------------------------


def test_parse_dist_forms_and_errors() -> None:
    assert parse_dist("512") == LengthDist("fixed", 512)
    assert parse_dist("uniform:32:512") == LengthDist("uniform", 32, 512)
    assert parse_dist("normal:100:20") == LengthDist("normal", 100, 20)
    for bad in ("0", "-3", "abc", "uniform:5", "uniform:9:3", "uniform:1.5:3", "normal:0:1", "normal:10:-1",
                "zipf:1:2", "uniform:1:2:3"):
        with pytest.raises(ValueError, match="bad length"):
            parse_dist(bad)


def test_distributions_sample_in_range() -> None:
    rng = random.Random(1)
    assert {parse_dist("7").sample(rng) for _ in range(10)} == {7}
    uni = [parse_dist("uniform:32:64").sample(rng) for _ in range(4000)]
    assert min(uni) == 32 and max(uni) == 64
    assert abs(statistics.mean(uni) - 48) < 1.0
    norm = [parse_dist("normal:200:30").sample(rng) for _ in range(4000)]
    assert abs(statistics.mean(norm) - 200) < 3 and 25 < statistics.stdev(norm) < 35
    assert min(parse_dist("normal:2:50").sample(rng) for _ in range(500)) == 1  # clipped at one token


def test_mixture_of_lengths() -> None:
    mix = parse_dist("0.8*uniform:64:256+0.2*uniform:1024:4096")
    assert isinstance(mix, MixtureDist) and str(mix) == "0.8*uniform:64:256+0.2*uniform:1024:4096"
    assert parse_dist(str(mix)) == mix
    rng = random.Random(3)
    draws = [mix.sample(rng) for _ in range(5000)]
    long = [d for d in draws if d >= 1024]
    assert all(64 <= d <= 256 or 1024 <= d <= 4096 for d in draws)
    assert abs(len(long) / len(draws) - 0.2) < 0.02
    assert abs(statistics.mean(long) - 2560) < 60
    assert {parse_dist("1*7+3*7").sample(rng) for _ in range(20)} == {7}
    for bad in ("0*5+1*6", "x*5", "0.5*uniform:9:3+1*4", "5+6", "1*"):
        with pytest.raises(ValueError, match="bad length"):
            parse_dist(bad)


def test_poisson_schedule_mean_gap_and_bounds() -> None:
    arrivals = poisson_arrivals(10.0, random.Random(0), n=5000)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert arrivals[0] == 0.0 and all(g >= 0 for g in gaps) and len(arrivals) == 5000
    assert abs(statistics.mean(gaps) - 0.1) < 0.005  # 1/rate, within 5% for this seed
    # coefficient of variation 1: exponential gaps, not a fixed pacing
    assert 0.9 < statistics.stdev(gaps) / statistics.mean(gaps) < 1.1
    windowed = poisson_arrivals(10.0, random.Random(0), duration=20.0)
    assert max(windowed) < 20.0 and 150 < len(windowed) < 250
    assert poisson_arrivals(math.inf, random.Random(0), n=3) == [0.0, 0.0, 0.0]
    assert poisson_arrivals(5.0, random.Random(7), n=50) == poisson_arrivals(5.0, random.Random(7), n=50)
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, random.Random(0), n=3)
    with pytest.raises(ValueError):
        poisson_arrivals(1.0, random.Random(0))


def test_text_maker_exact_with_a_tokenizer(tiny_llama_dir: Path) -> None:
    maker = TextMaker(tiny_llama_dir)
    rng = random.Random(3)
    for n in (1, 2, 17, 100, 333):
        assert maker.count(maker.make(n, rng)) == n
    assert len(TextMaker().make(40, rng).split()) == 40  # no tokenizer: one word a token


def test_workload_is_deterministic_and_groups_share_prefixes(tiny_llama_dir: Path) -> None:
    cfg = WorkloadConfig(parse_dist("uniform:10:30"), parse_dist("8"), shared_prefix_groups=3,
                         shared_prefix_tokens=20, seed=5, tokenizer=str(tiny_llama_dir))
    a, b = Workload(cfg), Workload(cfg)
    specs = [a.spec(i) for i in range(9)]
    assert [s.prompt for s in specs] == [b.spec(i).prompt for i in range(9)]
    assert len({s.prompt for s in specs}) == 9
    assert [s.group for s in specs] == [0, 1, 2] * 3
    assert len({s.system for s in specs}) == 3 and specs[0].system == specs[3].system
    for s in specs:
        assert s.max_tokens == 8 and s.prompt_tokens is not None and 30 <= s.prompt_tokens <= 50


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text(text, encoding="utf-8")
    return path


def test_trace_parses_and_sorts(tmp_path: Path) -> None:
    path = _write(tmp_path, '{"arrival_s": 1.5, "prompt": "hi", "output_tokens": 4}\n\n'
                            '{"arrival_s": 0, "prompt_tokens": 30, "output_tokens": 2}\n')
    entries = read_trace(path)
    assert [e.arrival_s for e in entries] == [0.0, 1.5]
    assert entries[0].prompt_tokens == 30 and entries[1].prompt == "hi"
    spec = Workload(WorkloadConfig(parse_dist("1"), parse_dist("1"))).from_trace(0, entries[0])
    assert len(spec.prompt.split()) == 30 and spec.arrival_s == 0.0 and spec.max_tokens == 2


@pytest.mark.parametrize(("line", "message"), [
    ("not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    ('{"prompt": "x", "output_tokens": 1}', "'arrival_s'"),
    ('{"arrival_s": -1, "prompt": "x", "output_tokens": 1}', "'arrival_s'"),
    ('{"arrival_s": "0", "prompt": "x", "output_tokens": 1}', "'arrival_s'"),
    ('{"arrival_s": 0, "output_tokens": 1}', "exactly one of"),
    ('{"arrival_s": 0, "prompt": "x", "prompt_tokens": 3, "output_tokens": 1}', "exactly one of"),
    ('{"arrival_s": 0, "prompt": "", "output_tokens": 1}', "non-empty"),
    ('{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 1}', "'prompt_tokens'"),
    ('{"arrival_s": 0, "prompt": "x"}', "'output_tokens'"),
    ('{"arrival_s": 0, "prompt": "x", "output_tokens": 2.5}', "'output_tokens'"),
])
def test_trace_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = _write(tmp_path, '{"arrival_s": 0, "prompt": "ok", "output_tokens": 1}\n' + line + "\n")
    with pytest.raises(TraceError, match=message) as err:
        read_trace(path)
    assert f"{path}:2:" in str(err.value)


def test_trace_empty_or_missing(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no requests"):
        read_trace(_write(tmp_path, "\n\n"))
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "absent.jsonl")


# --- metrics ----------------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_slo_and_duration_parsing() -> None:
    assert parse_duration("1s") == 1.0 and parse_duration("50ms") == pytest.approx(0.05)
    assert parse_duration("200us") == pytest.approx(2e-4) and parse_duration("0.5") == 0.5
    assert parse_slos("ttft_p90=1s, tpot_p99=50ms,e2e=3") == [
        SLO("ttft", 90, 1.0), SLO("tpot", 99, 0.05), SLO("e2e", 90, 3.0)]
    assert parse_slos(None) == []
    for bad in ("latency_p90=1s", "ttft_p90", "ttft_p0=1s", "ttft_p90=fast"):
        with pytest.raises(ValueError):
            parse_slos(bad)


def _rec(i: int, ttft: float, e2e: float, tokens: int, itl: list[float] | None = None,
         error: str | None = None) -> RequestRecord:
    rec = RequestRecord(i, start_s=0.1 * i, max_tokens=tokens, ok=True, ttft_s=ttft, itl_s=itl or [],
                        chunks=tokens, usage_output_tokens=tokens, usage_prompt_tokens=10)
    if error:
        rec.fail(error, "scripted")
    rec.finish(e2e)
    return rec


def test_tpot_and_goodput_arithmetic() -> None:
    records = [
        _rec(0, ttft=0.2, e2e=1.2, tokens=11),  # TPOT 100 ms: good
        _rec(1, ttft=0.5, e2e=2.5, tokens=11),  # TPOT 200 ms: misses the TPOT SLO
        _rec(2, ttft=1.5, e2e=2.0, tokens=6),  # TTFT 1.5 s: misses the TTFT SLO
        _rec(3, ttft=0.1, e2e=0.1, tokens=1),  # one token: no TPOT, meets it
        _rec(4, ttft=0.1, e2e=0.3, tokens=3, error="http_500"),
    ]
    assert records[0].tpot_s == pytest.approx(0.1) and records[3].tpot_s is None
    slos = parse_slos("ttft_p75=1s,tpot_p75=150ms")
    assert [is_good(r, slos) for r in records] == [True, False, False, True, False]
    s = summarize(records, duration_s=4.0, slos=slos, attainment_target=0.4)
    assert (s.requests, s.succeeded, s.failed, s.errors) == (5, 4, 1, {"http_500": 1})
    assert s.output_tokens == 11 + 11 + 6 + 1 and s.output_token_rate == pytest.approx(29 / 4)
    assert s.prompt_tokens == 40 and s.request_rate == pytest.approx(1.0)
    assert s.good == 2 and s.attainment == pytest.approx(0.4)
    assert s.goodput_rate == pytest.approx(0.5) and s.goodput_token_rate == pytest.approx(12 / 4)
    assert s.latency["ttft"].p50 == pytest.approx(0.35) and s.latency["tpot"].count == 3
    ttft_slo, tpot_slo = s.slos
    assert ttft_slo.observed_s == pytest.approx(percentile([0.2, 0.5, 1.5, 0.1], 75))
    assert ttft_slo.met_fraction == pytest.approx(0.6) and not ttft_slo.passed  # 60% < 75%
    assert not s.meets_target
    assert summarize(records, 4.0, parse_slos("e2e_p10=10s"), 0.8).meets_target  # 4 of 5 succeeded


def test_itl_slo_uses_the_longest_gap() -> None:
    smooth, stall = _rec(0, 0.1, 1.0, 4, itl=[0.3, 0.3, 0.3]), _rec(1, 0.1, 1.0, 4, itl=[0.05, 0.8, 0.05])
    slos = parse_slos("itl_p90=500ms")
    assert is_good(smooth, slos) and not is_good(stall, slos)
    assert summarize([smooth, stall], 1.0).latency["itl"].count == 6


def test_auto_sweep_doubles_then_bisects() -> None:
    assert next_auto_rate([], 2.0) == 2.0
    assert next_auto_rate([(2.0, True), (4.0, True)], 2.0) == 8.0
    assert next_auto_rate([(2.0, True), (4.0, True), (8.0, False)], 2.0) == 6.0
    assert next_auto_rate([(4.0, True), (8.0, False), (6.0, True), (7.0, False)], 4.0) is None  # 7 <= 6 x 1.2
    assert next_auto_rate([(4.0, False)], 4.0) == 2.0


# --- the client against scripted responses ---------------------------------------------------------


def _sse(*events: Any, done: bool = True) -> bytes:
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return body + (b"data: [DONE]\n\n" if done else b"")


def _chunk(content: str | None = None, finish: str | None = None, usage: dict[str, int] | None = None) -> dict[str, Any]:
    choices = [] if usage else [{"index": 0, "delta": {} if content is None else {"content": content},
                                 "finish_reason": finish}]
    return {"object": "chat.completion.chunk", "choices": choices, "usage": usage}


def _send(response: httpx.Response | Exception) -> tuple[RequestRecord, dict[str, Any]]:
    seen: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content), auth=request.headers.get("authorization"), url=str(request.url))
        if isinstance(response, Exception):
            raise response
        return response

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            target = Target("http://x/v1", "m", api_key="k", ignore_eos=True)
            return await send(http, target, RequestSpec(0, "hello", 4, system="sys"), 0.0)

    return asyncio.run(go()), seen


def test_client_times_a_stream_and_reads_usage() -> None:
    body = _sse(_chunk(""), _chunk("a"), _chunk("b"), _chunk(None), _chunk("c", finish="length"),
                _chunk(usage={"prompt_tokens": 7, "completion_tokens": 4}))
    rec, sent = _send(httpx.Response(200, content=body))
    assert rec.ok and rec.error is None and rec.finish_reason == "length"
    assert (rec.chunks, rec.usage_output_tokens, rec.output_tokens, rec.usage_prompt_tokens) == (3, 4, 4, 7)
    assert len(rec.itl_s) == 2 and rec.ttft_s is not None and rec.e2e_s is not None and rec.ttft_s <= rec.e2e_s
    assert sent["url"] == "http://x/v1/chat/completions" and sent["auth"] == "Bearer k"
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["ignore_eos"] is True and sent["max_tokens"] == 4
    assert sent["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}]


@pytest.mark.parametrize(("response", "kind"), [
    (httpx.Response(429, json={"error": {"message": "slow down"}}), "http_429"),
    (httpx.Response(200, content=_sse(_chunk("a"), {"error": {"message": "node died", "code": "upstream"}})),
     "error_event:upstream"),
    (httpx.Response(200, content=_sse(_chunk("a"), done=False)), "incomplete_stream"),
    (httpx.Response(200, content=_sse(_chunk(""), _chunk(finish="stop"))), "no_output"),
    (httpx.Response(200, content=b"data: {oops\n\n"), "bad_event"),
    (httpx.ConnectError("refused"), "ConnectError"),
])
def test_client_error_kinds(response: httpx.Response | Exception, kind: str) -> None:
    rec, _ = _send(response)
    assert not rec.ok and rec.error == kind and rec.tpot_s is None


def test_api_base() -> None:
    assert api_base("http://h:1") == "http://h:1/v1"
    assert api_base("h:1/") == "http://h:1/v1"
    assert api_base("https://h/openai/v1/") == "https://h/openai/v1"


# --- smoke run against `pdserve up --model tiny` ---------------------------------------------------


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpCluster]:
    cluster = UpCluster.start(tmp_path_factory.mktemp("up"), ["--model", "tiny", "--kv-memory", "64"])
    try:
        yield cluster
    finally:
        cluster.close()


def _bench(up: UpCluster, *flags: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "pdserve.deploy", "bench", up.base_url, "--no-progress", *flags],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.mark.timeout(420)
def test_bench_smoke_against_pdserve_up(up: UpCluster, tmp_path: Path, tiny_llama_dir: Path) -> None:
    out, plots = tmp_path / "result.json", tmp_path / "plots"
    result = _bench(up, "--concurrency", "4", "--max-requests", "8", "--prompt-tokens", "uniform:8:48",
                    "--output-tokens", "12", "--ignore-eos", "--tokenizer", str(tiny_llama_dir),
                    "--slo", "ttft_p90=60s,tpot_p90=10s", "--json", str(out), "--plot", str(plots))
    assert "latency (ms)" in result.stdout and "SLO attainment" in result.stdout
    data = json.loads(out.read_text())
    s, records = data["summary"], data["records"]
    assert data["config"]["target"]["model"] == up.state()["model"]  # the first of /v1/models
    assert (s["requests"], s["succeeded"], s["failed"], len(records)) == (8, 8, 0, 8)
    assert sorted(r["index"] for r in records) == list(range(8))
    for r in records:
        assert r["ok"] and r["finish_reason"] == "length"
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        # ignore_eos: every request runs to max_tokens; the client's count is the server's usage
        assert r["output_tokens"] == r["usage_output_tokens"] == r["max_tokens"] == 12
        assert 1 <= r["chunks"] <= r["output_tokens"] and len(r["itl_s"]) == r["chunks"] - 1
        assert r["local_prompt_tokens"] < r["usage_prompt_tokens"]  # + the chat template's tokens
    assert s["output_tokens"] == sum(r["usage_output_tokens"] for r in records) == 96
    assert s["prompt_tokens"] == sum(r["usage_prompt_tokens"] for r in records)
    assert s["good"] == 8 and s["attainment"] == 1.0 and s["meets_target"]
    assert sorted(p.name for p in plots.iterdir()) == ["itl_cdf.png", "tpot_cdf.png", "ttft_cdf.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in plots.iterdir())


@pytest.mark.timeout(420)
def test_bench_sweep_and_trace_against_pdserve_up(up: UpCluster, tmp_path: Path) -> None:
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    _bench(up, "--sweep", "4,8", "--duration", "1", "--prompt-tokens", "16", "--output-tokens", "4",
           "--slo", "e2e_p50=120s", "--api", "completions", "--json", str(out), "--plot", str(plots))
    data = json.loads(out.read_text())
    assert [step["rate"] for step in data["sweep"]] == [4.0, 8.0] and data["best_rate"] == 8.0
    assert all(step["summary"]["failed"] == 0 for step in data["sweep"])
    assert (plots / "sweep.png").is_file()
    trace = _write(tmp_path, '{"arrival_s": 0, "prompt": "Hello", "output_tokens": 3}\n'
                             '{"arrival_s": 0.2, "prompt_tokens": 20, "output_tokens": 5}\n')
    _bench(up, "--trace", str(trace), "--json", str(out), "--ignore-eos")
    records = json.loads(out.read_text())["records"]
    assert [r["usage_output_tokens"] for r in records] == [3, 5]
