"""The frontend's request path, independent of the HTTP framework: admit, tokenize, route, stream, account.

`Frontend.admit` does everything that can fail before a response starts (`frontend.admission`; auth is
done by the caller). `Frontend.open` starts one Generate call per choice and waits for each first message
(`frontend.upstream`), so a node that cannot take the request is replaced (or answered with a proper
status) before any byte is sent. `stream` / `collect` then produce the SSE events or the JSON body from
each choice's output (`frontend.output`), and `end` (always called once) ends the job
(`frontend.accounting`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from pdserve.engine.version import pdserve_version
from pdserve.frontend.accounting import Accounting
from pdserve.frontend.admission import Admitter
from pdserve.frontend.batches import BatchService
from pdserve.frontend.config import (
    ConfigError,
    FrontendConfig,
    check_versions,
    load_models_file,
    version_prices,
    version_weights,
)
from pdserve.frontend.connections import DecodeConnections
from pdserve.frontend.console import Console
from pdserve.frontend.embeddings import EmbeddingService
from pdserve.frontend.errors import OVERLOADED, APIError
from pdserve.frontend.job import CHAT, COMPLETION, RESPONSES, Job, UpstreamError, client_request_id, usage
from pdserve.frontend.kv_index import KVIndex, KVWatcher
from pdserve.frontend.limit_store import Limiter, RedisLimitStore, WallClock, limits_ledger_path
from pdserve.frontend.limits import TenantLimiter, UsageLedger
from pdserve.frontend.metrics import POOL, FrontendMetrics
from pdserve.frontend.models import ModelCatalog
from pdserve.frontend.output import choice_outputs
from pdserve.frontend.pool_members import Digests, PoolMembers
from pdserve.frontend.protocol import GenerationRequest
from pdserve.frontend.render import DONE, StreamEncoder, error_event, full_response
from pdserve.frontend.request_log import RequestLog
from pdserve.frontend.responses_api import ResponsesService
from pdserve.frontend.routing import Router
from pdserve.frontend.tenants import Tenant, TenantTable
from pdserve.frontend.tls import TLSConfigError, reload_pair
from pdserve.frontend.tracing import RequestTrace
from pdserve.frontend.ttft import TTFTEstimator
from pdserve.frontend.upstream import PoolFailed, UpstreamCalls
from pdserve.frontend.workers import PrepareWorkers
from pdserve.registry.view import RegistryView, ViewChange
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc.tracing import start_tracing

__all__ = ["CHAT", "COMPLETION", "RESPONSES", "Frontend", "Job", "client_request_id"]

log = logging.getLogger(__name__)

_DROP_CONNECTION_AFTER_S = 30.0
_MODELS_POLL_S = 1.0  # how often the models file is checked for new version weights
_TLS_POLL_S = 1.0  # how often the certificate and key files are checked
_TENANTS_POLL_S = 1.0  # how often the tenants file is checked: a revoked key is refused within 2 polls


class Frontend:
    """All state of one frontend process: models, tenants, limits, registry view, router, connections."""

    def __init__(self, config: FrontendConfig) -> None:
        self.config = config
        self.catalog = ModelCatalog(config.models)
        self.version = pdserve_version()
        self.tenants = TenantTable.from_file(config.tenants_file) if config.tenants_file else TenantTable.local()
        self.metrics = FrontendMetrics(config.frontend_id, tenant_series=config.metrics_tenant_series)
        wall = WallClock()
        slot = "" if config.limit_share == 1 else f"{config.limit_share_index}/{config.limit_share}"
        local = TenantLimiter(share=config.limit_share, index=config.limit_share_index, wall_clock=wall,
                              ledger=UsageLedger(limits_ledger_path(config.response_store), slot))
        store = (RedisLimitStore(config.limits_redis, config.cluster, wall, config.limits_lease_s)
                 if config.limits_redis else None)
        self.limiter = Limiter(local, store, self.metrics.limits_store_up, self.metrics.limits_store_fallbacks)
        for m in self.catalog.all_versions:
            self.metrics.model_info.labels(*self.metrics.labels(m), m.pool, m.tokenizer_digest,
                                           m.chat_template_digest, str(m.max_context)).set(1)
        self._publish_weights()
        self.request_log = RequestLog(config.request_log)
        self.view = RegistryView(config.etcd_endpoints, config.cluster)
        self.pool_members = PoolMembers(self.view, _pool_digests(self.catalog), self.metrics)
        # Which node holds which KV blocks (their event streams), for routing by exact cached prefix.
        self.kv_index = KVIndex() if config.kv_routing else None
        self.kv_watcher = KVWatcher(self.view, self.kv_index, config.rpc) if self.kv_index is not None else None
        self.router = Router(
            self.pool_members.members,
            load_factor=config.load_factor,
            affinity_blocks=config.affinity_blocks,
            decode_max_queue=config.decode_max_queue,
            kv_index=self.kv_index,
        )
        self.connections = DecodeConnections(config.rpc)
        self.workers = PrepareWorkers(config.prepare_workers, config.prepare_queue, config.models)
        self.ttft = TTFTEstimator()
        self.router.on_first_token = self.ttft.observe_lease
        self.admitter = Admitter(config, self.catalog, self.limiter, self.router, self.metrics, self.workers,
                                 self.ttft, inflight=lambda: self.inflight + self.workers.pending)
        self.calls = UpstreamCalls(config, self.router, self.connections, self.metrics)
        self.accounting = Accounting(config, self.metrics, self.request_log)
        # None unless an OTLP endpoint is configured (then `frontend.tracing` traces every request).
        self.tracer = start_tracing(config.tracing, "pdserve-frontend", {"service.instance.id": config.frontend_id},
                                    time.monotonic)
        self.responses = ResponsesService(self)
        self.embeddings = EmbeddingService(self)  # /v1/embeddings, on the prefill pool (frontend.embeddings)
        self.batches = BatchService(self)  # /v1/files and /v1/batches, and the batch runner
        self.console = Console(self) if config.console else None  # the web console's history and requests
        self.inflight = 0
        self.tls_context: ssl.SSLContext | None = None  # the server's, when it serves HTTPS (set by main)
        self._addresses: dict[str, str] = {}
        self._background: set[asyncio.Task[object]] = set()
        unknown = self.tenants.check_models(self.catalog.served_names)
        if unknown:
            log.warning("tenants file allows models that are not served: %s", unknown)
        starved = self.limiter.zero_shares(self.tenants.tenants)
        if starved:
            log.warning("limit share %s of %d: no share of these tenant limits here (refused with 429 + "
                        "Retry-After, served by other frontends): %s", config.limit_share_index,
                        config.limit_share, starved)

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the prepare workers and the registry watch; waits up to registry_sync_timeout_s for the
        first snapshot."""
        workers = asyncio.ensure_future(self.workers.start())
        await self.limiter.start()
        self.view.subscribe(self.pool_members.on_change)
        self.view.subscribe(self._on_view_change)
        if self.kv_watcher is not None:
            self.view.subscribe(self.kv_watcher.on_change)
        await self.view.start(sync_timeout_s=None)
        deadline = time.monotonic() + self.config.registry_sync_timeout_s
        while self.view.last_sync is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.view.last_sync is None:
            log.error("no registry snapshot from etcd %s within %.0fs; serving 503 until it arrives",
                      ",".join(self.config.etcd_endpoints), self.config.registry_sync_timeout_s)
        await workers
        if self.kv_watcher is not None:
            self.kv_watcher.start()  # the nodes of the first snapshot (later ones through the view's changes)
        if self.console is not None:
            self.spawn(self.console.history.run())
        if self.config.models_file is not None:
            self.spawn(self._watch_models_file(self.config.models_file))
        if self.config.tenants_file is not None:
            self.spawn(self._watch_tenants_file(self.config.tenants_file))
        if self.tls_context is not None:
            self.spawn(self._watch_tls(self.tls_context, self.config.tls_cert, self.config.tls_key))

    def spawn(self, coro: Any) -> None:
        """Runs `coro` as a task of the frontend, cancelled when it closes."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _watch_tls(self, ctx: ssl.SSLContext, cert: str, key: str) -> None:
        """Loads a changed certificate/key pair into the serving context (new connections get it); a pair
        that fails `frontend.tls.check_pair` is not loaded (a log line and the error counter)."""
        async for _ in _changes(_TLS_POLL_S, cert, key):
            try:
                info = reload_pair(ctx, cert, key)
            except TLSConfigError as err:
                log.error("TLS certificate changed but cannot be used; keeping the one in force: %s", err)
                self.metrics.config_reloads.labels(POOL, self.metrics.node, "tls", "error").inc()
                continue
            self.metrics.config_reloads.labels(POOL, self.metrics.node, "tls", "ok").inc()
            log.info("TLS certificate reloaded: %s, serial %x, valid until %s UTC", info.subject, info.serial,
                     f"{info.not_after:%Y-%m-%d %H:%M:%S}")

    async def _watch_tenants_file(self, path: str) -> None:
        """Re-reads the tenants file when it changes: keys added, changed or revoked and new limits take
        effect for the next requests, without a restart. A file that cannot be used keeps the table in
        force (a log line and `pdserve_frontend_config_reloads_total{outcome="error"}`)."""
        async for _ in _changes(_TENANTS_POLL_S, path):
            try:
                table = TenantTable.from_file(path)
            except ConfigError as err:
                log.error("tenants file %s changed but cannot be used; keeping the tenants in force: %s", path, err)
                self.metrics.config_reloads.labels(POOL, self.metrics.node, "tenants", "error").inc()
                continue
            diff = self.tenants.changes(table)
            self.tenants = table
            self.limiter.update(table.tenants)
            self.metrics.config_reloads.labels(POOL, self.metrics.node, "tenants", "ok").inc()
            log.info("tenants file %s reloaded: %d tenants; added %s, removed %s, changed %s", path,
                     len(table.tenants), diff["added"] or "none", diff["removed"] or "none", diff["changed"] or "none")
            unknown = table.check_models(self.catalog.served_names)
            if unknown:
                log.warning("tenants file allows models that are not served: %s", unknown)

    async def _watch_models_file(self, path: str) -> None:
        """Re-reads the models file when it changes and applies its versions' routing weights (canary
        shifts and rollbacks without a restart), price tables and degradation policies. A file that cannot
        be used (a negative price, say) changes nothing: the weights, prices and degradation policies in force
        stay (a log line and `pdserve_frontend_config_reloads_total{file="models",outcome="error"}`). Other
        changes need a restart; they are logged, not applied."""
        async for _ in _changes(_MODELS_POLL_S, path):
            try:
                specs = load_models_file(path)
                check_versions(specs)
            except ConfigError as err:
                log.error("models file %s changed but cannot be used; keeping the weights, prices and degradation policies in force: %s",
                          path, err)
                self.metrics.config_reloads.labels(POOL, self.metrics.node, "models", "error").inc()
                continue
            for line in [*self.catalog.set_weights(version_weights(specs)),
                         *self.catalog.set_prices(version_prices(specs))]:
                log.info("models file %s: %s", path, line)
            for line in self.catalog.set_degrade({(s.name, s.version): s.degrade for s in specs}):
                log.info("models file %s: %s", path, line)
            self.metrics.config_reloads.labels(POOL, self.metrics.node, "models", "ok").inc()
            self._publish_weights()
            running = {(m.name, m.version, m.pool, m.spec.path) for m in self.catalog.all_versions}
            if {(s.name, s.version, s.pool, s.path) for s in specs} != running:
                log.warning("models file %s: changes other than weights and degrade take effect after a restart", path)

    def _publish_weights(self) -> None:
        for m in self.catalog.all_versions:
            self.metrics.model_weight.labels(*self.metrics.labels(m)).set(self.catalog.weight(m))

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self.batches.close()
        await self.responses.close()
        await self.embeddings.close()
        if self.kv_watcher is not None:
            await self.kv_watcher.close()
        await self.view.close()
        await self.connections.close()
        self.workers.close()
        await self.limiter.close()
        self.request_log.close()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # exports the spans still queued

    def _on_view_change(self, change: ViewChange) -> None:
        if change.member is not None and change.member.role == "decode":
            self._addresses[change.node_id] = change.member.record.grpc_address
        elif change.kind == "left" and change.node_id in self._addresses:
            address = self._addresses.pop(change.node_id)
            for coro in (self._drop_later(address), self.calls.node_left(change.node_id)):
                self.spawn(coro)

    async def _drop_later(self, address: str) -> None:
        # Late: requests still streaming from a node that just left may finish; and a node that comes
        # back at the same address keeps its connection.
        await asyncio.sleep(_DROP_CONNECTION_AFTER_S)
        if address not in self._addresses.values():
            await self.connections.drop(address)

    # --- auth and readiness ----------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of a request's Authorization header; 401 APIError when it has none."""
        key = None
        if authorization:
            scheme, _, value = authorization.partition(" ")
            key = value.strip() if scheme.lower() == "bearer" else None
        tenant = self.tenants.authenticate(key)
        if tenant is None:
            if not authorization:
                message = ("You didn't provide an API key. You need to provide your API key in an Authorization "
                           "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
            else:
                message = "Incorrect API key provided."
            raise APIError(401, message, param=None, code="invalid_api_key")
        return tenant

    def readiness(self) -> dict[str, Any]:
        models: dict[str, Any] = {}
        for m in self.catalog.models:
            versions = {}
            for v in self.catalog.versions_of(m):
                st = self.router.status(v.pool)
                versions[v.version] = {"pool": v.pool, "prefill": len(st.prefill), "decode": len(st.decode),
                                       "ready": st.ready, "weight": self.catalog.weight(v)}
            if len(versions) == 1:
                models[m.name] = {k: val for k, val in versions[m.version].items() if k != "weight"}
            else:  # ready when a version that takes new requests is
                models[m.name] = {"ready": any(v["ready"] and v["weight"] > 0 for v in versions.values()),
                                  "versions": versions}
        return {"ready": any(v["ready"] for v in models.values()), "registry_connected": self.view.connected,
                "models": models}

    def list_models(self, tenant: Tenant) -> list[dict[str, Any]]:
        out = []
        for m in self.catalog.models:
            names = self.catalog.names_of(m)
            if tenant.may_use(*names):
                fingerprints = sorted({mem.record.model_fingerprint for mem in self.pool_members.members(None, m.pool)})
                extra: dict[str, Any] = {"max_model_len": m.max_context, "pool": m.pool,
                         "model_fingerprint": fingerprints[0] if len(fingerprints) == 1 else None,
                         "tokenizer_digest": m.tokenizer_digest, "chat_template_digest": m.chat_template_digest,
                         "pdserve_version": self.version}
                versions = self.catalog.versions_of(m)
                if len(versions) > 1:
                    extra["versions"] = [{"version": v.version, "pool": v.pool, "weight": self.catalog.weight(v),
                                          "tokenizer_digest": v.tokenizer_digest} for v in versions]
                out += [{"id": name, "object": "model", "created": m.created, "owned_by": "pdserve", **extra}
                        for name in names]
        return out

    # --- a job's life ----------------------------------------------------------------------------

    async def admit(self, kind: str, tenant: Tenant, body: bytes, headers: Mapping[str, str],
                    trace: RequestTrace | None = None, batch: bool = False) -> Job:
        """Validates, tokenizes, routes and admits a request (`Admitter.admit`); `trace` (tracing on)
        becomes the job's; `batch`: a line of a /v1/batches job (charged at the batch discount). Raises
        APIError (4xx/503). On success the job counts as in flight until `end`."""
        self._check_inflight()
        return self._admitted(await self.admitter.admit(kind, tenant, body, headers, batch), trace)

    async def admit_request(self, kind: str, tenant: Tenant, req: GenerationRequest, headers: Mapping[str, str],
                            trace: RequestTrace | None, arrived: float, batch: bool = False) -> Job:
        """`admit` for a request already validated (the Responses API's, once its conversation is known)."""
        self._check_inflight()
        offload = sum(len(m.get("content") or "") for m in req.messages or ()) > self.config.prepare_inline_bytes
        job = await self.admitter.admit_request(kind, tenant, req, headers, arrived, offload, batch)
        return self._admitted(job, trace)

    def _check_inflight(self) -> None:
        if self.inflight + self.workers.pending >= self.config.max_inflight:
            raise APIError(503, "This frontend is at its in-flight request limit; retry shortly.",
                           type=OVERLOADED, code="overloaded", headers={"retry-after": "1"})

    def _admitted(self, job: Job, trace: RequestTrace | None) -> Job:
        job.trace = trace
        self.inflight += 1
        self.metrics.inflight_now.inc()
        return job

    async def open(self, job: Job) -> list[pb.GenerateResponse]:
        """Starts every choice's Generate call and returns each one's first message; when the model's pool
        fails the job before anything was sent, the fallback model serves it (`Admitter.fall_back`).
        Raises APIError."""
        self.batches.watch(job)
        try:
            return await self.calls.open(job)
        except PoolFailed as failed:
            failed_model = job.model.name
            if not await self.admitter.fall_back(job, failed.error.message):
                raise failed.error from None
        log.warning("request %s: model %s failed before the first token; %s", job.id, failed_model,
                    job.fallback_reason)
        try:
            return await self.calls.open(job)
        except PoolFailed as failed:
            raise failed.error from None

    async def stream(self, job: Job, firsts: list[pb.GenerateResponse]) -> AsyncIterator[bytes]:
        """The SSE events of a streamed job; the first item also carries the chat role chunks."""
        req = job.req
        enc = StreamEncoder(job.kind, job.id, job.created, job.model.name, job.fingerprint, req.include_usage)
        outputs = choice_outputs(job)
        pending: list[bytes] = [enc.role(c.index) for c in job.choices] if job.kind == CHAT else []
        try:
            async for c, msg in self.calls.messages(job, firsts):
                pending += enc.delta(c.index, outputs[c.index].take(msg))
                if pending:
                    yield b"".join(pending) if len(pending) > 1 else pending[0]
                    pending = []
        except UpstreamError as err:
            job.error = err.error
            log.warning("request %s failed mid-stream: %s", job.id, err.error.message)
            yield error_event(job.traced(err.error).to_dict()) + DONE
            return
        if req.include_usage:
            yield enc.usage(usage(job)) + DONE
        else:
            yield DONE

    async def collect(self, job: Job, firsts: list[pb.GenerateResponse]) -> bytes:
        """The JSON body of a non-streamed job. Raises APIError when a node fails it."""
        outputs = choice_outputs(job)
        try:
            async for c, msg in self.calls.messages(job, firsts):
                outputs[c.index].take(msg)
        except UpstreamError as err:
            raise err.error from None
        return full_response(job.kind == CHAT, job.id, job.created, job.model.name, job.fingerprint,
                             [out.choice() for out in outputs], usage(job))

    def reject(self, kind: str, tenant: str | None, err: APIError, client_id: str | None) -> None:
        """Accounts a request refused before it started (metrics and a request log line)."""
        self.accounting.reject(kind, tenant, err, client_id)

    def end(self, job: Job) -> None:
        """Ends a job exactly once (see `Accounting.end`); it no longer counts as in flight."""
        if job.ended:
            return
        self.accounting.end(job)
        if job.lane is not None:
            job.lane.release()
        if job.trace is not None:
            job.trace.end(job, time.monotonic())
        self.inflight -= 1
        self.metrics.inflight_now.dec()


def _pool_digests(catalog: ModelCatalog) -> dict[str, Digests]:
    """pool -> the digests its nodes must publish (the first served model of a pool names them)."""
    out: dict[str, Digests] = {}
    for m in catalog.all_versions:
        out.setdefault(m.pool, Digests(m.tokenizer_digest, m.chat_template_digest))
    return out


async def _changes(every_s: float, *paths: str) -> AsyncIterator[None]:
    """Yields each time one of the files at `paths` has changed (its mtime or size; a symlink is
    followed, as a mounted Secret or ConfigMap swaps one), checked every `every_s`; a file that is missing
    for a while is not a change."""
    def stamp() -> tuple[tuple[int, int], ...] | None:
        try:
            return tuple((st.st_mtime_ns, st.st_size) for st in map(os.stat, paths))
        except OSError:
            return None

    seen = stamp()
    while True:
        await asyncio.sleep(every_s)
        now = stamp()
        if now is None or now == seen:
            continue
        seen = now
        yield None
