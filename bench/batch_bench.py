"""Batches on spare capacity: does a big batch (`/v1/batches`) leave a steady interactive load alone, and
how fast does a batch run on an idle cluster against the same requests sent through the chat API?

One real local cluster (etcd, 1 prefill + 1 decode node, the frontend with `--batch-max-inflight` B), one
run, three measurements; every ratio is against a baseline measured in the same run:

1. interactive alone: a closed loop of `--clients` (default 2) streaming chat clients (temperature 0,
   `--max-tokens` 32, ignore_eos), steady for 5 s (D/3 if less), then measured for `--duration` D seconds (the
   requests started in the window). TTFT p90 and TPOT p99 from the streamed
   chunks' arrival times (TPOT: per request, (last chunk - first chunk) / (chunks - 1)).
2. interactive with a batch: the same load (the same prompts in the same order), steady for 5 s; then a
   batch of `--batch-lines` N chat requests (default 2000, max_tokens 16) is created into it and runs at
   `batch` priority on the frontend's spare capacity (frontend.spare_capacity: a cap learned from the
   interactive requests' latencies); the window starts when the batch is `in_progress`, and the batch is
   cancelled at its end. The same figures and
   their ratio to (1) (the target: within 10%, i.e. <= 1.10), the batch lines finished in the window, and
   the rule's gauges sampled every 0.25 s (mean lines in flight and slots, its last ratio).
3. batch throughput on the idle cluster (after 2.5 s without interactive requests, the spare-capacity
   rule's idle time): a batch of `--throughput-lines` M (default 128) lines, timed from
   `batches.create` to `completed` (validation and finalizing included), against the same M requests sent
   by a closed-loop client at concurrency B through `/v1/chat/completions` (non-streamed, as batch lines
   are): lines/s and output tokens/s (usage.completion_tokens) and their ratio.

Prints the CPU ISA, a plain-text table and, last, one JSON line with every figure.

    .venv/bin/python bench/batch_bench.py [--duration 30] [--batch-lines 2000] [--throughput-lines 64]
        [--batch-max-inflight 8] [--clients 2] [--model DIR|tiny] [--threads 1] [--dtype auto] [--smoke]

The default model is the one `pdserve up` serves (SmolLM2-135M-Instruct, fetched on first use); --smoke
runs in seconds on the tiny model (D = 3 s, 40 batch lines, 16 throughput lines) and only checks that
every figure is there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.cpu_isa import isa_summary  # noqa: E402
from pdserve.engine.default_model import resolve_model  # noqa: E402
from pdserve.engine.gguf_import import StderrProgress  # noqa: E402
from pdserve.registry.etcd_server import free_port  # noqa: E402
from testing.cluster import LocalCluster  # noqa: E402
from testing.http_load import CallResult, percentile, stream_chat  # noqa: E402
from testing.procs import start_frontend  # noqa: E402

NAME = "bench-model"
SETTLE_S = 5.0  # a steady load before each interactive window
IDLE_S = 2.5  # over frontend.spare_capacity's idle time (2 s): the idle phase starts with every slot
CHAT = "/v1/chat/completions"
WORDS = ("river stone lantern copper meadow quiet harbor velvet signal orchard ember falcon granite willow "
         "thunder saffron glacier compass").split()


# --------------------------------------------------------------------------------------------- requests


def interactive_body(rng: random.Random, max_tokens: int) -> dict[str, Any]:
    return {"model": NAME, "messages": [{"role": "user", "content": f"Tell me about a {rng.choice(WORDS)} "
                                         f"and a {rng.choice(WORDS)}."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def batch_body(i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": NAME, "messages": [{"role": "user", "content": f"Write one line about {WORDS[i % len(WORDS)]} "
                                         f"number {i}."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def batch_file(n: int, max_tokens: int) -> bytes:
    return b"".join(orjson.dumps({"custom_id": f"line-{i}", "method": "POST", "url": CHAT,
                                  "body": batch_body(i, max_tokens)}) + b"\n" for i in range(n))


# ------------------------------------------------------------------------------------------- measuring


def settle_s(args: argparse.Namespace) -> float:
    """Seconds of steady load before a window is measured (the spare-capacity rule's baseline forms)."""
    return min(SETTLE_S, args.duration / 3)


def tpot(r: CallResult) -> float | None:
    """Seconds per output chunk after the first (the mean of the inter-chunk gaps), None under 2 chunks."""
    return sum(r.itls) / len(r.itls) if r.itls else None


def load_figures(results: list[CallResult], seconds: float) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200 and r.error is None and r.transport_error is None
          and r.ttft_s is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [t for r in ok if (t := tpot(r)) is not None]
    return {"requests": len(ok), "errors": len(results) - len(ok), "seconds": seconds,
            "requests_per_s": len(ok) / seconds if seconds else 0.0,
            "ttft_ms_p50": 1000 * percentile(ttfts, 0.5), "ttft_ms_p90": 1000 * percentile(ttfts, 0.9),
            "tpot_ms_p50": 1000 * percentile(tpots, 0.5), "tpot_ms_p99": 1000 * percentile(tpots, 0.99)}


async def interactive_load(url: str, clients: int, seconds: float, max_tokens: int,
                           lead_in: Awaitable[Any] | None = None) -> dict[str, Any]:
    """`clients` closed-loop streaming chat clients (client i's prompts seeded by i, so every phase sends
    the same sequence). With `lead_in`, the clients run unmeasured until it is done (a steady load before
    the window); then the figures of every request started in the next `seconds`."""
    results: list[tuple[float, CallResult]] = []
    window = [math.inf, math.inf]  # [start, end) of the measured window
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:

        async def one(i: int) -> None:
            rng = random.Random(i)
            while (started := time.perf_counter()) < window[1]:
                results.append((started, await stream_chat(client, url, interactive_body(rng, max_tokens))))

        async def measure() -> None:
            if lead_in is not None:
                await lead_in
            window[0] = time.perf_counter()
            window[1] = window[0] + seconds

        await asyncio.gather(measure(), *(one(i) for i in range(clients)))
        ended = time.perf_counter()
    return load_figures([r for started, r in results if window[0] <= started], ended - window[0])


async def wait_status(client: openai.AsyncOpenAI, batch_id: str, until: tuple[str, ...], timeout: float,
                      poll: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while (b := await client.batches.retrieve(batch_id)).status not in until:
        if b.status in ("failed", "expired") or time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch_id} is {b.status}, waiting for {until}: {b}")
        await asyncio.sleep(poll)
    return b


async def submit(client: openai.AsyncOpenAI, lines: int, max_tokens: int) -> tuple[Any, float]:
    """Uploads a batch of `lines` chat lines and creates it; returns the batch and when it was created."""
    f = await client.files.create(file=("batch.jsonl", batch_file(lines, max_tokens)), purpose="batch")
    t0 = time.perf_counter()
    b = await client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    return b, t0


async def output_tokens(client: openai.AsyncOpenAI, file_id: str | None) -> tuple[int, int]:
    """(ok lines, their completion tokens) of a batch's output file."""
    if file_id is None:
        return 0, 0
    data = await (await client.files.content(file_id)).aread()
    lines = [orjson.loads(x) for x in data.splitlines() if x.strip()]
    return len(lines), sum(int(ln["response"]["body"]["usage"]["completion_tokens"]) for ln in lines)


def gauge(text: str, name: str) -> float:
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{")), 0.0)


async def watch_rule(base_url: str, stop: asyncio.Event) -> dict[str, Any]:
    """Samples the frontend's spare-capacity gauges every 0.25 s until `stop`: the mean batch lines in
    flight and slots, and the rule's last interference ratio."""
    lines, slots, ratio_now = [], [], 0.0
    async with httpx.AsyncClient(timeout=30) as http:
        while not stop.is_set():
            text = (await http.get(f"{base_url}/metrics")).text
            lines.append(gauge(text, "pdserve_frontend_batch_lines_in_flight"))
            slots.append(gauge(text, "pdserve_frontend_batch_slots"))
            ratio_now = gauge(text, "pdserve_frontend_batch_interference_ratio")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)
    return {"batch_lines_in_flight_mean": sum(lines) / max(1, len(lines)),
            "batch_slots_mean": sum(slots) / max(1, len(slots)),
            "interference_ratio_last": ratio_now}


async def with_batch(client: openai.AsyncOpenAI, base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Phase 2: the steady interactive load, a batch of --batch-lines created into it, and the window from
    the batch's `in_progress`; the batch is cancelled after."""
    url = f"{base_url}{CHAT}"
    stop = asyncio.Event()
    started: dict[str, Any] = {}

    async def start_batch() -> None:
        await asyncio.sleep(settle_s(args))
        b, _ = await submit(client, args.batch_lines, args.batch_max_tokens)
        await wait_status(client, b.id, ("in_progress", "completed"), timeout=120, poll=0.02)
        started["batch"], started["watcher"] = b, asyncio.create_task(watch_rule(base_url, stop))

    figures = await interactive_load(url, args.clients, args.duration, args.max_tokens, start_batch())
    window = figures["seconds"]
    stop.set()
    figures.update(await started["watcher"])
    b = started["batch"]
    cur = await client.batches.retrieve(b.id)
    still_running = cur.status == "in_progress"
    if still_running:
        await client.batches.cancel(b.id)
    done = await wait_status(client, b.id, ("cancelled", "completed"), timeout=120)
    lines, tokens = await output_tokens(client, done.output_file_id)
    finished_at = None if still_running else float(done.completed_at or 0) - float(done.in_progress_at or 0)
    return {**figures, "batch_status": done.status, "batch_lines_done": lines,
            "batch_ran_whole_window": still_running, "batch_lines_per_s": lines / window,
            "batch_tokens_per_s": tokens / window, "batch_done_after_s": finished_at}


async def batch_throughput(client: openai.AsyncOpenAI, args: argparse.Namespace) -> dict[str, Any]:
    b, t0 = await submit(client, args.throughput_lines, args.batch_max_tokens)
    done = await wait_status(client, b.id, ("completed",), timeout=1800)
    seconds = time.perf_counter() - t0
    lines, tokens = await output_tokens(client, done.output_file_id)
    if lines != args.throughput_lines:
        raise RuntimeError(f"batch {b.id}: {lines} of {args.throughput_lines} lines ok: {done}")
    return {"lines": lines, "tokens": tokens, "seconds": seconds, "lines_per_s": lines / seconds,
            "tokens_per_s": tokens / seconds}


async def direct_throughput(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The throughput batch's requests through the chat API, by a closed loop at --batch-max-inflight."""
    todo = list(range(args.throughput_lines))
    tokens = 0
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=args.batch_max_inflight + 4)) \
            as client:

        async def worker() -> None:
            nonlocal tokens
            while todo:
                i = todo.pop(0)
                resp = await client.post(url, content=orjson.dumps(batch_body(i, args.batch_max_tokens)),
                                         headers={"content-type": "application/json"})
                if resp.status_code != 200:
                    raise RuntimeError(f"chat request {i}: {resp.status_code} {resp.text[:500]}")
                tokens += int(resp.json()["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.batch_max_inflight)))
        seconds = time.perf_counter() - t0
    n = args.throughput_lines
    return {"lines": n, "tokens": tokens, "seconds": seconds, "lines_per_s": n / seconds,
            "tokens_per_s": tokens / seconds}


async def measure(base_url: str, cluster: LocalCluster, args: argparse.Namespace) -> dict[str, Any]:
    url = f"{base_url}{CHAT}"
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0,
                                http_client=httpx.AsyncClient(timeout=120))
    try:
        # Warm-up: channels, allocator, first batches, and the batch store's first file.
        await interactive_load(url, args.clients, min(2.0, args.duration), args.max_tokens)
        warm, _ = await submit(client, 4, args.batch_max_tokens)
        await wait_status(client, warm.id, ("completed",), timeout=300)
        cluster.wait_clean(timeout_s=60)
        print(f"[1/3] interactive alone, {args.duration:g} s", file=sys.stderr, flush=True)
        alone = await interactive_load(url, args.clients, args.duration, args.max_tokens,
                                       asyncio.sleep(settle_s(args)))
        cluster.wait_clean(timeout_s=60)
        print(f"[2/3] interactive with a {args.batch_lines}-line batch, {args.duration:g} s", file=sys.stderr,
              flush=True)
        loaded = await with_batch(client, base_url, args)
        cluster.wait_clean(timeout_s=120)
        await asyncio.sleep(IDLE_S)  # otherwise idle: no interactive request for the rule's idle time
        print(f"[3/3] a {args.throughput_lines}-line batch on the idle cluster, then the same requests at "
              f"concurrency {args.batch_max_inflight}", file=sys.stderr, flush=True)
        batch = await batch_throughput(client, args)
        cluster.wait_clean(timeout_s=60)
        direct = await direct_throughput(url, args)
        cluster.wait_clean(timeout_s=60)
    finally:
        await client.close()
    return {"alone": alone, "with_batch": loaded, "batch": batch, "direct": direct}


# ------------------------------------------------------------------------------------------- reporting


def ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else float("nan")


def report(r: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    alone, loaded, batch, direct = r["alone"], r["with_batch"], r["batch"], r["direct"]
    ratios = {"ttft_p90": ratio(loaded["ttft_ms_p90"], alone["ttft_ms_p90"]),
              "tpot_p99": ratio(loaded["tpot_ms_p99"], alone["tpot_ms_p99"]),
              "batch_lines_per_s": ratio(batch["lines_per_s"], direct["lines_per_s"]),
              "batch_tokens_per_s": ratio(batch["tokens_per_s"], direct["tokens_per_s"])}
    print(f"\ninteractive load: {args.clients} closed-loop streaming clients, max_tokens {args.max_tokens}, "
          f"{args.duration:g} s per phase; batch lines max_tokens {args.batch_max_tokens}, "
          f"--batch-max-inflight {args.batch_max_inflight}")
    print(f"{'phase':<26} {'req':>5} {'err':>4} {'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p50':>9} {'TPOT p99':>9}")
    for label, f in (("interactive alone", alone), (f"with {args.batch_lines}-line batch", loaded)):
        print(f"{label:<26} {f['requests']:5d} {f['errors']:4d} {f['ttft_ms_p50']:7.1f}ms {f['ttft_ms_p90']:7.1f}ms "
              f"{f['tpot_ms_p50']:7.1f}ms {f['tpot_ms_p99']:7.1f}ms")
    print(f"{'with batch / alone':<26} {'':5} {'':4} {'':9} {ratios['ttft_p90']:8.2f}x {'':9} "
          f"{ratios['tpot_p99']:8.2f}x   (target <= 1.10x)")
    whole = "for the whole window, then cancelled" if loaded["batch_ran_whole_window"] else \
        f"but it completed {loaded['batch_done_after_s']} s after starting, before the window ended"
    print(f"the batch ran {whole}: {loaded['batch_lines_done']} lines done, {loaded['batch_lines_per_s']:.1f} "
          f"lines/s, {loaded['batch_tokens_per_s']:.1f} output tok/s beside the interactive load; "
          f"{loaded['batch_lines_in_flight_mean']:.2f} lines in flight on average (slots "
          f"{loaded['batch_slots_mean']:.2f}), the rule's last interference ratio "
          f"{loaded['interference_ratio_last']:.3f}")
    print(f"\nidle cluster, {batch['lines']} lines x {args.batch_max_tokens} tokens")
    print(f"{'':34} {'seconds':>8} {'lines/s':>8} {'tok/s':>8}")
    for label, f in (("batch (create -> completed)", batch),
                     (f"chat API, {args.batch_max_inflight} closed-loop clients", direct)):
        print(f"{label:<34} {f['seconds']:8.2f} {f['lines_per_s']:8.2f} {f['tokens_per_s']:8.1f}")
    print(f"{'batch / chat API':<34} {'':8} {ratios['batch_lines_per_s']:7.2f}x {ratios['batch_tokens_per_s']:7.2f}x")
    return ratios


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of each interactive phase")
    p.add_argument("--batch-lines", type=int, default=2000, help="lines of the batch beside the interactive load")
    p.add_argument("--throughput-lines", type=int, default=128, help="lines of the batch on the idle cluster")
    p.add_argument("--batch-max-tokens", type=int, default=16, help="max_tokens of each batch line")
    p.add_argument("--batch-max-inflight", type=int, default=8, help="the frontend's --batch-max-inflight")
    p.add_argument("--clients", type=int, default=2, help="closed-loop interactive clients")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each interactive request")
    p.add_argument("--model", default=None, help="model directory or tiny (default: SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per node")
    p.add_argument("--dtype", default="auto", help="the nodes' --dtype (default auto: what pdserve up serves)")
    p.add_argument("--smoke", action="store_true", help="seconds-long: tiny model, 3 s phases, 40 batch lines")
    args = p.parse_args(argv)
    if args.smoke:
        args.model = args.model or "tiny"
        args.duration, args.batch_lines, args.throughput_lines = 3.0, 40, 16

    isa = isa_summary()
    print(f"CPU ISA {isa}; {os.cpu_count()} CPUs; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
          flush=True)
    resolved = resolve_model(args.model, StderrProgress())
    node_args = ["--num-threads", str(args.threads), "--num-kv-blocks", "1024", "--model-name", NAME,
                 "--dtype", args.dtype]
    with tempfile.TemporaryDirectory(prefix="batch-bench-") as tmp, \
            LocalCluster(Path(tmp), resolved.path, node_args=node_args) as cluster:
        cluster.start(1, 1)
        fe = start_frontend("frontend", Path(tmp), cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                            "--model", f"{NAME}={resolved.path}", "--log-level", "warning", "--request-log", "off",
                            "--batch-max-inflight", str(args.batch_max_inflight))
        try:
            print(f"model {resolved.name}; 1 prefill + 1 decode node, {args.threads} thread(s) each", flush=True)
            results = asyncio.run(measure(fe.base_url, cluster, args))
        finally:
            fe.stop()
    ratios = report(results, args)
    out = {"isa": isa, "cpus": os.cpu_count(), "model": resolved.name, "smoke": args.smoke,
           "duration_s": args.duration, "batch_lines": args.batch_lines, "clients": args.clients,
           "batch_max_inflight": args.batch_max_inflight, **results, "ratios": ratios}
    if args.smoke:  # every figure is there and finite
        for key in ("alone", "with_batch"):
            for fig in ("ttft_ms_p90", "tpot_ms_p99"):
                assert math.isfinite(out[key][fig]) and out[key][fig] > 0, (key, fig, out[key])
            assert out[key]["requests"] > 0 and out[key]["errors"] == 0, out[key]
        assert all(math.isfinite(v) and v > 0 for v in ratios.values()), ratios
    print(json.dumps(out, allow_nan=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
