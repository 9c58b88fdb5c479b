"""Frontend overhead: pdserve's frontend and litellm's proxy, each in front of the same scripted upstream.

The upstream is `testing/scripted_decode_node.py`: a real DecodeNode gRPC server (what the frontend talks
to) that also serves the same pre-made tokens over OpenAI HTTP (what litellm talks to), with no model
and no delays, so what is measured is the proxy. Each proxy is compared with its own upstream reached
directly: the frontend with a gRPC client calling Generate, litellm with an HTTP client.

Measured, in one run, per proxy process (one frontend process; litellm with one worker):
  * added time to first token chunk at concurrency 1, p50/p99 (proxy minus direct upstream);
  * SSE chunks/s at concurrency 16 (every `data:` event but [DONE]);
  * requests/s for short non-streamed calls at concurrency 16.
Targets for the frontend: <= 2 ms added p50, >= 20,000 chunks/s, >= 300 requests/s.

The web console's cost when nobody has it open: a second frontend with `--no-console` in front of the same
upstream, the two measured in turns (on, off, on, off, ...: `--console-reps` each); each figure's median
with the console on over the median with it off, next to the noise (the spread between the repetitions
of one configuration).

The load generator is a minimal keep-alive HTTP/1.1 client on asyncio (uvloop when installed), so that
the client costs little next to what it measures. litellm is looked up as `litellm` on PATH or given
with --litellm; it is not a project dependency (`pip install 'litellm[proxy]'` in a separate venv).

    .venv/bin/python bench/frontend_bench.py [--duration 5] [--litellm PATH | --no-litellm] [--json out.json]
    .venv/bin/python bench/frontend_bench.py --quick   # seconds-long smoke run (tests/test_frontend_bench.py)

The report starts with the CPU's vector instruction sets (`bench/cpu_isa.py`), since the figures depend on them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import orjson  # noqa: E402

from bench.cpu_isa import isa_summary  # noqa: E402
from pdserve.engine.tiny import default_model_dir  # noqa: E402
from pdserve.frontend.tenants import hash_key  # noqa: E402
from pdserve.registry import EtcdServer  # noqa: E402
from pdserve.registry.etcd_server import free_port  # noqa: E402
from pdserve.rpc import pdserve_pb2 as pb  # noqa: E402
from pdserve.rpc import pdserve_pb2_grpc as pbg  # noqa: E402
from testing.procs import Proc, spawn, start_frontend, start_scripted_node, wait_for_http  # noqa: E402

MODEL = "tiny-llama"
API_KEY = "sk-bench-0123456789abcdef0123"
PROMPT = [{"role": "user", "content": "Say something."}]


@dataclass(frozen=True)
class BenchConfig:
    duration_s: float
    ttfb_samples: int
    concurrency: int
    stream_tokens: int
    short_tokens: int
    litellm: str | None
    json_out: str | None
    console_reps: int = 2


# --- a minimal HTTP/1.1 client ----------------------------------------------------------------------


class HttpResult(NamedTuple):
    status: int
    first_byte_s: float
    first_event_s: float  # first SSE event (streams) or the whole body (JSON)
    events: int  # SSE events, [DONE] included


class LoadResult(NamedTuple):
    requests_per_s: float
    chunks_per_s: float
    errors: int
    cpu_fraction: float  # CPU seconds the server used per wall second (1.0 = one core busy)


class HttpConnection:
    """One keep-alive connection; `request` sends a POST and reads the whole response."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def request(self, path: str, body: bytes, headers: bytes) -> HttpResult:
        """Sends a POST and reads the whole response."""
        if self.writer is None:
            await self._connect()
        assert self.reader is not None and self.writer is not None
        t0 = time.perf_counter()
        self.writer.write(b"POST %b HTTP/1.1\r\nhost: %b\r\ncontent-type: application/json\r\n%bcontent-length: %d"
                          b"\r\n\r\n%b" % (path.encode(), self.host.encode(), headers, len(body), body))
        head = await self.reader.readuntil(b"\r\n\r\n")
        t_first = time.perf_counter() - t0
        status = int(head.split(b" ", 2)[1])
        lower = head.lower()
        events, t_data = 0, 0.0
        if b"transfer-encoding: chunked" in lower:
            # De-chunk from large reads: per-event awaits would make the client cost as much as the server.
            buf, pos, newline_before = b"", 0, False
            while True:
                nl = buf.find(b"\r\n", pos)
                while nl < 0:
                    buf, pos = buf[pos:] + await self._more(), 0
                    nl = buf.find(b"\r\n")
                size = int(buf[pos:nl].split(b";")[0], 16)
                start = nl + 2
                while len(buf) < start + size + 2:
                    buf, start, pos = buf[pos:] + await self._more(), start - pos, 0
                if size == 0:
                    break
                data = buf[start:start + size]
                n = data.count(b"\n\n") + (newline_before and data[:1] == b"\n")
                if n and not events:
                    t_data = time.perf_counter() - t0
                events += n
                newline_before = data[-1:] == b"\n"
                pos = start + size + 2
        else:
            length = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
            await self.reader.readexactly(length)
            t_data = time.perf_counter() - t0
        if b"connection: close" in lower:
            self.writer.close()
            self.writer = None
        return HttpResult(status, t_first, t_data, events)

    async def _more(self) -> bytes:
        assert self.reader is not None
        data = await self.reader.read(1 << 16)
        if not data:
            raise ConnectionError(f"{self.host}:{self.port} closed the connection mid-response")
        return data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


