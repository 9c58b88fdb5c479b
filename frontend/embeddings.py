"""`POST /v1/embeddings`: prefill-only work, served by the prefill pool and never by a decode node.

Parsing (`parse_embedding_request`): `model`, `input` (a string, a list of strings, a token-id list or a
list of token-id lists; at most MAX_INPUTS inputs, `--max-prompt-chars` characters and ids in all; an
empty string or list is a 400, as OpenAI answers), `encoding_format` `float` | `base64` (little-endian
float32 bytes, base64, as OpenAI sends them), `dimensions` (a 400 "does not support specifying
dimensions" unless it is the model's own size: no model here truncates), `user`.

Admission reuses the chat path's pieces: the tenant's model permission (403), its limits (request and
input-token buckets, concurrency, daily quota: `TenantLimiter.precheck` / `grant` with no output; the
grant is released when the request ends), the context (a 400 context_length_exceeded for an input past
the model's or tenant's context).

Routing: the pool's usable prefill nodes (`registry.placement.usable_prefill`), least loaded first (their
load records plus this frontend's outstanding calls, `Router.prefill_outstanding`, which chat routing sees
too); a colocated pool (no prefill node) is served by its colocated decode nodes. A list of inputs is split
into contiguous parts of about equal tokens, one per node, called concurrently (`Embed`, carrying the
cluster token as every internal call does). A part whose node fails (unreachable, refusing, failing) is
retried once on another node; then a 503 (refused or unreachable) or 502.

Pooling is the model's (`ModelSpec.embedding`: `last` + normalize unless the models file says otherwise).
Metrics: `pdserve_frontend_requests_total{endpoint="embeddings"}`, `pdserve_frontend_tokens_total{kind=
"prompt"}`, `pdserve_frontend_embedding_requests_total{model_pool,tenant,status}` and
`pdserve_frontend_cost_total` (input tokens at the model's input price; a batch line at its batch
discount); one request-log line per request, with its `cost_usd`.
"""

from __future__ import annotations

import array
import asyncio
import base64
import logging
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from pdserve.frontend.errors import OVERLOADED, APIError, invalid_type, invalid_value, missing_parameter
from pdserve.frontend.limits import AnyGrant
from pdserve.frontend.models import ServedModel
from pdserve.frontend.pricing import cost_usd
from pdserve.frontend.prompts import text_or_token_lists
from pdserve.frontend.protocol import parse_json_body
from pdserve.frontend.tenants import Tenant
from pdserve.registry.placement import prefill_load, usable_prefill
from pdserve.registry.view import Member
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as pbg

log = logging.getLogger(__name__)

EMBEDDINGS = "embeddings"  # the endpoint label
MAX_INPUTS = 2048  # OpenAI's bound (node_common.embed.MAX_EMBED_INPUTS too)
ENCODINGS = ("float", "base64")
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.keepalive_time_ms", 20_000),
                    ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 2_000),
                    ("grpc.enable_retries", 0)]
_REFUSED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION)


@dataclass(eq=False)
class EmbeddingRequest:
    model: str
    inputs: list[str | list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


def parse_embedding_request(obj: dict[str, Any], max_chars: int) -> EmbeddingRequest:
    """The validated body. Raises APIError (400)."""
    model = obj.get("model")
    if model is None:
        raise missing_parameter("model")
    if not isinstance(model, str) or not model:
        raise invalid_type("model", "a string", model)
    if "input" not in obj or obj["input"] is None:
        raise missing_parameter("input")
    inputs = text_or_token_lists(obj["input"], "input", MAX_INPUTS, _empty_input)
    size = sum(len(p) for p in inputs)
    if size > max_chars:
        raise APIError(400, f"The input is too long: {size} characters and token ids; the limit is {max_chars}.",
                       param="input", code="prompt_too_long")
    fmt = obj.get("encoding_format", "float")
    if fmt is None:
        fmt = "float"
    if fmt not in ENCODINGS:
        raise invalid_value("encoding_format", f"{str(fmt)[:40]!r}; supported values are 'float' and 'base64'.")
    dims = obj.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool)):
        raise invalid_type("dimensions", "an integer", dims)
    if dims is not None and dims < 1:
        raise invalid_value("dimensions", f"{dims}; it must be at least 1.")
    user = obj.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid_type("user", "a string", user)
    return EmbeddingRequest(model, inputs, fmt, dims, user)


