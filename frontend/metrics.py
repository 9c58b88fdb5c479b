"""Prometheus metrics of one frontend process, in a registry of its own (served on /metrics).

Every series carries pool="frontend" and node=<frontend id>, so dashboards can put the frontend next to
the prefill and decode pools. Latencies are observed once per request when it ends, which keeps the
per-token path free of metric calls.

Per-tenant series (`pdserve_frontend_tenant_*`) keep their cardinality bounded: at most `tenant_series`
tenants (the most requests) carry their own `tenant` label, every other tenant is counted under
tenant="other" (`TenantLabels`).
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.engine.version import pdserve_version
from pdserve.frontend.models import ServedModel

POOL = "frontend"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_TOKEN_COUNT_BUCKETS = tuple(float(16 << i) for i in range(12))  # 16, 32, ..., 32768 tokens
OTHER_TENANT = "other"
DEFAULT_TENANT_SERIES = 20


class TenantLabels:
    """The `tenant` label value of the per-tenant series: a tenant's own name while it is among the
    `limit` tenants with the most requests (counted over the process's life), else "other".

    Seats fill first come, first served; once all are taken, a tenant outside takes the seat of the seated
    tenant with the fewest requests when it has more than twice as many (the margin keeps two tenants of
    similar traffic from trading the seat back and forth). The displaced tenant's series are removed
    (`on_evict`) and it is counted under "other" from then on, so at most limit + 1 values ever exist."""

    def __init__(self, limit: int, on_evict: Callable[[str], None] | None = None) -> None:
        self.limit = max(0, limit)
        self.counts: dict[str, int] = {}
        self.seated: set[str] = set()
        self._on_evict = on_evict

    def count(self, tenant: str) -> str:
        """Counts one request of `tenant` and returns the label value it is recorded under."""
        n = self.counts[tenant] = self.counts.get(tenant, 0) + 1
        if tenant in self.seated:
            return tenant
        if len(self.seated) < self.limit:
            self.seated.add(tenant)
            return tenant
        if not self.seated:
            return OTHER_TENANT
        lowest = min(self.seated, key=lambda t: (self.counts[t], t))
        if n > 2 * self.counts[lowest]:
            self.seated.discard(lowest)
            self.seated.add(tenant)
            if self._on_evict is not None:
                self._on_evict(lowest)
            return tenant
        return OTHER_TENANT


class FrontendMetrics:
    """The frontend's counters and histograms (changed by `observe_*` and the counters' own methods)."""

    def __init__(self, node: str, tenant_series: int = DEFAULT_TENANT_SERIES) -> None:
        self.node = node
        self.tenant_labels = TenantLabels(tenant_series, on_evict=self._drop_tenant)
        self._tenant_children: dict[str, set[tuple[Any, tuple[str, ...]]]] = {}  # tenant -> (metric, labels)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        base = ["pool", "node", "model", "version"]  # version: the canary version ("" with one version)
        self.sse_keepalives = Counter("pdserve_frontend_sse_keepalives_total",
                                      "SSE keep-alive comments sent on silent streams", ["pool", "node"],
                                      registry=r).labels(POOL, node)
        self.build_info = Gauge("pdserve_build_info", "Always 1; the labels name the pdserve version",
                                ["pool", "node", "version", "python"], registry=r)
        self.build_info.labels(POOL, node, pdserve_version(), platform.python_version()).set(1)
        self.model_info = Gauge("pdserve_model_info",
                                "Always 1 per served model; the labels name its tokenizer and chat template",
                                [*base, "model_pool", "tokenizer", "chat_template", "max_context"], registry=r)
        self.model_weight = Gauge("pdserve_frontend_model_weight",
                                  "Routing weight of each version of a served model (canary; 0: no new requests)",
                                  base, registry=r)
        self.requests = Counter("pdserve_frontend_requests_total", "Requests by endpoint, HTTP status and finish reason",
                                [*base, "endpoint", "status", "finish_reason"], registry=r)
        self.choices = Counter("pdserve_frontend_choices_total",
                               "Choices that produced tokens, by how they were served: disaggregated, "
                               "local_prefill, retried, migrated", [*base, "path"], registry=r)
        self.tokens = Counter("pdserve_frontend_tokens_total", "Prompt and completion tokens per tenant and model",
                              [*base, "tenant", "kind"], registry=r)
        self.cost = Counter("pdserve_frontend_cost", "USD charged per tenant and model: finished requests' usage at the "
                            "models file's prices (frontend.pricing.cost_usd; batch lines with the batch discount)",
                            [*base, "tenant"], registry=r)
        self.rejections = Counter("pdserve_frontend_rate_limited_total", "Requests refused by tenant limits",
                                  ["pool", "node", "tenant", "limit"], registry=r)
        self.config_reloads = Counter("pdserve_frontend_config_reloads_total", "Changed config files re-read, by file "
                                      "(models, tenants, tls) and outcome (ok: in force; error: unusable, the old one kept)",
                                      ["pool", "node", "file", "outcome"], registry=r)
        self.slo = Counter("pdserve_frontend_slo_requests_total", "Requests meeting (met=true) or missing an SLO",
                           [*base, "slo", "met"], registry=r)
        self.inflight = Gauge("pdserve_frontend_requests_in_flight", "Requests being served by this frontend",
                              ["pool", "node"], registry=r)
        self.routes = Counter("pdserve_frontend_route_decisions_total", "Node choices by role and rule",
                              [*base, "role", "rule"], registry=r)
        self.disconnects = Counter("pdserve_frontend_client_disconnects_total", "Requests aborted by a client disconnect",
                                   base, registry=r)
        self.migrations = Counter("pdserve_frontend_migrations_total",
                                  "Choices moved to another decode node mid-stream, by what broke the stream",
                                  [*base, "reason"], registry=r)
        self.retries = Counter("pdserve_frontend_upstream_retries_total",
                               "Choices started again on another decode node before their first token, by what failed",
                               [*base, "reason"], registry=r)
        self.goodput_tokens = Counter("pdserve_frontend_goodput_tokens_total",
                                      "Completion tokens of requests that met both the TTFT and TPOT targets",
                                      base, registry=r)
        self.embedding_requests = Counter("pdserve_frontend_embedding_requests_total",
                                          "/v1/embeddings requests by model pool, tenant and HTTP status",
                                          [*base, "model_pool", "tenant", "status"], registry=r)
        self.degradations = Counter("pdserve_frontend_degradations_total",
                                    "Requests a degradation policy changed (cap_max_tokens, trim_history, "
                                    "long_prompt_lane), by policy", [*base, "policy"], registry=r)
        self.nodes_excluded = Gauge("pdserve_frontend_nodes_excluded", "Registered nodes not routed to: their "
                                    "tokenizer or chat_template digest differs from this frontend's",
                                    ["pool", "node", "model_pool", "reason"], registry=r)
        self.limits_store_up = Gauge("pdserve_frontend_limits_store_up", "1 while the shared limits store "
                                     "(--limits-redis) decides admissions, 0 while this frontend falls back to its "
                                     "local share", ["pool", "node"], registry=r).labels(POOL, node)
        self.limits_store_fallbacks = Counter("pdserve_frontend_limits_store_fallbacks_total",
                                              "Admissions decided by this frontend's local share because the shared "
                                              "limits store was unreachable", ["pool", "node"],
                                              registry=r).labels(POOL, node)
        self.inflight_now = self.inflight.labels(POOL, node)
        self._declare_latencies(base)
        self._declare_request_shapes(base)

    def _declare_latencies(self, base: list[str]) -> None:
        """The latency histograms: TTFT (and its breakdown by stage), ITL, TPOT, end to end, node queues."""
        r = self.registry
        self.ttft = Histogram("pdserve_frontend_ttft_seconds", "Time from request arrival to first token",
                              base, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_frontend_itl_seconds", "Time between streamed token messages",
                             base, buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_frontend_tpot_seconds",
                              "Per request: (last token - first token) / (tokens - 1)",
                              base, buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_frontend_e2e_seconds", "Time from request arrival to its end",
                             base, buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("pdserve_frontend_queue_seconds",
                               "Time queued on the nodes (prefill queue + reservation wait) as they report it",
                               base, buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_breakdown = Histogram("pdserve_ttft_breakdown_seconds",
                                        "TTFT by stage: frontend, prefill_queue, prefill, transfer, "
                                        "reservation_wait, first_decode_step", [*base, "stage"],
                                        buckets=_LATENCY_BUCKETS, registry=r)

    def _declare_request_shapes(self, base: list[str]) -> None:
        """Token-length histograms per model pool and the per-tenant series (tenant label bounded)."""
        r = self.registry
        self.input_tokens = Histogram("pdserve_frontend_request_input_tokens",
                                      "Prompt tokens of each finished request (all its prompts), per model pool",
                                      [*base, "model_pool"], buckets=_TOKEN_COUNT_BUCKETS, registry=r)
        self.output_tokens = Histogram("pdserve_frontend_request_output_tokens",
                                       "Completion tokens of each finished request (all its choices), per model pool",
                                       [*base, "model_pool"], buckets=_TOKEN_COUNT_BUCKETS, registry=r)
        self.tenant_requests = Counter("pdserve_frontend_tenant_requests_total",
                                       "Requests per tenant (the top tenants by requests; the rest: tenant=\"other\")",
                                       [*base, "tenant"], registry=r)
        self.tenant_errors = Counter("pdserve_frontend_tenant_errors_total",
                                     "Failed requests (HTTP status >= 400, client disconnects aside) per tenant, by "
                                     "HTTP status and OpenAI error code (the rest of the tenants: tenant=\"other\")",
                                     [*base, "tenant", "status", "code"], registry=r)
        self.tenant_ttft = Histogram("pdserve_frontend_tenant_ttft_seconds",
                                     "Time from request arrival to first token per tenant (the rest: tenant=\"other\")",
                                     [*base, "tenant"], buckets=_LATENCY_BUCKETS, registry=r)

    def _tenant_child(self, metric: Any, tenant: str, *values: str) -> Any:
        if tenant != OTHER_TENANT:
            self._tenant_children.setdefault(tenant, set()).add((metric, values))
        return metric.labels(*values)

    def _drop_tenant(self, tenant: str) -> None:
        """Removes the series of a tenant that lost its own label (it is "other" from now on)."""
        for metric, values in self._tenant_children.pop(tenant, ()):
            metric.remove(*values)

    def observe_tenant(self, base: Sequence[str], tenant: str, ttft: float | None, status: int,
                       code: str | None) -> None:
        """One request of `tenant` ended (or was refused): its request count, TTFT and error, if any."""
        label = self.tenant_labels.count(tenant)
        self._tenant_child(self.tenant_requests, label, *base, label).inc()
        if ttft is not None:
            self._tenant_child(self.tenant_ttft, label, *base, label).observe(ttft)
        if status >= 400 and status != 499:
            self._tenant_child(self.tenant_errors, label, *base, label, str(status), code or "").inc()

    def observe_request_tokens(self, model: ServedModel, prompt: int, completion: int) -> None:
        lbl = (*self.labels(model), model.pool)
        self.input_tokens.labels(*lbl).observe(prompt)
        self.output_tokens.labels(*lbl).observe(completion)

    def observe_cost(self, model: ServedModel, tenant: str, usd: float) -> None:
        """A request of `tenant` ended costing `usd` (a series per tenant and model, even at 0)."""
        self.cost.labels(*self.labels(model), tenant).inc(usd)

    def labels(self, model: ServedModel) -> tuple[str, str, str, str]:
        return POOL, self.node, model.name, model.version

    def observe_latencies(self, model: ServedModel, ttft: float | None, itls: Sequence[float], tpot: float | None,
                          e2e: float, queue: float | None) -> None:
        lbl = self.labels(model)
        if ttft is not None:
            self.ttft.labels(*lbl).observe(ttft)
        if itls:
            child = self.itl.labels(*lbl)
            for v in itls:
                child.observe(v)
        if tpot is not None:
            self.tpot.labels(*lbl).observe(tpot)
        if queue is not None:
            self.queue.labels(*lbl).observe(queue)
        self.e2e.labels(*lbl).observe(e2e)

    def observe_ttft_breakdown(self, model: ServedModel, stages: dict[str, float]) -> None:
        lbl = self.labels(model)
        for stage, seconds in stages.items():
            self.ttft_breakdown.labels(*lbl, stage).observe(seconds)

    def observe_slo(self, model: ServedModel, name: str, met: bool) -> None:
        self.slo.labels(*self.labels(model), name, "true" if met else "false").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
