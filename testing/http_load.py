"""Client-side measurement of an OpenAI-compatible endpoint for tests and benchmarks: one request's
status, time to its answer (the response head) and first token, and the gaps between streamed chunks.
Raw httpx, not the openai SDK: under load the client must cost as little as possible, and the status,
headers and timings of refusals matter as much as the answers."""

from __future__ import annotations

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
