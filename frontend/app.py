"""The HTTP layer: FastAPI routes over `Frontend`, and the ASGI response that runs a generation.

No `BaseHTTPMiddleware` anywhere: it would hide the client's disconnect from the streaming path. Instead
`GenerationResponse` watches the ASGI `receive` callable itself while it works; an `http.disconnect`
cancels the work at once, which cancels the Generate calls and so aborts the request on both nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.frontend.console_routes import add_console_routes
from pdserve.frontend.degrade import HEADER as DEGRADED_HEADER
from pdserve.frontend.embeddings import add_embedding_routes
from pdserve.frontend.errors import NOT_FOUND, SERVER, APIError
from pdserve.frontend.files import add_batch_routes
from pdserve.frontend.pipeline import CHAT, COMPLETION, RESPONSES, Frontend, Job, client_request_id
from pdserve.frontend.render import DONE, KEEPALIVE, error_event
from pdserve.frontend.responses_api import TERMINAL_EVENTS, ResponseJob, failure_event
from pdserve.frontend.tenants import Tenant
from pdserve.frontend.tracing import TRACE_ID_HEADER, RequestTrace, start_request

log = logging.getLogger(__name__)

T = TypeVar("T")

_OPENAPI_PATH = Path(__file__).with_name("openapi.json")

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies must not buffer the stream
]


def openapi_document() -> dict[str, Any]:
    """The API's OpenAPI document (served at /openapi.json): the routes with the official OpenAI request and
    error schemas, since the routes read raw bodies that FastAPI cannot describe. Generated from the
    vendored spec by scripts/build_frontend_openapi.py."""
    return json.loads(_OPENAPI_PATH.read_bytes())  # stdlib json: the schemas hold integers beyond 64 bits


def json_response(obj: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


def error_response(err: APIError) -> Response:
    headers = err.headers
    if err.status in (408, 413):  # the body was not read to its end: close, or the server drains it all
        headers = {**(headers or {}), "connection": "close"}
    return Response(err.body(), status_code=err.status, media_type="application/json", headers=headers)


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body, refusing more than `limit` bytes (413) without reading past the limit, and a body
    that has not arrived in full within `timeout_s` (408: a client trickling its body holds a connection
    and a buffer for nothing)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError(400, "Invalid Content-Length header.", code="invalid_request")
        if int(declared) > limit:
            raise APIError(413, f"The request body is {declared} bytes; the limit is {limit} bytes.",
                           code="request_too_large")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise APIError(413, f"The request body exceeds the limit of {limit} bytes.",
                                   code="request_too_large")
    except TimeoutError:
        raise APIError(408, f"The request body was not received within {timeout_s:g} s.",
                       code="body_timeout") from None
    return bytes(body)


class HeaderLimit:
    """ASGI middleware: a request whose headers exceed `limit` bytes is answered 431 in the OpenAI error
    shape before any route sees it. Pure ASGI (no BaseHTTPMiddleware), so disconnects still reach the
    routes."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(k) + len(v) for k, v in scope["headers"])
            if size > self.limit:
                err = APIError(431, f"The request headers are {size} bytes; the limit is {self.limit} bytes.",
                               code="headers_too_large")
                await _send_error(send, err, [(b"connection", b"close")])
                return
        await self.app(scope, receive, send)


@dataclass(eq=False)
class _ResponseState:
    """How far a generation's response got, shared with the disconnect watcher."""

    task: asyncio.Task[object] | None  # the task writing the response (a disconnect cancels it)
    started: bool = False  # a 200 stream has started: an error can only be its last event now
    done: bool = False  # the response is complete: a disconnect now is the normal end
    disconnected: bool = False


async def _watch_disconnect(receive: Receive, state: _ResponseState) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not state.done and state.task is not None:
                state.disconnected = True
                state.task.cancel()
            return


