"""The web console's data: the cluster now, per-pool series of the last 15 minutes, the recent requests.

The pages (`frontend/static/`, served by `frontend.console_routes`) are static files; everything they show
comes from the JSON built here, behind the same API keys as the API:

- `cluster_view`: every registered node of the served pools with its role, address, state, health and
  last load report (queue, running, in flight, KV blocks), read from the registry view;
- `ConsoleHistory`: every `interval_s` a `PoolSample` per pool, computed from the same series `/metrics`
  exports (the TTFT and TPOT histograms' increase since the previous sample, interpolated the way
  Prometheus' `histogram_quantile` does; completion and goodput token counters; SLO counters) and from the
  nodes' load reports (KV use, queue). Kept in a ring of `history_s / interval_s` samples per pool;
- `RecentRequests`: the request log's records of the last `capacity` requests (refusals included), with the
  waterfall of each one's TTFT stages (`frontend.accounting.waterfall`).

Memory is bounded by construction: rings of fixed length, pools from the models file only.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import Counter, Histogram

from pdserve.registry.view import Member

if TYPE_CHECKING:
    from pdserve.frontend.pipeline import Frontend
    from pdserve.frontend.tenants import Tenant

HISTORY_S = 15 * 60.0
INTERVAL_S = 2.0
RECENT_REQUESTS = 1000
RECENT_BYTES = 16 << 20  # the recent requests' JSON, in all
# A node whose latest load report is older than this is shown unhealthy (reports come about once a
# second); one whose lease expired (5 s) has left the registry and is no longer listed.
STALE_LOAD_S = 3.0
QUANTILES = (0.5, 0.95)


@dataclass(frozen=True)
class PoolSample:
    """One pool over one sampling interval (None: nothing to measure in it)."""

    t: float  # unix seconds at the end of the interval
    ttft_p50: float | None
    ttft_p95: float | None
    tpot_p50: float | None
    tpot_p95: float | None
    tokens_per_s: float  # completion tokens the pool streamed through this frontend
    requests_per_s: float
    goodput: float | None  # fraction of completion tokens from requests meeting both SLOs
    slo_attainment: float | None  # fraction of finished requests meeting both SLOs
    kv_use_decode: float | None  # referenced KV blocks over all blocks, summed over the pool's nodes
    kv_use_prefill: float | None
    queue_decode: int
    queue_prefill: int
    running: int  # sequences in the decode nodes' batches
    nodes_decode: int
    nodes_prefill: int


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of observations in cumulative `buckets` [(upper bound, count <= bound)], ending with
    +Inf, interpolated linearly inside the bucket the rank falls in (Prometheus' `histogram_quantile`).
    None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # the top bucket has no upper bound: its lower one is the best answer
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def _by_pool(metric: Counter | Histogram, pools: dict[tuple[str, str], str], suffix: str,
             match: dict[str, str] | None = None) -> dict[str, dict[str, float]]:
    """pool -> {le or "": value} of a metric's samples named <name><suffix>, summed over the pool's
    models (`pools`: (model, version) -> pool); samples whose labels differ from `match` are skipped."""
    out: dict[str, dict[str, float]] = {}
    for family in metric.collect():
        for s in family.samples:
            if not s.name.endswith(suffix):
                continue
            pool = pools.get((s.labels.get("model", ""), s.labels.get("version", "")))
            if pool is None or (match and any(s.labels.get(k) != v for k, v in match.items())):
                continue
            key = s.labels.get("le", "")
            slot = out.setdefault(pool, {})
            slot[key] = slot.get(key, 0.0) + s.value
    return out


def _delta_buckets(now: dict[str, float], before: dict[str, float]) -> list[tuple[float, float]]:
    return sorted((float(le), v - before.get(le, 0.0)) for le, v in now.items())


@dataclass
class _Totals:
    """The cumulative values one sample is the difference of."""

    t: float
    ttft: dict[str, dict[str, float]]
    tpot: dict[str, dict[str, float]]
    tokens: dict[str, float]
    goodput: dict[str, float]
    requests: dict[str, float]
    slo_met: dict[str, float]
    slo_all: dict[str, float]


class ConsoleHistory:
    """Per-pool samples of the last `history_s` seconds (`sample` appends one per pool; `series` reads)."""

    def __init__(self, frontend: Frontend, interval_s: float = INTERVAL_S, history_s: float = HISTORY_S) -> None:
        self._fe = frontend
        self.interval_s = interval_s
        self.capacity = max(2, math.ceil(history_s / interval_s))
        self.pools = sorted({m.pool for m in frontend.catalog.all_versions})
        self._models = {(m.name, m.version): m.pool for m in frontend.catalog.all_versions}
        self.samples: dict[str, deque[PoolSample]] = {p: deque(maxlen=self.capacity) for p in self.pools}
        self._last: _Totals | None = None

    def _totals(self, now: float) -> _Totals:
        m, pools = self._fe.metrics, self._models

        def flat(metric: Counter | Histogram, suffix: str, **match: str) -> dict[str, float]:
            return {p: v[""] for p, v in _by_pool(metric, pools, suffix, match).items()}

        return _Totals(
            t=now, ttft=_by_pool(m.ttft, pools, "_bucket"), tpot=_by_pool(m.tpot, pools, "_bucket"),
            tokens=flat(m.tokens, "_total", kind="completion"), goodput=flat(m.goodput_tokens, "_total"),
            requests=flat(m.requests, "_total"), slo_met=flat(m.slo, "_total", slo="both", met="true"),
            slo_all=flat(m.slo, "_total", slo="both"))

    def sample(self, now: float | None = None) -> None:
        """Appends one sample per pool: the interval since the previous call (the first call only sets the
        baseline)."""
        now = time.time() if now is None else now
        totals = self._totals(now)
        last, self._last = self._last, totals
        if last is None:
            return
        dt = max(1e-9, totals.t - last.t)
        members = self._fe.view.members()
        for pool in self.pools:
            self.samples[pool].append(self._pool_sample(pool, totals, last, dt, [m for m in members
                                                                                  if m.record.model == pool]))

    def _pool_sample(self, pool: str, now: _Totals, last: _Totals, dt: float, members: list[Member]) -> PoolSample:
        def inc(cur: dict[str, float], prev: dict[str, float]) -> float:
            return max(0.0, cur.get(pool, 0.0) - prev.get(pool, 0.0))

        ttft = _delta_buckets(now.ttft.get(pool, {}), last.ttft.get(pool, {}))
        tpot = _delta_buckets(now.tpot.get(pool, {}), last.tpot.get(pool, {}))
        tokens, slo_all = inc(now.tokens, last.tokens), inc(now.slo_all, last.slo_all)
        decode = [m for m in members if m.role == "decode"]
        prefill = [m for m in members if m.role == "prefill"]
        return PoolSample(
            t=now.t, ttft_p50=bucket_quantile(0.5, ttft), ttft_p95=bucket_quantile(0.95, ttft),
            tpot_p50=bucket_quantile(0.5, tpot), tpot_p95=bucket_quantile(0.95, tpot),
            tokens_per_s=tokens / dt, requests_per_s=inc(now.requests, last.requests) / dt,
            goodput=inc(now.goodput, last.goodput) / tokens if tokens else None,
            slo_attainment=inc(now.slo_met, last.slo_met) / slo_all if slo_all else None,
            kv_use_decode=_kv_use(decode), kv_use_prefill=_kv_use(prefill),
            queue_decode=sum(m.load.queue_len for m in decode if m.load is not None),
            queue_prefill=sum(m.load.queue_len for m in prefill if m.load is not None),
            running=sum(m.load.running for m in decode if m.load is not None),
            nodes_decode=len(decode), nodes_prefill=len(prefill))

    def series(self, since: float = 0.0) -> dict[str, Any]:
        """Column arrays per pool of the samples after `since` (unix seconds)."""
        names = [f for f in PoolSample.__dataclass_fields__]
        out: dict[str, Any] = {}
        for pool, ring in self.samples.items():
            rows = [s for s in ring if s.t > since]
            out[pool] = {name: [getattr(s, name) for s in rows] for name in names}
        return {"interval_s": self.interval_s, "history_s": self.capacity * self.interval_s, "pools": out}

    async def run(self) -> None:
        """Samples every `interval_s` until cancelled."""
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)


def _kv_use(members: list[Member]) -> float | None:
    total = sum(m.load.kv_blocks_total or m.record.capacity.num_kv_blocks for m in members if m.load is not None)
    used = sum(m.load.kv_blocks_used for m in members if m.load is not None)
    return used / total if total else None


class RecentRequests:
    """The request log records of the last `capacity` requests, newest last, kept serialized (bytes the
    garbage collector never walks) and at most `max_bytes` in all (a prompt-logging frontend's records can
    be large): `add` appends, evicting the oldest."""

    def __init__(self, capacity: int = RECENT_REQUESTS, max_bytes: int = RECENT_BYTES) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self._records: deque[tuple[str | None, str | None, bytes]] = deque()  # (tenant, request_id, JSON)
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def add(self, record: dict[str, Any]) -> None:
        data = orjson.dumps(record)
        self._records.append((record.get("tenant"), record.get("request_id"), data))
        self.bytes += len(data)
        while len(self._records) > self.capacity or (self.bytes > self.max_bytes and len(self._records) > 1):
            self.bytes -= len(self._records.popleft()[2])

    def visible(self, tenant: Tenant) -> Iterator[tuple[str | None, bytes]]:
        """(request id, JSON) newest first: every record for an operator, else the tenant's own."""
        for owner, request_id, data in reversed(self._records):
            if tenant.operator or owner == tenant.name:
                yield request_id, data

    def find(self, tenant: Tenant, request_id: str) -> bytes | None:
        return next((data for rid, data in self.visible(tenant) if rid == request_id), None)