@dataclass(frozen=True)
class HttpTarget:
    name: str
    host: str
    port: int
    auth: bytes  # an Authorization header line, or b""
    pid: int | None = None  # the serving process, whose CPU time is read around each phase

    def cpu_s(self) -> float:
        """CPU seconds (user + system, all threads) the serving process has used so far."""
        if self.pid is None:
            return 0.0
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def body(self, max_tokens: int, stream: bool) -> bytes:
        obj: dict[str, Any] = {"model": MODEL, "messages": PROMPT, "max_tokens": max_tokens, "stream": stream}
        return orjson.dumps(obj)


# --- measurements --------------------------------------------------------------------------------


@dataclass
class Result:
    name: str
    ttft_ms_p50: float = 0.0
    ttft_ms_p99: float = 0.0
    chunks_per_s: float = 0.0
    requests_per_s: float = 0.0
    errors: int = 0
    stream_cpu: float = 0.0  # server CPU cores busy during the chunks/s phase
    short_cpu: float = 0.0  # ... during the requests/s phase


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def http_ttft(target: HttpTarget, samples: int) -> list[float]:
    """Sequential one-token streams: seconds to the first data event. Raises on any failed request."""
    conn = HttpConnection(target.host, target.port)
    body = target.body(1, stream=True)
    out = []
    for i in range(samples + 20):
        res = await conn.request("/v1/chat/completions", body, target.auth)
        if res.status != 200 or not res.events:
            raise RuntimeError(f"{target.name}: a one-token stream failed with status {res.status}")
        if i >= 20:  # warm-up
            out.append(res.first_event_s)
    conn.close()
    return out


