"""The HTTP side of `/v1/files` and `/v1/batches` (the service and its runner: `frontend.batches`).

Uploads are parsed as they arrive by Starlette's streaming multipart parser, which spools the file part
to a temporary file (in memory up to 1 MiB, then on disk); the body stream it reads is cut off with a
413 as soon as it passes `--max-file-bytes` plus the form's overhead (a declared Content-Length over it
is refused before anything is read), so an oversized upload is never read whole, nor held in memory.
A chunk that does not arrive within `--body-timeout` is a 408. Every error has the OpenAI shape.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from pdserve.frontend.batches import BatchService, too_large
from pdserve.frontend.errors import SERVER, APIError, missing_parameter
from pdserve.frontend.tenants import Tenant

if TYPE_CHECKING:
    from pdserve.frontend.pipeline import Frontend

log = logging.getLogger(__name__)

FORM_OVERHEAD = 64 * 1024  # multipart boundaries, part headers and the purpose field beside the file


async def _limited(request: Request, limit: int, idle_timeout_s: float) -> AsyncIterator[bytes]:
    """The request's body stream, cut off with a 413 past `limit` bytes and a 408 when no chunk arrives
    within `idle_timeout_s` (a large upload may take longer than that in total)."""
    total = 0
    chunks = request.stream().__aiter__()
    while True:
        try:
            async with asyncio.timeout(idle_timeout_s):
                chunk = await anext(chunks)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise APIError(408, f"No part of the upload arrived within {idle_timeout_s:g} s.",
                           code="body_timeout") from None
        total += len(chunk)
        if total > limit:
            raise too_large(limit - FORM_OVERHEAD)
        yield chunk


async def upload(service: BatchService, tenant: Tenant, request: Request) -> dict[str, Any]:
    config = service.fe.config
    limit = config.max_file_bytes
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise APIError(400, "An upload is a multipart/form-data request with the fields 'file' and 'purpose'.",
                       param="file", code="invalid_request")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + FORM_OVERHEAD:
        raise too_large(limit)
    parser = MultiPartParser(request.headers, _limited(request, limit + FORM_OVERHEAD, config.body_timeout_s),
                             max_files=1, max_fields=8)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise APIError(400, f"The multipart body cannot be read: {exc.message}", code="invalid_request") from None
    try:
        file = form.get("file")
        if file is None or isinstance(file, str):
            raise missing_parameter("file")
        expires = {k: form[f"expires_after[{k}]"] for k in ("anchor", "seconds") if f"expires_after[{k}]" in form}
        return await service.upload(tenant, form.get("purpose"), file.filename, file.file, file.size or 0,
                                    expires or None)
    finally:
        await form.close()


def _disposition(filename: str) -> str:
    return f"attachment; filename*=UTF-8''{urllib.parse.quote(filename, safe='')}"


def add_batch_routes(app: FastAPI, frontend: Frontend) -> None:
    """/v1/files and /v1/batches; the batch runner starts with the app, after the frontend."""
    from pdserve.frontend.app import error_response, json_response, read_body

    service: BatchService = frontend.batches
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with inner(a) as state:
            service.start()
            yield state

    app.router.lifespan_context = lifespan

    async def answer(request: Request, action: Callable[[Tenant], Awaitable[Any]]) -> Response:
        try:
            result = await action(frontend.authenticate(request.headers.get("authorization")))
        except APIError as err:
            return error_response(err)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception:
            log.exception("%s %s failed", request.method, request.url.path)
            return error_response(APIError(500, "The server had an error while processing your request.", type=SERVER))
        return result if isinstance(result, Response) else json_response(result)

    @app.post("/v1/files")
    async def upload_file(request: Request) -> Response:
        return await answer(request, lambda t: upload(service, t, request))

    @app.get("/v1/files")
    async def list_files(request: Request) -> Response:
        return await answer(request, lambda t: service.list_files(t, request.query_params))

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str, request: Request) -> Response:
        async def get(t: Tenant) -> dict[str, Any]:
            return (await service.get_file(t, file_id)).object()
        return await answer(request, get)

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request) -> Response:
        return await answer(request, lambda t: service.delete_file(t, file_id))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, request: Request) -> Response:
        async def content(t: Tenant) -> Response:
            rec, chunks = await service.content(t, file_id)
            return StreamingResponse(chunks, media_type="application/octet-stream",
                                     headers={"content-length": str(rec.bytes),
                                              "content-disposition": _disposition(rec.filename)})
        return await answer(request, content)

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> Response:
        async def create(t: Tenant) -> dict[str, Any]:
            body = await read_body(request, frontend.config.max_body_bytes, frontend.config.body_timeout_s)
            return await service.create(t, body)
        return await answer(request, create)

    @app.get("/v1/batches")
    async def list_batches(request: Request) -> Response:
        return await answer(request, lambda t: service.list(t, request.query_params))

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str, request: Request) -> Response:
        return await answer(request, lambda t: service.get(t, batch_id))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request) -> Response:
        return await answer(request, lambda t: service.cancel(t, batch_id))
