"""httpx transports that keep a copy of every response body, so tests can check each response and each
stream chunk that the openai SDK received against the OpenAPI spec.

They wrap httpx's own transports and only tee the bytes as the SDK reads them; nothing is altered.
Pass one as `http_client=httpx.Client(transport=RecordingTransport())` (or the async pair).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from testing.openapi import COMPLETION_CHUNK, OpenAPISchemas


@dataclass(eq=False)
class Recorded:
    """One HTTP exchange as the client saw it."""

    method: str
    path: str
    status: int
    content_type: str
    body: bytearray = field(default_factory=bytearray)

    @property
    def is_stream(self) -> bool:
        return self.content_type.startswith("text/event-stream")

    def events(self) -> list[str]:
        """The `data:` payloads of an SSE body, in order ("[DONE]" included)."""
        out = []
        for block in bytes(self.body).decode("utf-8").split("\n\n"):
            for line in block.split("\n"):
                if line.startswith("data: "):
                    out.append(line[6:])
        return out


class _TeeSync(httpx.SyncByteStream):
    def __init__(self, inner: httpx.SyncByteStream, rec: Recorded) -> None:
        self._inner, self._rec = inner, rec

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._rec.body += chunk
            yield chunk

    def close(self) -> None:
        self._inner.close()


class _TeeAsync(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, rec: Recorded) -> None:
        self._inner, self._rec = inner, rec

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            self._rec.body += chunk
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


def _record(request: httpx.Request, response: httpx.Response) -> Recorded:
    return Recorded(request.method, request.url.path, response.status_code, response.headers.get("content-type", ""))


class RecordingTransport(httpx.BaseTransport):
    """httpx.HTTPTransport that records every response (appends to `records`)."""

    def __init__(self, **kwargs: Any) -> None:
        self._inner = httpx.HTTPTransport(**kwargs)
        self.records: list[Recorded] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._inner.handle_request(request)
        rec = _record(request, response)
        self.records.append(rec)
        assert isinstance(response.stream, httpx.SyncByteStream)
        response.stream = _TeeSync(response.stream, rec)
        return response

    def close(self) -> None:
        self._inner.close()


class AsyncRecordingTransport(httpx.AsyncBaseTransport):
    """httpx.AsyncHTTPTransport that records every response (appends to `records`)."""

    def __init__(self, **kwargs: Any) -> None:
        self._inner = httpx.AsyncHTTPTransport(**kwargs)
        self.records: list[Recorded] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        rec = _record(request, response)
        self.records.append(rec)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _TeeAsync(response.stream, rec)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def _responses_schema(rec: Recorded) -> str | None:
    """The schema of a /v1/responses route's body (None: the spec gives the route none, e.g. DELETE)."""
    if rec.method == "DELETE":
        return None
    return "ResponseItemList" if rec.path.endswith("/input_items") else "Response"


def response_event_schema(schemas: OpenAPISchemas, event: dict[str, Any]) -> str:
    """The spec schema of one Responses stream event, by its `type` (ResponseStreamEvent's members)."""
    return schemas.stream_event_schemas().get(event.get("type", ""), "ResponseStreamEvent")


def schema_for(rec: Recorded, chunk: bool) -> str | None:
    """The spec schema a response (or, with chunk=True, one of its stream events) must match."""
    if rec.status >= 400:
        return "ErrorResponse"
    if "/responses" in rec.path:
        return _responses_schema(rec)
    if rec.path.endswith("/embeddings"):
        return "CreateEmbeddingResponse"
    if "/files" in rec.path:
        if rec.path.endswith("/content"):
            return None  # the file's own bytes
        if rec.method == "DELETE":
            return "DeleteFileResponse"
        return "ListFilesResponse" if rec.method == "GET" and rec.path.endswith("/files") else "OpenAIFile"
    if "/batches" in rec.path:
        return "ListBatchesResponse" if rec.method == "GET" and rec.path.endswith("/batches") else "Batch"
    if rec.path.endswith("/chat/completions"):
        return "CreateChatCompletionStreamResponse" if chunk else "CreateChatCompletionResponse"
    if rec.path.endswith("/completions"):
        return COMPLETION_CHUNK if chunk else "CreateCompletionResponse"
    if rec.path.endswith("/models"):
        return "ListModelsResponse"
    if "/models/" in rec.path:
        return "Model"
    raise ValueError(f"no schema known for {rec.method} {rec.path}")


def conformance_problems(schemas: OpenAPISchemas, records: list[Recorded]) -> tuple[int, list[str]]:
    """Checks every recorded body and stream event; returns (documents checked, problems found)."""
    checked, problems = 0, []
    for rec in records:
        where = f"{rec.method} {rec.path} -> {rec.status}"
        if rec.is_stream and rec.path.endswith("/responses"):
            for text in rec.events():  # typed events, no [DONE] (as OpenAI sends them)
                event = orjson.loads(text)
                name = response_event_schema(schemas, event)
                checked += 1
                problems += [f"{where} event {name}: {p}" for p in schemas.errors(name, event)]
        elif rec.is_stream:
            events = rec.events()
            if not events or events[-1] != "[DONE]":
                problems.append(f"{where}: stream does not end with data: [DONE]")
            for text in events:
                if text == "[DONE]":
                    continue
                obj = orjson.loads(text)
                name = "ErrorResponse" if "error" in obj else schema_for(rec, chunk=True)
                checked += 1
                problems += [f"{where} event {name}: {p}" for p in schemas.errors(name, obj)]
        else:
            obj = orjson.loads(bytes(rec.body))
            name = schema_for(rec, chunk=False)
            if name is None:
                continue
            checked += 1
            problems += [f"{where} {name}: {p}" for p in schemas.errors(name, obj)]
    return checked, problems