def node_view(member: Member, excluded: str | None, now: float) -> dict[str, Any]:
    """One node as the cluster page shows it."""
    rec, load = member.record, member.load
    age = None if load is None else max(0.0, now - load.updated_at)
    if excluded is not None:
        state = "excluded"
    elif load is None:
        state = "starting"
    else:
        state = "draining" if load.draining else "serving"
    healthy = age is not None and age <= STALE_LOAD_S and excluded is None
    out: dict[str, Any] = {
        "node_id": rec.node_id, "role": rec.role, "pool": rec.model, "address": rec.grpc_address,
        "kv_address": rec.kv_address, "hostname": rec.hostname, "pid": rec.pid, "version": rec.version,
        "started_at": rec.started_at, "colocated": rec.colocated, "dtype": rec.dtype,
        "state": state, "health": "healthy" if healthy else "unhealthy", "excluded_reason": excluded,
        "load_age_s": age, "kv_blocks_total": rec.capacity.num_kv_blocks, "max_num_seqs": rec.capacity.max_num_seqs,
    }
    if load is not None:
        out |= {k: v for k, v in asdict(load).items() if k not in ("updated_at",)}
        total = load.kv_blocks_total or rec.capacity.num_kv_blocks
        out["kv_use"] = load.kv_blocks_used / total if total else None
    return out