def _empty_input(param: str) -> APIError:
    return APIError(400, "'$.input' is invalid. Please check the API reference: "
                    "https://platform.openai.com/docs/api-reference.", param=param, code="invalid_value")


def encode_vector(raw: bytes, encoding_format: str) -> list[float] | str:
    """One vector's little-endian float32 bytes as the response carries it: floats, or base64 of the bytes."""
    if encoding_format == "base64":
        return base64.b64encode(raw).decode()
    values = array.array("f", raw)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def split_inputs(lengths: list[int], parts: int) -> list[range]:
    """Contiguous ranges of about equal token counts, at most `parts` of them (none empty)."""
    parts = max(1, min(parts, len(lengths)))
    total = sum(lengths)
    out: list[range] = []
    start, acc = 0, 0
    for i, n in enumerate(lengths):
        acc += n
        left_parts = parts - len(out) - 1
        if left_parts and (acc >= total * (len(out) + 1) / parts or len(lengths) - i - 1 == left_parts):
            out.append(range(start, i + 1))
            start = i + 1
    if start < len(lengths):
        out.append(range(start, len(lengths)))
    return out


@dataclass(eq=False)
class _Part:
    inputs: range
    vectors: bytes = b""
    dimensions: int = 0
    node_id: str = ""
    tried: list[str] = field(default_factory=list)


