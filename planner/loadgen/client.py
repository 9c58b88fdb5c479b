"""One streamed request against an OpenAI-compatible endpoint, timed at the client.

httpx streaming and a small SSE reader rather than the openai SDK: the SDK parses every chunk into
pydantic models, which costs client CPU that, on a small machine, the server under test would miss."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from pdserve.planner.loadgen.workload import RequestSpec


@dataclass
class Target:
    """Where and how requests go."""

    base_url: str  # ends with /v1
    model: str
    api: str = "chat"  # "chat" | "completions"
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return "/chat/completions" if self.api == "chat" else "/completions"


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are seconds; `start_s` is from the start of the run.
    `output_tokens` is the server's `usage.completion_tokens` when reported, else the content chunks
    counted here (a server may merge tokens into one chunk, e.g. an incomplete UTF-8 character)."""

    index: int
    start_s: float
    max_tokens: int
    group: int | None = None
    ok: bool = False
    error: str | None = None  # kind: http_<status>, an exception class, error_event:<code>, incomplete_stream
    error_detail: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    chunks: int = 0  # chunks carrying content
    output_tokens: int = 0
    usage_prompt_tokens: int | None = None
    usage_output_tokens: int | None = None
    local_prompt_tokens: int | None = None  # by the local tokenizer, when given
    finish_reason: str | None = None

    def fail(self, kind: str, detail: str) -> None:
        """Marks the request failed with an error kind and a short detail."""
        self.ok, self.error, self.error_detail = False, kind, detail[:500]

    def finish(self, e2e_s: float) -> None:
        """Sets the end-to-end time, the output token count and TPOT from what was recorded."""
        self.e2e_s = e2e_s
        self.output_tokens = self.usage_output_tokens if self.usage_output_tokens is not None else self.chunks
        if self.ok and self.ttft_s is not None and self.output_tokens > 1:
            self.tpot_s = (e2e_s - self.ttft_s) / (self.output_tokens - 1)


def api_base(url: str) -> str:
    """The API base for a server URL: `http://h:p` gets `/v1`; a URL with a path is kept as given."""
    url = url.rstrip("/")
    if "://" not in url:  # "host:port" parses as scheme "host"
        url = f"http://{url}"
    return url if urlsplit(url).path else f"{url}/v1"


def headers(target: Target) -> dict[str, str]:
    return {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}


def request_body(target: Target, spec: RequestSpec) -> dict[str, Any]:
    """The JSON body of `spec`: streamed, with usage in the last chunk."""
    body: dict[str, Any] = {"model": target.model, "max_tokens": spec.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if target.api == "chat":
        messages = [{"role": "system", "content": spec.system}] if spec.system is not None else []
        body["messages"] = [*messages, {"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt if spec.system is None else f"{spec.system}\n\n{spec.prompt}"
    if target.ignore_eos:
        body["ignore_eos"] = True  # not OpenAI's: vLLM's (and pdserve's) extra field
    if target.temperature is not None:
        body["temperature"] = target.temperature
    body.update(target.extra_body)
    return body


async def first_model(http: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    """The id of the first model `/v1/models` lists. Raises ValueError when there is none."""
    try:
        resp = await http.get(f"{base_url}/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    except httpx.HTTPError as err:
        raise ValueError(f"GET {base_url}/models: {type(err).__name__}: {err}") from None
    if resp.status_code != 200:
        raise ValueError(f"GET {base_url}/models: HTTP {resp.status_code}: {resp.text[:200]}")
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"GET {base_url}/models lists no model; pass --model")
    return str(data[0]["id"])


def _on_event(rec: RequestRecord, obj: Any, now: float, last: list[float]) -> None:
    """Updates `rec` from one decoded SSE event received at `now` (s since the request was sent);
    `last` holds the time of the previous content chunk."""
    if not isinstance(obj, dict):
        return
    if "error" in obj and "choices" not in obj:
        err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
        rec.fail(f"error_event:{err.get('code') or err.get('type') or 'error'}", str(err.get("message")))
        return
    for choice in obj.get("choices") or ():
        text = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
        if text:
            if rec.ttft_s is None:
                rec.ttft_s = now
            else:
                rec.itl_s.append(now - last[0])
            last[0] = now
            rec.chunks += 1
        if choice.get("finish_reason"):
            rec.finish_reason = choice["finish_reason"]
    usage = obj.get("usage")
    if usage:
        rec.usage_prompt_tokens = usage.get("prompt_tokens")
        rec.usage_output_tokens = usage.get("completion_tokens")


async def _read_stream(resp: httpx.Response, rec: RequestRecord, sent: float) -> bool:
    """Consumes the SSE stream into `rec`; True when it ended with [DONE]."""
    last = [0.0]
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        _on_event(rec, orjson.loads(data), time.perf_counter() - sent, last)
        if rec.error:
            return True
    return False


async def send(http: httpx.AsyncClient, target: Target, spec: RequestSpec, t0: float) -> RequestRecord:
    """Sends `spec` streamed and returns its record; never raises for a failed request (the failure
    is in the record). `t0` is the run's start (perf_counter)."""
    sent = time.perf_counter()
    rec = RequestRecord(spec.index, sent - t0, spec.max_tokens, spec.group, ok=True,
                        local_prompt_tokens=spec.prompt_tokens)
    try:
        async with http.stream("POST", f"{target.base_url}{target.path}", json=request_body(target, spec),
                               headers=headers(target)) as resp:
            if resp.status_code != 200:
                await resp.aread()
                rec.fail(f"http_{resp.status_code}", resp.text)
            elif not await _read_stream(resp, rec, sent):
                rec.fail("incomplete_stream", "the stream ended without [DONE]")
    except orjson.JSONDecodeError as err:
        rec.fail("bad_event", str(err))
    except (httpx.HTTPError, OSError) as err:
        rec.fail(type(err).__name__, str(err) or repr(err))
    if rec.ok and rec.ttft_s is None:
        rec.fail("no_output", "the stream carried no content")
    rec.finish(time.perf_counter() - sent)
    return rec