async def grpc_ttft(address: str, samples: int) -> list[float]:
    """Sequential one-token Generate calls straight to the upstream: seconds to the first message."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pbg.DecodeNodeStub(channel)
        out = []
        for i in range(samples + 20):
            req = pb.GenerateRequest(request_id=f"direct-{i}", prompt_token_ids=list(range(1, 20)),
                                     params=pb.SamplingParams(max_tokens=1), return_text=True)
            t0 = time.perf_counter()
            call = stub.Generate(req)
            await call.read()
            dt = time.perf_counter() - t0
            while await call.read() is not grpc.aio.EOF:
                pass
            if i >= 20:
                out.append(dt)
        return out


async def load(target: HttpTarget, concurrency: int, duration_s: float, max_tokens: int, stream: bool
               ) -> LoadResult:
    """`concurrency` workers send requests back to back for `duration_s`."""
    body = target.body(max_tokens, stream)
    done, events, errors = 0, 0, 0
    cpu0 = target.cpu_s()
    start = time.perf_counter()
    stop_at = start + duration_s

    async def worker() -> None:
        nonlocal done, events, errors
        conn = HttpConnection(target.host, target.port)
        try:
            while time.perf_counter() < stop_at:
                res = await conn.request("/v1/chat/completions", body, target.auth)
                if res.status == 200:
                    done += 1
                    events += max(0, res.events - 1) if stream else 0  # [DONE] is not a chunk
                else:
                    errors += 1
        finally:
            conn.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return LoadResult(done / elapsed, events / elapsed, errors, (target.cpu_s() - cpu0) / elapsed)


async def measure(target: HttpTarget, cfg: BenchConfig, direct_ttft: Callable[[], Awaitable[list[float]]],
                  ) -> tuple[Result, Result]:
    """The proxy's figures and its directly reached upstream's (TTFT only for the latter)."""
    res, base = Result(target.name), Result(f"{target.name}: upstream direct")
    ttft = await http_ttft(target, cfg.ttfb_samples)
    direct = await direct_ttft()
    base.ttft_ms_p50, base.ttft_ms_p99 = pct(direct, 0.5) * 1e3, pct(direct, 0.99) * 1e3
    res.ttft_ms_p50, res.ttft_ms_p99 = pct(ttft, 0.5) * 1e3, pct(ttft, 0.99) * 1e3
    streamed = await load(target, cfg.concurrency, cfg.duration_s, cfg.stream_tokens, stream=True)
    short = await load(target, cfg.concurrency, cfg.duration_s, cfg.short_tokens, stream=False)
    res.chunks_per_s, res.requests_per_s = streamed.chunks_per_s, short.requests_per_s
    if target.pid is not None:
        res.stream_cpu, res.short_cpu = streamed.cpu_fraction, short.cpu_fraction
    res.errors = streamed.errors + short.errors
    return res, base


_FIGURES = ("ttft_ms_p50", "chunks_per_s", "requests_per_s")


async def console_overhead(cfg: BenchConfig, on: HttpTarget, off: HttpTarget, first_on: tuple[Result, Result],
                           direct_ttft: Callable[[], Awaitable[list[float]]]) -> dict[str, Any]:
    """The frontend with its console (nobody watching) against one without, measured in turns; `first_on` is
    the console-on measurement already taken. Prints and returns each figure's ratio and the noise."""
    runs: dict[str, list[Result]] = {"on": [first_on[0]], "off": []}
    for i in range(cfg.console_reps):
        runs["off"].append((await measure(off, cfg, direct_ttft))[0])
        if i + 1 < cfg.console_reps:
            runs["on"].append((await measure(on, cfg, direct_ttft))[0])
    out: dict[str, Any] = {"reps": cfg.console_reps, "sample_ms": history_sample_ms()}
    print(f"\nconsole on (nobody watching) against --no-console, {cfg.console_reps} runs each, medians:")
    for name in _FIGURES:
        vals = {k: sorted(getattr(r, name) for r in v) for k, v in runs.items()}
        med = {k: statistics.median(v) for k, v in vals.items()}
        noise = max((max(v) - min(v)) / max(min(v), 1e-9) for v in vals.values())
        ratio = med["on"] / max(med["off"], 1e-9)
        out[name] = {"on": med["on"], "off": med["off"], "ratio": ratio, "noise": noise,
                     "runs_on": [getattr(r, name) for r in runs["on"]], "runs_off": [getattr(r, name) for r in runs["off"]]}
        print(f"  {name:16} on {med['on']:10.2f}  off {med['off']:10.2f}  on/off {ratio:5.3f}  "
              f"(spread between runs of one configuration: {noise * 100:.1f}%; runs in order: on "
              f"{' '.join(f'{v:.4g}' for v in out[name]['runs_on'])}, off "
              f"{' '.join(f'{v:.4g}' for v in out[name]['runs_off'])})")
    interval = 2.0
    print(f"  the history's sampler alone: {out['sample_ms']:.3f} ms per sample, one every {interval:g} s "
          f"({out['sample_ms'] / (interval * 1e3) * 100:.3f}% of one core)")
    return out


def history_sample_ms(samples: int = 200) -> float:
    """Milliseconds one `ConsoleHistory.sample` takes in a frontend whose metrics hold a busy process's
    series (every endpoint, status and finish label; 20 tenants), measured in this process."""
    from pdserve.frontend.config import FrontendConfig, ModelSpec
    from pdserve.frontend.console import ConsoleHistory
    from pdserve.frontend.pipeline import Frontend

    fe = Frontend(FrontendConfig(etcd_endpoints=("127.0.0.1:1",), models=(ModelSpec(MODEL, str(default_model_dir("llama"))),),
                                 request_log=None, prepare_workers=1))
    try:
        m = fe.metrics
        lbl = m.labels(fe.catalog.all_versions[0])
        for i in range(2000):
            m.ttft.labels(*lbl).observe(0.001 * (i % 300))
            m.tpot.labels(*lbl).observe(0.0005 * (i % 100))
            m.tokens.labels(*lbl, f"tenant-{i % 20}", "completion").inc(10)
            m.requests.labels(*lbl, ("chat.completions", "completions")[i % 2], ("200", "429", "503")[i % 3],
                              ("stop", "length")[i % 2]).inc()
            m.observe_slo(fe.catalog.all_versions[0], "both", i % 4 != 0)
        history = ConsoleHistory(fe)
        t0 = time.perf_counter()
        for i in range(samples):
            history.sample(now=1000.0 + 2 * i)
        return (time.perf_counter() - t0) / samples * 1e3
    finally:
        fe.workers.close()


