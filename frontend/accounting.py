"""The end of a job, exactly once: cancel what still runs upstream, release the route leases and the
tenant's grant (refunding unused output budget), record the metrics, judge the SLOs and write the
request log line. Requests refused before they started are accounted by `reject`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.engine.version import pdserve_version
from pdserve.frontend.config import FrontendConfig
from pdserve.frontend.errors import APIError
from pdserve.frontend.job import ENDPOINTS, Choice, Job, cost, first_to_token, serving_path
from pdserve.frontend.metrics import POOL, FrontendMetrics
from pdserve.frontend.protocol import GenerationRequest, SamplingOptions
from pdserve.frontend.request_log import RequestLog


@dataclass(frozen=True)
class Latencies:
    """What a finished job measured (seconds; None where nothing was measured)."""

    status: int  # the HTTP status the request log records (499: the client went away)
    finish: str  # the finish label of the request counter
    ttft: float | None
    itls: list[float]
    tpot: float | None
    e2e: float
    queue: float | None  # node-reported queueing (prefill queue + reservation wait), the longest choice
    breakdown: dict[str, float]  # TTFT stages of the first choice to produce a token


class Accounting:
    """Releases what a job holds and records how it went (metrics and the request log)."""

    def __init__(self, config: FrontendConfig, metrics: FrontendMetrics, request_log: RequestLog) -> None:
        self._config, self._metrics, self._log = config, metrics, request_log
        self.observers: list[Callable[[Job, Latencies], None]] = []  # called with every ended job
        # Called with every request log record (ended jobs and refusals), whether or not a log is written.
        self.record_sinks: list[Callable[[dict[str, Any]], None]] = []

    def reject(self, kind: str, tenant: str | None, err: APIError, client_id: str | None) -> None:
        """Accounts a request refused before it started (metrics and a request log line)."""
        endpoint = ENDPOINTS[kind]
        base = (POOL, self._config.frontend_id, "", "")
        self._metrics.requests.labels(*base, endpoint, str(err.status), "rejected").inc()
        if tenant is not None:  # None: refused before a tenant was known (authentication)
            self._metrics.observe_tenant(base, tenant, None, err.status, err.code)
        self._write({"ts": time.time(), "request_id": None, "client_request_id": client_id,
                     "tenant": tenant, "endpoint": endpoint, "status": err.status,
                     "error": err.message, "error_code": err.code, "error_type": err.type,
                     "trace_id": err.trace_id, "cost_usd": 0.0})

    def _write(self, record: dict[str, Any]) -> None:
        self._log.write(record)
        for sink in self.record_sinks:
            sink(record)

    def end(self, job: Job) -> int:
        """Ends a job exactly once (later calls do nothing): cancels calls still running upstream,
        releases leases and the tenant's grant, records metrics and the request log line. Returns the
        completion tokens it accounted."""
        if job.ended:
            return 0
        job.ended = True
        for c in job.choices:
            if c.call is not None and c.progress.finish_reason is None:
                c.call.cancel()
            c.lease.release()
        completion = sum(c.progress.tokens for c in job.choices)
        usd = cost(job)
        job.grant.release(completion, usd)  # the same figure the cost metric and the request log get
        lat = _latencies(job, time.monotonic())
        self._observe(job, lat, completion)
        self._metrics.observe_cost(job.model, job.tenant.name, usd)
        for observe in self.observers:
            observe(job, lat)
        if not job.disconnected:
            self._judge_slo(job, lat, completion)
        self._write(_log_record(job, lat, completion, usd))
        return completion

    def _observe(self, job: Job, lat: Latencies, completion: int) -> None:
        m, name = self._metrics, job.model
        lbl = m.labels(name)
        if job.disconnected:
            m.disconnects.labels(*lbl).inc()
        m.requests.labels(*lbl, job.endpoint, str(lat.status), lat.finish).inc()
        for c in job.choices:
            if c.progress.first_at is not None:
                m.choices.labels(*lbl, serving_path(c)).inc()
        prompt = sum(len(p) for p in job.prompts)
        m.tokens.labels(*lbl, job.tenant.name, "prompt").inc(prompt)
        m.tokens.labels(*lbl, job.tenant.name, "completion").inc(completion)
        m.observe_request_tokens(name, prompt, completion)
        m.observe_tenant(lbl, job.tenant.name, lat.ttft, lat.status, None if job.error is None else job.error.code)
        m.observe_latencies(name, lat.ttft, lat.itls, lat.tpot, lat.e2e, lat.queue)
        if lat.breakdown:
            m.observe_ttft_breakdown(name, lat.breakdown)

    def _judge_slo(self, job: Job, lat: Latencies, completion: int) -> None:
        """Admitted and finished: a 5xx misses every target; otherwise the measured latencies decide."""
        m, name = self._metrics, job.model
        ok = lat.status < 500 and job.error is None
        ttft_ok = ok and lat.ttft is not None and lat.ttft <= self._config.ttft_slo_s
        tpot_ok = ok and (lat.tpot is None or lat.tpot <= self._config.tpot_slo_s)
        m.observe_slo(name, "ttft", ttft_ok)
        if lat.tpot is not None or not ok:
            m.observe_slo(name, "tpot", tpot_ok)
        m.observe_slo(name, "both", ttft_ok and tpot_ok)
        if ttft_ok and tpot_ok:
            m.goodput_tokens.labels(*m.labels(name)).inc(completion)


def _latencies(job: Job, now: float) -> Latencies:
    progress = [c.progress for c in job.choices]
    if job.disconnected:
        status, finish = 499, "client_disconnect"
    elif job.error is not None:
        status, finish = job.error.status, "error"
    else:
        status, finish = job.status, ",".join(sorted({p.finish_reason or "none" for p in progress}))
    first = first_to_token(job)
    tpots = [(p.last_at - p.first_at) / (p.tokens - 1) for p in progress
             if p.first_at is not None and p.last_at is not None and p.tokens > 1]
    timings = [p.timing for p in progress if p.timing is not None]
    return Latencies(
        status=status, finish=finish,
        ttft=None if first is None or first.first_at is None else first.first_at - job.arrived,
        itls=[v for p in progress for v in p.itls], tpot=sum(tpots) / len(tpots) if tpots else None,
        e2e=now - job.arrived,
        queue=max((t.prefill_queue_s + t.reservation_wait_s for t in timings), default=None),
        breakdown=_ttft_breakdown(job),
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def _log_record(job: Job, lat: Latencies, completion: int, usd: float) -> dict[str, Any]:
    itls = sorted(lat.itls)
    record: dict[str, Any] = {
        "ts": time.time(),
        "request_id": job.id,
        "client_request_id": job.client_request_id,
        "tenant": job.tenant.name,
        "key_sha256": job.key_hash,
        "endpoint": job.endpoint,
        "model": job.model.name,
        "model_version": job.model.version or None,
        "model_pool": job.model.pool,
        "requested_model": job.requested_model,
        "model_fingerprint": (job.choices[0].decision.fingerprint or None) if job.choices else None,
        "tokenizer_digest": job.model.tokenizer_digest,
        "chat_template_digest": job.model.chat_template_digest,
        "pdserve_version": pdserve_version(),
        "fallback": job.fallback_reason or None,
        "degraded": job.degraded or None,
        "status": lat.status,
        "finish_reasons": [c.progress.finish_reason for c in job.choices],
        "error": None if job.error is None else job.error.message,
        "error_code": None if job.error is None else job.error.code,
        "error_type": None if job.error is None else job.error.type,
        "stream": job.req.stream,
        "n": job.req.n,
        "sampling": _sampling_record(job.req),
        "prompt_tokens": sum(len(p) for p in job.prompts),
        "completion_tokens": completion,
        "cached_tokens": [c.progress.cached_tokens for c in job.choices],
        "batch": job.batch,
        "cost_usd": usd,
        "ttft_ms": _ms(lat.ttft),
        "ttft_breakdown_ms": {k: round(v * 1e3, 3) for k, v in lat.breakdown.items()} or None,
        "waterfall_ms": waterfall(job),
        "e2e_ms": _ms(lat.e2e),
        "tpot_ms": _ms(lat.tpot),
        "itl_p50_ms": _ms(itls[len(itls) // 2]) if itls else None,
        "itl_max_ms": _ms(itls[-1]) if itls else None,
        "session_key": job.session_key is not None,
        "routes": [_route_record(c) for c in job.choices],
        "trace_id": job.trace.trace_id if job.trace is not None else None,
    }
    if job.prompt_log is not None:
        record["prompt"] = job.prompt_log
    return record


_SAMPLING_DEFAULTS = SamplingOptions()
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "max_tokens")


def _sampling_record(req: GenerationRequest) -> dict[str, Any]:
    """The sampling parameters the request set (those differing from the defaults), never text: `stop`
    only says whether stop sequences were given, `max_tokens` is keyed by the field it came from
    (max_tokens, max_completion_tokens, max_output_tokens); `n` when above 1."""
    s = req.sampling
    out: dict[str, Any] = {}
    for name in _SAMPLING_FIELDS:
        value = getattr(s, name)
        if value != getattr(_SAMPLING_DEFAULTS, name):
            out[req.max_tokens_param if name == "max_tokens" else name] = value
    if req.n != 1:
        out["n"] = req.n
    if s.stop:
        out["stop"] = True
    return out


def _ttft_breakdown(job: Job) -> dict[str, float]:
    """Stages of the first choice to produce a token: the frontend's own part (arrival to dispatch) and
    the node-reported parts. Empty when no token came."""
    p = first_to_token(job)
    if p is None:
        return {}
    out = {"frontend": max(0.0, (p.dispatched_at or job.arrived) - job.arrived)}
    if p.timing is not None:
        t = p.timing
        out |= {"prefill_queue": t.prefill_queue_s, "prefill": t.prefill_s, "transfer": t.transfer_s,
                "reservation_wait": t.reservation_wait_s, "first_decode_step": t.first_decode_step_s}
    return out


def waterfall(job: Job) -> list[dict[str, Any]] | None:
    """The request's stages on one time line, in ms from its arrival: [{stage, start, ms, ttft}], `ttft`
    true for the stages before the first token, which tile [0, TTFT] exactly. Frontend stages come from
    the job's admission stamps (the trace's admission spans); node stages from the first choice's
    reported timing, laid end to end from its dispatch; `network` is what is left of TTFT (gRPC hops, the
    first token's way back). The KV transfer runs beside the prefill (layer by layer) from its start, the
    first decode step follows it, and decode runs from the first token to the last. None before any
    token."""
    p = first_to_token(job)
    if p is None or p.first_at is None:
        return None
    s, t0 = job.stamps, job.arrived
    ttft = p.first_at - t0
    out: list[dict[str, Any]] = []

    def add(stage: str, start: float, seconds: float, in_ttft: bool) -> None:
        out.append({"stage": stage, "start": round(start * 1e3, 3), "ms": round(max(0.0, seconds) * 1e3, 3),
                    "ttft": in_ttft})

    dispatched = p.dispatched_at if p.dispatched_at is not None else s.admitted
    edges = [("admission", t0, s.routed_from), ("routing", s.routed_from, s.routed), ("limits", s.routed, s.admitted),
             ("dispatch", s.admitted, dispatched)]
    for stage, a, b in edges:
        add(stage, a - t0, min(b, p.first_at) - a, True)
    at = dispatched - t0
    prefill_start = at
    if p.timing is not None:
        tm = p.timing
        for stage, seconds in (("reservation_wait", tm.reservation_wait_s), ("prefill_queue", tm.prefill_queue_s),
                               ("prefill", tm.prefill_s)):
            seconds = min(seconds, max(0.0, ttft - at))
            if stage == "prefill":
                prefill_start = at
            add(stage, at, seconds, True)
            at += seconds
    add("network", at, ttft - at, True)
    if p.timing is not None and p.timing.transfer_s:
        add("transfer", prefill_start, p.timing.transfer_s, False)
        landed = prefill_start + p.timing.transfer_s
        if p.timing.first_decode_step_s:
            add("first_decode_step", max(landed, ttft), p.timing.first_decode_step_s, False)
    if p.last_at is not None and p.last_at > p.first_at:
        add("decode", ttft, p.last_at - p.first_at, False)
    return out


def _route_record(c: Choice) -> dict[str, Any]:
    d, p = c.decision, c.progress
    out: dict[str, Any] = {
        "choice": c.index,
        "request_id": c.request_id,
        "decode_node": d.decode_id,
        "decode_reason": d.decode_reason,
        "prefill_node": d.prefill_hint or None,
        "prefill_reason": d.prefill_reason,
        "prefix_key": d.prefix_key or None,
        "tried": c.tried,
        "migrations": c.migrations,
        "served_by": {"prefill": p.prefilled_by or None, "decode": p.decoded_by or None},
        "path": serving_path(c) if p.first_at is not None else None,
        "tokens": p.tokens,
        "cached_tokens": p.cached_tokens,
        "cached_tokens_prefill": p.cached_prefill,
        "cached_tokens_decode": p.cached_decode,
    }
    if p.timing is not None:
        t = p.timing
        out["timing_ms"] = {
            "prefill_queue": round(t.prefill_queue_s * 1e3, 3),
            "prefill": round(t.prefill_s * 1e3, 3),
            "transfer": round(t.transfer_s * 1e3, 3),
            "first_decode_step": round(t.first_decode_step_s * 1e3, 3),
            "reservation_wait": round(t.reservation_wait_s * 1e3, 3),
        }
    return out
