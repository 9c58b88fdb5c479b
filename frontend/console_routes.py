"""The web console's routes: its static pages at `/` and `/console`, and the JSON they read.

    GET /, /console                 the page (no data: it asks for a key, then calls the API below)
    GET /console/static/<file>      its scripts, styles and the vendored chart library
    GET /console/api/session        who the key is: tenant, operator or not      (any key)
    GET /console/api/cluster        pools and nodes now                          (operator keys)
    GET /console/api/series         per-pool series of the last 15 minutes       (operator keys)
    GET /console/api/requests       the recent requests, newest first           (a tenant: its own)
    GET /console/api/requests/<id>  one of them, with its waterfall              (a tenant: its own)

Keys are the API's (`Authorization: Bearer`); a missing or wrong key is a 401 in the OpenAI error shape,
which the page answers with its login prompt. Off with `--no-console` (then these paths are 404s).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from pdserve.frontend.console import cluster_view
from pdserve.frontend.errors import APIError

if TYPE_CHECKING:
    from pdserve.frontend.pipeline import Frontend
    from pdserve.frontend.tenants import Tenant

STATIC_DIR = Path(__file__).with_name("static")
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".png": "image/png", ".svg": "image/svg+xml", ".txt": "text/plain"}
# Scripts and styles from this origin only: no inline script, nothing fetched from elsewhere.
_PAGE_HEADERS = {
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
MAX_REQUESTS = 500  # records per /console/api/requests answer


def static_files() -> dict[str, tuple[bytes, str]]:
    """Every file of the console (relative path -> (bytes, content type)), read once at startup."""
    out = {}
    for path in sorted(STATIC_DIR.rglob("*")):
        if path.is_file() and path.suffix in _TYPES:
            out[path.relative_to(STATIC_DIR).as_posix()] = (path.read_bytes(), _TYPES[path.suffix])
    return out


def add_console_routes(app: FastAPI, frontend: Frontend) -> None:
    """The console's routes on `app` (none when the frontend runs without a console)."""
    console = frontend.console
    if console is None:
        return
    files = static_files()
    index = files["index.html"][0]

    def page() -> Response:
        return Response(index, media_type=_TYPES[".html"], headers=_PAGE_HEADERS)

    @app.get("/", include_in_schema=False)
    async def root() -> Response:
        return page()

    @app.get("/console", include_in_schema=False)
    async def console_page() -> Response:
        return page()

    @app.get("/console/static/{name:path}", include_in_schema=False)
    async def static(name: str) -> Response:
        found = files.get(name)
        if found is None:
            return error_response(APIError(404, f"No console file {name!r}.", type="not_found_error", code=None))
        return Response(found[0], media_type=found[1], headers=_PAGE_HEADERS)

    def tenant_of(request: Request, operator: bool = False) -> Tenant:
        tenant = frontend.authenticate(request.headers.get("authorization"))
        if operator and not tenant.operator:
            raise APIError(403, "This page needs an operator key (a tenant with `operator: true` in the tenants "
                           "file); your key sees its own requests and the chat.", type="permission_error",
                           code="operator_only")
        return tenant

    @app.get("/console/api/session", include_in_schema=False)
    async def session(request: Request) -> Response:
        try:
            tenant = tenant_of(request)
        except APIError as err:
            return error_response(err)
        return json_response({"tenant": tenant.name, "operator": tenant.operator,
                              "open_access": frontend.tenants.open_access, "frontend_id": frontend.config.frontend_id,
                              "version": frontend.version, "interval_s": console.history.interval_s,
                              "ttft_slo_s": frontend.config.ttft_slo_s, "tpot_slo_s": frontend.config.tpot_slo_s})

    @app.get("/console/api/cluster", include_in_schema=False)
    async def cluster(request: Request) -> Response:
        try:
            tenant_of(request, operator=True)
        except APIError as err:
            return error_response(err)
        return json_response(cluster_view(frontend))

    @app.get("/console/api/series", include_in_schema=False)
    async def series(request: Request) -> Response:
        try:
            tenant_of(request, operator=True)
            since = _float_param(request, "since", 0.0)
        except APIError as err:
            return error_response(err)
        return json_response(console.history.series(since))

    @app.get("/console/api/requests", include_in_schema=False)
    async def requests(request: Request) -> Response:
        try:
            tenant = tenant_of(request)
            limit = int(_float_param(request, "limit", 100.0))
        except APIError as err:
            return error_response(err)
        rows = [data for _, data in itertools.islice(console.recent.visible(tenant), max(1, min(limit, MAX_REQUESTS)))]
        body = b'{"object":"list","capacity":%d,"data":[%b]}' % (console.recent.capacity, b",".join(rows))
        return Response(body, media_type="application/json", headers={"cache-control": "no-store"})

    @app.get("/console/api/requests/{request_id}", include_in_schema=False)
    async def one_request(request_id: str, request: Request) -> Response:
        try:
            record = console.recent.find(tenant_of(request), request_id)
        except APIError as err:
            return error_response(err)
        if record is None:
            return error_response(APIError(404, f"No recent request {request_id!r} of yours (the console keeps the "
                                           f"last {console.recent.capacity}).", type="not_found_error",
                                           code="request_not_found"))
        return Response(record, media_type="application/json", headers={"cache-control": "no-store"})


def json_response(obj: object) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json", headers={"cache-control": "no-store"})


def error_response(err: APIError) -> Response:
    return Response(err.body(), status_code=err.status, media_type="application/json", headers=err.headers)


def _float_param(request: Request, name: str, default: float) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise APIError(400, f"Query parameter {name!r} must be a number, got {raw!r}.", param=name,
                       code="invalid_value") from None
    if value != value or value < 0:
        raise APIError(400, f"Query parameter {name!r} must be a non-negative number.", param=name,
                       code="invalid_value")
    return value