def cluster_view(frontend: Frontend) -> dict[str, Any]:
    """The frontend and every registered node of the served pools (and of other pools, apart)."""
    now = time.time()
    excluded = frontend.pool_members.excluded()
    served = {m.pool: m for m in frontend.catalog.all_versions}
    pools: dict[str, dict[str, Any]] = {}
    for m in frontend.catalog.all_versions:
        st = frontend.router.status(m.pool)
        entry = pools.setdefault(m.pool, {"pool": m.pool, "models": [], "ready": st.ready, "nodes": []})
        entry["models"].append({"name": m.name, "version": m.version or None})
    other: list[dict[str, Any]] = []
    for member in sorted(frontend.view.members(), key=lambda mm: (mm.record.model, mm.role, mm.node_id)):
        view = node_view(member, excluded.get(member.node_id), now)
        (pools[member.record.model]["nodes"] if member.record.model in served else other).append(view)
    return {"now": now, "frontend": {"id": frontend.config.frontend_id, "version": frontend.version,
                                     "in_flight": frontend.inflight, "registry_connected": frontend.view.connected,
                                     "stale_load_s": STALE_LOAD_S},
            "pools": list(pools.values()), "other_nodes": other}


class Console:
    """The console's state in a frontend: the history sampler and the recent requests (fed by every
    request log record)."""

    def __init__(self, frontend: Frontend, interval_s: float = INTERVAL_S, history_s: float = HISTORY_S,
                 recent: int = RECENT_REQUESTS) -> None:
        self.history = ConsoleHistory(frontend, interval_s, history_s)
        self.recent = RecentRequests(recent)
        frontend.accounting.record_sinks.append(self.recent.add)
        self.started_at = time.time()