class EmbeddingService:
    """Serves /v1/embeddings for one frontend (its own gRPC channels to prefill and colocated nodes)."""

    def __init__(self, frontend: Any) -> None:  # a pipeline.Frontend
        self.fe = frontend
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close(grace=1.0)
        self._channels.clear()

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self.fe.config.rpc.aio_channel(address, options=_CHANNEL_OPTIONS)
        return channel

    # -- one request ----------------------------------------------------------------------------------

    async def handle(self, tenant: Tenant, body: bytes, headers: Mapping[str, str],
                     batch: bool = False) -> dict[str, Any]:
        """The response object of one request (`batch`: a line of a /v1/batches job, charged at the batch
        discount). Raises APIError (accounted: a refusal before it ran by `reject`, a failure after by
        `_account`)."""
        arrived = time.monotonic()
        try:
            req, model, members, ids, grant = await self._admit(tenant, body, headers)
        except APIError as err:
            self.reject(tenant.name, err)
            raise
        tokens = sum(len(p) for p in ids)
        request_id = f"embd-{uuid.uuid4().hex}"
        status, error = 200, None
        try:
            parts = await self._run(request_id, model, members, ids)
        except APIError as err:
            status, error = err.status, err
            raise
        finally:
            grant.release(0, self._account(request_id, tenant, model, req, tokens, status, error, arrived, batch))
        data = []
        for part in parts:
            size = 4 * part.dimensions
            for k, i in enumerate(part.inputs):
                raw = part.vectors[k * size:(k + 1) * size]
                data.append({"object": "embedding", "index": i, "embedding": encode_vector(raw, req.encoding_format)})
        return {"object": "list", "data": data, "model": model.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def _admit(self, tenant: Tenant, body: bytes, headers: Mapping[str, str]) -> tuple[
            EmbeddingRequest, ServedModel, list[Member], list[list[int]], AnyGrant]:
        """Parse, model and permission, limits, version and nodes, tokens, context, the tenant's grant."""
        fe = self.fe
        req = parse_embedding_request(parse_json_body(body), fe.config.max_prompt_chars)
        model = fe.catalog.resolve(req.model)
        if not tenant.may_use(*fe.catalog.names_of(model)):
            raise APIError(403, f"Tenant {tenant.name!r} may not use model `{req.model}`.", type="permission_error",
                           param="model", code="model_not_allowed")
        fe.admitter._limited(tenant, lambda: fe.limiter.precheck(tenant))
        session_key = headers.get(fe.config.session_header) if fe.config.session_header else None
        model, members = self._pick(model, session_key or req.user)
        if req.dimensions is not None:  # no served model truncates (Matryoshka) its embeddings
            raise APIError(400, "This model does not support specifying dimensions.", param="dimensions",
                           code="invalid_value")
        ids = await self._tokenize(model, req, len(body) > fe.config.prepare_inline_bytes)
        self._check_context(tenant, model, ids)
        tokens = sum(len(p) for p in ids)
        grant: AnyGrant = await fe.admitter.limited(tenant, fe.limiter.grant(tenant, tokens, 0))
        return req, model, members, ids, grant

    def _pick(self, model: ServedModel, session_key: str | None) -> tuple[ServedModel, list[Member]]:
        """The version of `model` to serve (by weight, sticky per session key) whose pool has embedding
        nodes, and those nodes: its usable prefill nodes, else (a colocated pool) its colocated decode
        nodes. 503 APIError when no version has any."""
        fe = self.fe
        for version in fe.catalog.rank(model, session_key):
            members = self.members(version.pool)
            if members:
                return version, members
        raise APIError(503, f"Model `{model.name}` cannot take embedding requests now: no prefill node (nor a "
                       "colocated decode node) serves it.", type=OVERLOADED, code="no_route",
                       headers={"retry-after": "1"})

    def members(self, pool: str) -> list[Member]:
        nodes = self.fe.pool_members
        prefill = usable_prefill(nodes.members("prefill", pool))
        if prefill:
            return prefill
        return [m for m in nodes.members("decode", pool) if m.record.colocated and not m.draining]

    async def _tokenize(self, model: ServedModel, req: EmbeddingRequest, offload: bool) -> list[list[int]]:
        def run() -> list[list[int]]:
            out = []
            for i, p in enumerate(req.inputs):
                if isinstance(p, str):
                    out.append(model.encode(p))
                else:
                    model.check_token_ids(p, "input" if len(req.inputs) == 1 else f"input[{i}]")
                    out.append(p)
            return out

        # A large body is tokenized off the event loop (the Rust tokenizer releases the GIL).
        return await asyncio.to_thread(run) if offload else run()

    def _check_context(self, tenant: Tenant, model: ServedModel, ids: list[list[int]]) -> None:
        limit = model.max_context
        if tenant.limits.max_context_tokens is not None:
            limit = min(limit, tenant.limits.max_context_tokens)
        for i, p in enumerate(ids):
            if not p:
                raise APIError(400, f"Input {i} has no tokens.", param="input", code="invalid_value")
            if len(p) > limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens, however you requested "
                               f"{len(p)} tokens in input {i}. Please reduce your input.", param="input",
                               code="context_length_exceeded")

    # -- the node calls -------------------------------------------------------------------------------

    async def _run(self, request_id: str, model: ServedModel, members: list[Member],
                   ids: list[list[int]]) -> list[_Part]:
        router = self.fe.router
        ranked = sorted(members, key=lambda m: (prefill_load(m, router.prefill_outstanding), m.node_id))
        parts = [_Part(r) for r in split_inputs([len(p) for p in ids], len(ranked))]
        pooling = model.spec.embedding
        await asyncio.gather(*(self._serve_part(request_id, k, part, ranked, ids, pooling.pooling, pooling.normalize)
                               for k, part in enumerate(parts)))
        return parts

    async def _serve_part(self, request_id: str, k: int, part: _Part, ranked: list[Member], ids: list[list[int]],
                          pooling: str, normalize: bool) -> None:
        """Embeds one part on its node (the k-th least loaded), or once more on another one. Raises APIError."""
        router = self.fe.router
        message = pb.EmbedRequest(request_id=f"{request_id}-{k}", pooling=pooling, normalize=normalize,
                                  inputs=[pb.TokenIds(ids=ids[i]) for i in part.inputs])
        first = ranked[k % len(ranked)]
        candidates = [first] + [m for m in ranked if m is not first]
        last: grpc.aio.AioRpcError | None = None
        for member in candidates[:2]:
            part.tried.append(member.node_id)
            stub = (pbg.PrefillNodeStub if member.role == "prefill" else pbg.DecodeNodeStub)(
                self._channel(member.record.grpc_address))
            router.adjust(router.prefill_outstanding, member.node_id, +1)
            try:
                resp = await stub.Embed(message, timeout=self.fe.config.request_timeout_s)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise APIError(400, f"Invalid input: {err.details()}", param="input",
                                   code="invalid_value") from None
                log.warning("embedding %s: node %s failed (%s: %s)", request_id, member.node_id, err.code().name,
                            err.details())
                router.mark_unavailable(member.node_id)
                last = err
                continue
            finally:
                router.adjust(router.prefill_outstanding, member.node_id, -1)
            part.vectors, part.dimensions, part.node_id = resp.vectors, resp.dimensions, resp.node_id
            return
        assert last is not None
        if last.code() in _REFUSED:
            raise APIError(503, f"No node could take the embedding request now ({last.details()}); retry shortly.",
                           type=OVERLOADED, code="overloaded", headers={"retry-after": "1"})
        raise APIError(502, f"The node serving the embedding request failed: {last.code().name} {last.details()}",
                       type="server_error", code="upstream_error")

    # -- accounting ------------------------------------------------------------------------------------

    def _account(self, request_id: str, tenant: Tenant, model: ServedModel, req: EmbeddingRequest, tokens: int,
                 status: int, error: APIError | None, arrived: float, batch: bool) -> float:
        """Metrics and the request-log line of one request; returns what it cost (its tenant's spend)."""
        m = self.fe.metrics
        lbl = m.labels(model)
        # Input tokens only, at the input price; a request that failed returned no vectors and costs nothing.
        usd = cost_usd(model.prices, tokens, 0, 0, batch) if error is None else 0.0
        m.observe_cost(model, tenant.name, usd)
        m.requests.labels(*lbl, EMBEDDINGS, str(status), "stop" if error is None else "error").inc()
        m.tokens.labels(*lbl, tenant.name, "prompt").inc(tokens)
        m.embedding_requests.labels(*lbl, model.pool, tenant.name, str(status)).inc()
        m.e2e.labels(*lbl).observe(time.monotonic() - arrived)
        self.fe.request_log.write({
            "ts": time.time(), "request_id": request_id, "tenant": tenant.name, "endpoint": EMBEDDINGS,
            "model": model.name, "requested_model": req.model, "pool": model.pool, "status": status,
            "inputs": len(req.inputs), "prompt_tokens": tokens, "e2e_ms": round((time.monotonic() - arrived) * 1e3, 3),
            "error": error.message if error is not None else None, "error_code": error.code if error else None,
            "batch": batch, "cost_usd": usd})
        return usd

    def reject(self, tenant: str | None, err: APIError) -> None:
        """A request refused before it ran (metrics and a request-log line)."""
        fe = self.fe
        fe.metrics.requests.labels("frontend", fe.config.frontend_id, "", "", EMBEDDINGS, str(err.status),
                                   "rejected").inc()
        fe.request_log.write({"ts": time.time(), "request_id": None, "tenant": tenant, "endpoint": EMBEDDINGS,
                              "status": err.status, "error": err.message, "error_code": err.code, "cost_usd": 0.0})


def add_embedding_routes(app: FastAPI, frontend: Any) -> None:
    """`POST /v1/embeddings` on `app`, served by `frontend.embeddings` (a pipeline.Frontend's service)."""
    service: EmbeddingService = frontend.embeddings

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        tenant_name = None
        try:
            tenant = frontend.authenticate(request.headers.get("authorization"))
            tenant_name = tenant.name
            body = await _read_body(request, frontend)
            obj = await service.handle(tenant, body, request.headers)
        except APIError as err:
            if tenant_name is None or err.status in (408, 413):  # refused before `handle` accounted it
                service.reject(tenant_name, err)
            return Response(err.body(), status_code=err.status, media_type="application/json", headers=err.headers)
        except ClientDisconnect:
            return Response(status_code=499)
        return Response(orjson.dumps(obj), media_type="application/json")


async def _read_body(request: Request, frontend: Any) -> bytes:
    from pdserve.frontend.app import read_body

    return await read_body(request, frontend.config.max_body_bytes, frontend.config.body_timeout_s)