class GenerationResponse(Response):
    """Runs an admitted job and writes its response (SSE or JSON); always ends the job."""

    def __init__(self, frontend: Frontend, job: Job) -> None:
        self.frontend = frontend
        self.job = job
        self.background = None
        self.status_code = 200

    def _headers(self, extra: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        job = self.job
        headers = [*extra, (b"x-request-id", job.id.encode()), (b"x-pdserve-model", job.model.name.encode())]
        if job.trace is not None:
            headers.append((TRACE_ID_HEADER.encode(), job.trace.trace_id.encode()))
        if job.degraded:
            headers.append((DEGRADED_HEADER.encode(), ",".join(job.degraded).encode()))
        return headers

    async def _events(self) -> AsyncIterator[bytes]:
        """The SSE events of a streamed job, from the start of its Generate calls."""
        firsts = await self.frontend.open(self.job)
        async with aclosing(self.frontend.stream(self.job, firsts)) as events:
            async for chunk in events:
                yield chunk

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        job = self.job
        state = _ResponseState(asyncio.current_task())
        watcher = asyncio.ensure_future(_watch_disconnect(receive, state))
        try:
            if job.req.stream:
                await self._send_stream(send, state)
            else:
                await self._send_whole(send, state)
        except APIError as err:  # raised before the first token
            await self._send_failure(send, state, job.traced(err))
        except asyncio.CancelledError:
            if not state.disconnected:
                raise
            job.disconnected = True
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        except Exception:
            log.exception("request %s failed", job.id)
            err = APIError(500, "The server had an error while processing your request.", type=SERVER)
            await self._send_failure(send, state, job.traced(err))
        finally:
            watcher.cancel()
            self.frontend.end(job)

    async def _send_stream(self, send: Send, state: _ResponseState) -> None:
        fe = self.frontend
        keepalive = fe.config.sse_keepalive_s or None
        async with aclosing(with_keepalive(self._events(), keepalive)) as events:
            async for chunk in events:
                if not state.started:
                    state.started = True
                    await send({"type": "http.response.start", "status": 200, "headers": self._headers(_SSE_HEADERS)})
                if chunk is None:
                    fe.metrics.sse_keepalives.inc()
                elif self._last(chunk):
                    # The client has the whole response once this is sent and may hang up at once, while
                    # the stream is still being closed here: that is the normal end, not a 499.
                    state.done = True
                await send({"type": "http.response.body", "body": chunk or KEEPALIVE, "more_body": True})
        state.done = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _last(self, chunk: bytes) -> bool:
        """Whether `chunk` ends the stream's content (what follows only closes it)."""
        return chunk.endswith(DONE)

    async def _body(self) -> bytes:
        """The JSON body of a whole response."""
        firsts = await self.frontend.open(self.job)
        return await self.frontend.collect(self.job, firsts)

    def _failure_event(self, err: APIError) -> bytes:
        """The last event of a stream that keep-alive comments started, when the job failed before its
        first token."""
        return error_event(err.to_dict()) + DONE

    async def _send_whole(self, send: Send, state: _ResponseState) -> None:
        body = await self._body()
        state.done = True
        headers = self._headers([(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())])
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _send_failure(self, send: Send, state: _ResponseState, err: APIError) -> None:
        """Ends the response with the job's error: an error response, or the last event of a stream that
        keep-alive comments have started."""
        self.job.error = err
        state.done = True
        if state.started:
            await send({"type": "http.response.body", "body": self._failure_event(err), "more_body": False})
        else:
            await _send_error(send, err, self._headers([]))


class ResponsesGeneration(GenerationResponse):
    """A /v1/responses job's response: the Response object, or its events."""

    def __init__(self, frontend: Frontend, rjob: ResponseJob) -> None:
        super().__init__(frontend, rjob.job)
        self.rjob = rjob

    async def _events(self) -> AsyncIterator[bytes]:
        async with aclosing(self.frontend.responses.events(self.rjob)) as events:
            async for chunk in events:
                yield chunk

    def _last(self, chunk: bytes) -> bool:
        return any(marker in chunk for marker in TERMINAL_EVENTS)

    async def _body(self) -> bytes:
        return await self.frontend.responses.collect(self.rjob)

    def _failure_event(self, err: APIError) -> bytes:
        return failure_event(err)


async def with_keepalive(source: AsyncIterator[bytes], interval_s: float | None) -> AsyncIterator[bytes | None]:
    """The items of `source`, and None each time `interval_s` seconds pass without one (None: never).

    The next item is awaited in a task of its own that outlives the timeouts, so a timeout never
    interrupts `source`; closing this generator (or cancelling its consumer) cancels that task and closes
    `source`."""
    it = aiter(source)
    pending: asyncio.Future[bytes] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            nxt, pending = pending, None
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await it.aclose()  # type: ignore[attr-defined]


async def _send_error(send: Send, err: APIError, headers: list[tuple[bytes, bytes]]) -> None:
    body = err.body()
    all_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers,
                   *((k.encode(), v.encode()) for k, v in err.headers.items())]
    start: Message = {"type": "http.response.start", "status": err.status, "headers": all_headers}
    await send(start)
    await send({"type": "http.response.body", "body": body, "more_body": False})