# --- processes -----------------------------------------------------------------------------------


def start_litellm(binary: str, workdir: Path, upstream_http: int) -> tuple[Proc, int]:
    port = free_port()
    config = workdir / "litellm.yaml"
    config.write_text(json.dumps({
        "model_list": [{"model_name": MODEL, "litellm_params": {
            "model": f"openai/{MODEL}", "api_base": f"http://127.0.0.1:{upstream_http}/v1", "api_key": "sk-none"}}],
        "litellm_settings": {"telemetry": False, "drop_params": True},
    }))
    env = {"LITELLM_MASTER_KEY": API_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
    proc = spawn("litellm", [binary, "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
                             "--num_workers", "1"], workdir, env=env)
    wait_for_http(proc, f"http://127.0.0.1:{port}/health/liveliness", timeout=180)
    return proc, port


def report(rows: list[tuple[Result, Result]]) -> dict[str, Any]:
    print(f"\n{'':34} {'TTFT p50':>9} {'p99':>8} {'added p50':>10} {'added p99':>10} {'chunks/s':>10} "
          f"{'req/s':>8} {'errors':>7} {'chunks/cpu-s':>13} {'req/cpu-s':>10}")
    out: dict[str, Any] = {}
    for res, base in rows:
        added50, added99 = res.ttft_ms_p50 - base.ttft_ms_p50, res.ttft_ms_p99 - base.ttft_ms_p99
        per_cpu_chunks = res.chunks_per_s / res.stream_cpu if res.stream_cpu else 0.0
        per_cpu_reqs = res.requests_per_s / res.short_cpu if res.short_cpu else 0.0
        print(f"{res.name:34} {res.ttft_ms_p50:8.2f}ms {res.ttft_ms_p99:6.2f}ms {added50:8.2f}ms {added99:8.2f}ms "
              f"{res.chunks_per_s:10.0f} {res.requests_per_s:8.0f} {res.errors:7d} {per_cpu_chunks:13.0f} "
              f"{per_cpu_reqs:10.0f}")
        print(f"{base.name:34} {base.ttft_ms_p50:8.2f}ms {base.ttft_ms_p99:6.2f}ms")
        out[res.name] = {**asdict(res), "added_ttft_ms_p50": added50, "added_ttft_ms_p99": added99,
                         "chunks_per_cpu_s": per_cpu_chunks, "requests_per_cpu_s": per_cpu_reqs,
                         "upstream_ttft_ms_p50": base.ttft_ms_p50, "upstream_ttft_ms_p99": base.ttft_ms_p99}
    return out


async def run_all(cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    isa = isa_summary()
    print(f"CPU ISA {isa}; {os.cpu_count()} CPUs", flush=True)
    model_dir = default_model_dir("llama")
    procs: list[Proc] = []
    with EtcdServer(workdir / "etcd") as etcd:
        try:
            http_port = free_port()
            node = start_scripted_node("scripted-node", workdir, etcd.endpoints, "--model", MODEL, "--tokenizer",
                                       str(model_dir), "--reply-tokens", "100000000", "--http-port", str(http_port),
                                       "--prefill-ids", "scripted-prefill")
            procs.append(node)
            grpc_address = next(line.split()[-1] for line in node.log_text().splitlines()
                                if line.startswith("scripted decode node"))
            tenants = workdir / "tenants.yaml"
            tenants.write_bytes(orjson.dumps({"tenants": [{"name": "bench", "keys_sha256": [hash_key(API_KEY)],
                                                           "requests_per_minute": 10_000_000,
                                                           "input_tokens_per_minute": 1_000_000_000}]}))
            fe = start_frontend("frontend", workdir, etcd.endpoints, free_port(), "--model", f"{MODEL}={model_dir}",
                                "--tenants", str(tenants), "--request-log", str(workdir / "requests.jsonl"),
                                "--log-level", "warning")
            procs.append(fe.proc)
            auth = b"authorization: Bearer " + API_KEY.encode() + b"\r\n"
            rows = []
            frontend = HttpTarget("pdserve frontend", fe.host, fe.port, auth, fe.proc.popen.pid)
            rows.append(await measure(frontend, cfg, lambda: grpc_ttft(grpc_address, cfg.ttfb_samples)))
            direct_http = HttpTarget("scripted upstream (HTTP)", "127.0.0.1", http_port, b"")

            async def direct_http_ttft() -> list[float]:
                return await http_ttft(direct_http, cfg.ttfb_samples)

            if cfg.litellm:
                litellm_proc, litellm_port = start_litellm(cfg.litellm, workdir, http_port)
                procs.append(litellm_proc)
                litellm_target = HttpTarget("litellm proxy (1 worker)", "127.0.0.1", litellm_port, auth,
                                            litellm_proc.popen.pid)
                lite_cfg = BenchConfig(**{**asdict(cfg), "stream_tokens": min(cfg.stream_tokens, 200)})
                rows.append(await measure(litellm_target, lite_cfg, direct_http_ttft))
            results = report(rows)
            fe_off = start_frontend("frontend-no-console", workdir, etcd.endpoints, free_port(), "--model",
                                    f"{MODEL}={model_dir}", "--tenants", str(tenants), "--request-log",
                                    str(workdir / "requests-off.jsonl"), "--log-level", "warning", "--no-console")
            procs.append(fe_off.proc)
            off = HttpTarget("pdserve frontend --no-console", fe_off.host, fe_off.port, auth, fe_off.proc.popen.pid)
            results["console"] = await console_overhead(cfg, frontend, off, rows[0],
                                                        lambda: grpc_ttft(grpc_address, cfg.ttfb_samples))
            fe_res = rows[0][0]
            targets = {
                "added_ttft_ms_p50 <= 2": fe_res.ttft_ms_p50 - rows[0][1].ttft_ms_p50 <= 2.0,
                "chunks_per_s >= 20000": fe_res.chunks_per_s >= 20_000,
                "requests_per_s >= 300": fe_res.requests_per_s >= 300,
            }
            print("\nfrontend targets: " + ", ".join(f"{k}: {'met' if ok else 'MISSED'}" for k, ok in targets.items()))
            if cfg.litellm:
                lite = rows[1][0]
                print(f"frontend / litellm: chunks/s x{fe_res.chunks_per_s / max(lite.chunks_per_s, 1e-9):.1f}, "
                      f"req/s x{fe_res.requests_per_s / max(lite.requests_per_s, 1e-9):.1f}")
            results["targets"] = targets
            results["cpus"] = os.cpu_count()
            results["isa"] = isa
            return results
        finally:
            for proc in reversed(procs):
                proc.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=5.0, help="seconds per throughput phase")
    p.add_argument("--ttfb-samples", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--stream-tokens", type=int, default=1000, help="tokens per streamed request")
    p.add_argument("--short-tokens", type=int, default=8, help="tokens per non-streamed request")
    p.add_argument("--litellm", default=shutil.which("litellm"), help="litellm executable")
    p.add_argument("--no-litellm", action="store_true")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--console-reps", type=int, default=2,
                   help="runs each of the frontend with and without its console, in turns")
    p.add_argument("--quick", action="store_true",
                   help="smoke run of a few seconds (short phases, few samples, no litellm): checks that it runs")
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.ttfb_samples, args.stream_tokens, args.no_litellm = 0.5, 20, 100, True
        args.console_reps = 1
    litellm = None if args.no_litellm else args.litellm
    if litellm is None and not args.no_litellm:
        print("litellm not found (give --litellm PATH or --no-litellm); measuring the frontend alone", file=sys.stderr)
    cfg = BenchConfig(args.duration, args.ttfb_samples, args.concurrency, args.stream_tokens, args.short_tokens,
                      litellm, args.json, max(1, args.console_reps))
    with tempfile.TemporaryDirectory(prefix="frontend-bench-") as tmp:
        runner: Any
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:
            runner = asyncio.run
        try:
            results = runner(run_all(cfg, Path(tmp)))
        except Exception:
            for log in sorted(Path(tmp).glob("*.log")):
                print(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]),
                      file=sys.stderr)
            raise
    if cfg.json_out:
        Path(cfg.json_out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
