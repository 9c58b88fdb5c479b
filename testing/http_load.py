"""Client-side measurement of an OpenAI-compatible endpoint for tests and benchmarks: one request's
status, time to its answer (the response head) and first token, and the gaps between streamed chunks.
Raw httpx, not the openai SDK: under load the client must cost as little as possible, and the status,
headers and timings of refusals matter as much as the answers."""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson


@dataclass(eq=False)
class CallResult:
    """One request as the client saw it (seconds from sending it; None where it did not happen)."""

    status: int = 0
    head_s: float | None = None  # the response head arrived (a refusal's whole answer)
    ttft_s: float | None = None  # the first chunk carrying text
    itls: list[float] = field(default_factory=list)  # gaps between text chunks after the first
    tokens: int = 0  # text chunks received
    error: dict[str, Any] | None = None  # the OpenAI error object of a refusal
    headers: dict[str, str] = field(default_factory=dict)
    transport_error: str | None = None


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                      headers: dict[str, str] | None = None) -> CallResult:
    """Sends a streamed chat request (body gets "stream": true) and measures it chunk by chunk."""
    result = CallResult()
    start = time.perf_counter()
    last: float | None = None
    try:
        async with client.stream("POST", url, content=orjson.dumps({**body, "stream": True}),
                                 headers={"content-type": "application/json", **(headers or {})}) as resp:
            result.status = resp.status_code
            result.head_s = time.perf_counter() - start
            result.headers = dict(resp.headers)
            if resp.status_code != 200:
                result.error = orjson.loads(await resp.aread()).get("error")
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                obj = orjson.loads(line[6:])
                if "error" in obj:
                    result.error = obj["error"]
                    continue
                choices = obj.get("choices") or []
                if not choices or not (choices[0].get("delta") or {}).get("content"):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.itls.append(now - last)
                last = now
                result.tokens += 1
    except httpx.HTTPError as err:
        result.transport_error = f"{type(err).__name__}: {err}"
    return result


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values` by nearest rank; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def long_context_copy(src: Path, dst: Path, max_len: int) -> Path:
    """A copy of model directory `src` at `dst` whose declared context is `max_len` tokens (the weights
    are linked, not copied): for prompts longer than a tiny model's 4k positions."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        target = dst / f.name
        if target.exists():
            continue
        if f.suffix == ".safetensors":
            target.symlink_to(f.resolve())
        elif f.is_file():
            shutil.copyfile(f, target)
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        path = dst / name
        obj = orjson.loads(path.read_bytes())
        obj[key] = max_len
        path.write_bytes(orjson.dumps(obj, option=orjson.OPT_INDENT_2))
    return dst


def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid` (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass(eq=False)
class OverloadRun:
    """An open-loop run: every request's result and the server's RSS samples (bytes)."""

    results: list[CallResult]
    rss: list[int]
    seconds: float

    @property
    def accepted(self) -> list[CallResult]:
        return [r for r in self.results if r.status == 200]

    @property
    def refused(self) -> list[CallResult]:
        return [r for r in self.results if r.status != 200]


async def closed_loop_rate(url: str, bodies: Any, clients: int, seconds: float,
                           headers: dict[str, str] | None = None) -> float:
    """Completed requests per second with `clients` sending back to back for `seconds` (a capacity probe;
    `bodies` is an iterator of request bodies)."""
    done = 0
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=120) as client:

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < deadline:
                r = await stream_chat(client, url, next(bodies), headers)
                if r.status != 200 or r.error or r.transport_error:
                    raise RuntimeError(f"capacity probe failed: {r.status} {r.error} {r.transport_error}")
                done += 1

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return done / (time.monotonic() - start)


async def open_loop(url: str, bodies: Any, rate: float, seconds: float, pid: int,
                    headers: dict[str, str] | None = None) -> OverloadRun:
    """Sends requests at `rate` per second (evenly spaced, not waiting for answers) for `seconds`, while
    sampling the RSS of process `pid` every 100 ms; returns when every request has ended."""
    results: list[CallResult] = []
    rss: list[int] = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one(body: dict[str, Any]) -> None:
            results.append(await stream_chat(client, url, body, headers))

        async def sample() -> None:
            while not stop.is_set():
                rss.append(rss_bytes(pid))
                await asyncio.sleep(0.1)  # the sampling period

        sampler = asyncio.ensure_future(sample())
        start = time.monotonic()
        tasks = []
        i = 0
        while (due := start + i / rate) < start + seconds:
            await asyncio.sleep(max(0.0, due - time.monotonic()))  # the open loop's send schedule
            tasks.append(asyncio.ensure_future(one(next(bodies))))
            i += 1
        await asyncio.gather(*tasks)
        took = time.monotonic() - start
        stop.set()
        await sampler
    return OverloadRun(results, rss, took)