def create_app(frontend: Frontend) -> FastAPI:
    """The FastAPI application serving `frontend`; its lifespan starts and closes the frontend."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await frontend.start()
        try:
            yield
        finally:
            await frontend.close()

    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json", lifespan=lifespan)
    document = openapi_document()
    app.openapi = lambda: document  # type: ignore[method-assign]
    _add_generation_routes(app, frontend)
    _add_responses_routes(app, frontend)
    _add_model_routes(app, frontend)
    add_embedding_routes(app, frontend)  # /v1/embeddings (frontend.embeddings)
    add_batch_routes(app, frontend)  # /v1/files, /v1/batches (frontend.files, frontend.batches)
    add_console_routes(app, frontend)  # /, /console and /console/api/* (frontend.console_routes)
    _add_operations_routes(app, frontend)
    app.add_middleware(HeaderLimit, limit=frontend.config.max_header_bytes)
    return app


async def admit_from(frontend: Frontend, kind: str, request: Request,
                     admit: Callable[[Tenant, bytes, RequestTrace | None], Awaitable[T]]) -> T | Response:
    """Authenticates a generation request, reads its body and admits it with `admit`; a refusal is
    accounted (metrics, request log, trace) and returned as its error response (499: the client left)."""
    tenant_name = None
    # Tracing on: the request's trace starts here (a client's traceparent is its parent).
    tracer = frontend.tracer
    trace = start_request(tracer, request.url.path, request.headers, time.monotonic()) if tracer else None
    try:
        tenant = frontend.authenticate(request.headers.get("authorization"))
        tenant_name = tenant.name
        body = await read_body(request, frontend.config.max_body_bytes, frontend.config.body_timeout_s)
        return await admit(tenant, body, trace)
    except APIError as err:
        if trace is not None:
            trace.reject(err.status, trace.tag(err).message)
        frontend.reject(kind, tenant_name, err, client_request_id(request.headers))
        return error_response(err)
    except ClientDisconnect:
        if trace is not None:
            trace.reject(499, "the client went away")
        return Response(status_code=499)


def _add_generation_routes(app: FastAPI, frontend: Frontend) -> None:
    async def generation(kind: str, request: Request) -> Response:
        job = await admit_from(frontend, kind, request,
                               lambda tenant, body, trace: frontend.admit(kind, tenant, body, request.headers, trace))
        return job if isinstance(job, Response) else GenerationResponse(frontend, job)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation(CHAT, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(COMPLETION, request)


def _add_responses_routes(app: FastAPI, frontend: Frontend) -> None:
    service = frontend.responses

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        rjob = await admit_from(frontend, RESPONSES, request,
                                lambda tenant, body, trace: service.admit(tenant, body, request.headers, trace))
        if isinstance(rjob, Response):
            return rjob
        if rjob.rreq.background:
            try:
                return json_response(await service.start_background(rjob))
            except APIError as err:
                rjob.job.error = err
                frontend.end(rjob.job)
                return error_response(err)
        return ResponsesGeneration(frontend, rjob)

    async def stored(request: Request, action: Callable[[Tenant], Awaitable[dict[str, Any]]]) -> Response:
        try:
            return json_response(await action(frontend.authenticate(request.headers.get("authorization"))))
        except APIError as err:
            return error_response(err)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> Response:
        async def get(tenant: Tenant) -> dict[str, Any]:
            if request.query_params.get("stream") in ("true", "1"):
                raise APIError(400, "Streaming a stored response again is not supported by this server; retrieve "
                               "it whole.", param="stream", code="unsupported_parameter")
            return (await service.get(tenant, response_id)).response
        return await stored(request, get)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> Response:
        return await stored(request, lambda tenant: service.delete(tenant, response_id))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, request: Request) -> Response:
        return await stored(request, lambda tenant: service.cancel(tenant, response_id))

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, request: Request) -> Response:
        return await stored(request, lambda tenant: service.input_items(tenant, response_id, request.query_params))


def _add_model_routes(app: FastAPI, frontend: Frontend) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            tenant = frontend.authenticate(request.headers.get("authorization"))
        except APIError as err:
            return error_response(err)
        return json_response({"object": "list", "data": frontend.list_models(tenant)})

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> Response:
        try:
            tenant = frontend.authenticate(request.headers.get("authorization"))
        except APIError as err:
            return error_response(err)
        for item in frontend.list_models(tenant):
            if item["id"] == name:
                return json_response(item)
        return error_response(APIError(404, f"The model `{name}` does not exist or you do not have access to it.",
                                       param="model", code="model_not_found"))


def _add_operations_routes(app: FastAPI, frontend: Frontend) -> None:
    """Health, readiness, metrics, and the OpenAI-shaped errors of everything else."""

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        report = frontend.readiness()
        return json_response(report, status=200 if report["ready"] else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(frontend.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = NOT_FOUND if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(APIError(exc.status_code, message, type=kind, code=None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, "The server had an error while processing your request.", type=SERVER))
