"""Prometheus metrics that every node process serves on /metrics, whichever its pool.

Names, labels and buckets follow the metric catalogue in deploy/prometheus/README.md. Each node process
owns one `CollectorRegistry`; nothing goes into prometheus_client's process-global registry, so two
nodes in one test process never share series.

Where the numbers come from:
- step metrics (batch sizes, preemptions, per-sequence token times) are observed on the engine thread:
  `ObservedEngine` is an `LLMEngine` that hands every step's record to a `StepObserver`;
- gauges (KV blocks by state, running, waiting) and the prefix-cache counters are read at scrape time
  from snapshots (`AsyncEngine.load()` and the cache counters the last step copied), never from the
  engine itself, which belongs to its thread;
- request metrics (queue, prefill and transfer times) are observed by the node's servicer.

The role-specific metrics live in `prefill_node.metrics` and `decode_node.metrics`.
"""

from __future__ import annotations

import platform
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.engine.block_manager import PrefixCacheStats
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_tier import KVTier
from pdserve.engine.llm_engine import LLMEngine, RequestOutput, StepStats
from pdserve.engine.sequence import Sequence as EngineSequence
from pdserve.engine.speculative import SpeculativeStats
from pdserve.engine.version import pdserve_version
from pdserve.kv_transfer.auth import FailureReason
from pdserve.node_common.faults import NodeFaults
from pdserve.registry import NodeLoad

# One bucket list for every latency histogram: from 1 ms, with bounds at the usual SLO thresholds.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0,
)
SIZE_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(15))  # 1 .. 16384
LABEL_NAMES: tuple[str, ...] = ("pool", "node", "model")


@dataclass(frozen=True)
class MetricLabels:
    """The labels every node series carries."""

    pool: str  # "prefill" | "decode"
    node: str
    model: str

    def values(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class StepRecord:
    """One engine step as an observer sees it (built on the engine thread)."""

    started: float  # time.monotonic() before scheduling
    ended: float  # after sampling
    stats: StepStats
    outputs: list[RequestOutput]
    # Sequences that left the waiting queue in this step: their first computation (or, for a
    # transferred sequence, their first decode) ran in it.
    started_seqs: list[EngineSequence]
    cache: PrefixCacheStats  # cumulative prefix-cache counters after the step
    spec: SpeculativeStats  # cumulative speculative-decoding counters after the step (a copy)


class StepObserver(Protocol):
    def on_step(self, step: StepRecord) -> None:
        """Called on the engine thread after every step that ran; must be quick and must not call
        into the engine."""


class ObservedEngine(LLMEngine):
    """An `LLMEngine` that reports every step to an observer (and runs the node's fault hook before it,
    `node_common.faults`); otherwise unchanged."""

    def __init__(self, cfg: EngineConfig, observer: StepObserver, faults: NodeFaults) -> None:
        super().__init__(cfg)
        self._observer = observer
        self._faults = faults

    def step(self) -> list[RequestOutput]:
        self._faults.before_step()
        waiting = self.scheduler.waiting_seqs
        started = time.monotonic()
        outputs = super().step()
        still_waiting = {id(s) for s in self.scheduler.waiting_seqs}
        self._observer.on_step(StepRecord(
            started=started, ended=time.monotonic(), stats=self.last_step, outputs=outputs,
            started_seqs=[s for s in waiting if id(s) not in still_waiting],
            cache=self.block_manager.stats(), spec=replace(self.spec_stats),
        ))
        return outputs


class _EngineCollector(Collector):
    """Yields the gauges and prefix-cache counters from the latest snapshots at each scrape."""

    def __init__(self, labels: MetricLabels, snapshot: Callable[[], NodeLoad | None],
                 cache: Callable[[], PrefixCacheStats], spec: Callable[[], SpeculativeStats] | None) -> None:
        self._labels = labels
        self._snapshot = snapshot
        self._cache = cache
        self._spec = spec

    def collect(self) -> Iterator[Metric]:
        names, values = list(LABEL_NAMES), list(self._labels.values().values())
        cache = self._cache()
        queries = CounterMetricFamily("pdserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels=names)
        queries.add_metric(values, cache.query_tokens)
        hits = CounterMetricFamily("pdserve_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   labels=names)
        hits.add_metric(values, cache.hit_tokens)
        yield queries
        yield hits
        if self._spec is not None:
            yield from self._speculative(names, values)
        load = self._snapshot()
        if load is None:
            return  # still loading: no engine yet
        # `used` counts held and reserved blocks too; the states must partition the pool, so those
        # are moved to `held` (clamped: a held prefix shared with a running sequence counts once).
        held = min(load.kv_blocks_held + load.kv_blocks_reserved, load.kv_blocks_used)
        cached = min(load.kv_blocks_cached, load.kv_blocks_free)
        blocks = GaugeMetricFamily("pdserve_kv_blocks", "KV blocks by state (the states partition the KV cache)",
                                   labels=[*names, "state"])
        for state, n in (("used", load.kv_blocks_used - held), ("held", held), ("cached", cached),
                         ("free", load.kv_blocks_free - cached)):
            blocks.add_metric([*values, state], n)
        yield blocks
        usage = GaugeMetricFamily("pdserve_kv_usage_ratio", "(used + held) KV blocks / all blocks", labels=names)
        usage.add_metric(values, load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0.0)
        yield usage
        running = GaugeMetricFamily("pdserve_requests_running", "Sequences in the running batch", labels=names)
        running.add_metric(values, load.running)
        yield running
        waiting = GaugeMetricFamily("pdserve_requests_waiting",
                                    "Sequences queued (decode: including those waiting for admission)", labels=names)
        waiting.add_metric(values, load.queue_len)
        yield waiting

    def _speculative(self, names: list[str], values: list[str]) -> Iterator[Metric]:
        """Speculative decoding's counters (`engine.speculative.SpeculativeStats`); the acceptance rate is
        rate(accepted) / rate(drafted), tokens per step rate(decode_tokens) / rate(decode_steps)."""
        assert self._spec is not None
        spec = self._spec()
        for name, doc, value in (
            ("pdserve_spec_draft_tokens", "Draft tokens verified (speculative decoding)", spec.drafted_tokens),
            ("pdserve_spec_accepted_tokens", "Draft tokens accepted by verification", spec.accepted_tokens),
            ("pdserve_spec_emitted_tokens", "Tokens produced by decode steps that carried a draft (accepted + 1 each)",
             spec.emitted_tokens),
            ("pdserve_spec_draft_steps", "Sequence decode steps that carried a draft", spec.draft_steps),
            ("pdserve_decode_seq_steps", "Sequence decode steps, with or without a draft", spec.decode_steps),
            ("pdserve_decode_seq_tokens", "Tokens those sequence decode steps produced", spec.decode_tokens),
        ):
            yield _family(CounterMetricFamily, name, doc, names, values, value)


def _family(kind: type[Metric], name: str, doc: str, names: list[str], values: list[str], value: float) -> Metric:
    """One series of a counter or gauge family with the node's labels."""
    family = kind(name, doc, labels=names)
    family.add_metric(values, value)
    return family


class _TierCollector(Collector):
    """The KV tier's series (`engine.kv_tier.KVTier`), on nodes that have one."""

    def __init__(self, labels: MetricLabels, tier: KVTier, cache: Callable[[], PrefixCacheStats]) -> None:
        self._labels, self._tier, self._cache = labels, tier, cache

    def collect(self) -> Iterator[Metric]:
        names, values = list(LABEL_NAMES), list(self._labels.values().values())
        t, st = self._tier, self._tier.stats
        for name, doc, value in (
            ("pdserve_kv_tier_hits", "Prompt tokens read back from the KV tier instead of computed",
             self._cache().tier_hit_tokens),
            ("pdserve_kv_tier_stored_blocks", "Committed blocks copied to the KV tier", st.stored),
            ("pdserve_kv_tier_written_blocks", "KV tier blocks written to disk", st.written),
            ("pdserve_kv_tier_loaded_blocks", "KV tier blocks read back into the pool", st.loaded),
            ("pdserve_kv_tier_corrupt_blocks", "KV tier files refused (bad bytes, truncated, another model's)",
             st.corrupt),
            ("pdserve_kv_tier_missing_blocks", "KV tier files gone when a load wanted them", st.missing),
            ("pdserve_kv_tier_write_errors", "KV tier writes that failed (full disk, I/O error)", st.write_errors),
            ("pdserve_kv_tier_evicted_blocks", "KV tier blocks dropped to stay within its byte bound", st.evicted),
            ("pdserve_kv_tier_recovered_blocks", "KV tier blocks found on disk at startup", st.recovered),
        ):
            yield _family(CounterMetricFamily, name, doc, names, values, value)
        for name, doc, value in (
            ("pdserve_kv_tier_bytes", "Bytes the KV tier holds", t.bytes),
            ("pdserve_kv_tier_capacity_bytes", "The KV tier's byte bound", t.max_bytes),
            ("pdserve_kv_tier_blocks", "Blocks the KV tier holds", t.num_blocks),
            ("pdserve_kv_tier_writes_paused", "1 while the KV tier writes nothing (its disk was full)",
             float(time.monotonic() < t.disabled_until)),
        ):
            yield _family(GaugeMetricFamily, name, doc, names, values, value)


class MetricsServer:
    """The process's /metrics HTTP endpoint (a daemon thread)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        server, thread = start_http_server(port, addr=host, registry=registry)
        self._server: WSGIServer = server
        self._thread = thread
        self.host = host
        self.port = int(server.server_port)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        """Stops serving and closes the listening socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class NodeMetrics:
    """The series both node pools export. Subclasses add their pool's metrics and extend `on_step`."""

    def __init__(self, labels: MetricLabels, speculative: bool = False) -> None:
        """``speculative``: export speculative decoding's counters (the decode pool, which drafts)."""
        self.labels = labels
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()  # guards what the engine thread and the event loop both touch
        self._cache = PrefixCacheStats()
        self._spec = SpeculativeStats()
        self._gauges: Callable[[], NodeLoad] | None = None
        self._preemptions = self.counter("pdserve_preemptions", "Sequences preempted for KV space")
        self._embed_requests = self.counter("pdserve_embedding_requests", "Embed calls served")
        self._embed_inputs = self.counter("pdserve_embedding_inputs", "Inputs embedded")
        self._embed_tokens = self.counter("pdserve_embedding_tokens", "Input tokens embedded (never in the KV cache)")
        self._kv_auth_failures = self.counter("pdserve_kv_channel_auth_failures",
                                              "Connections to the KV port refused before any rendezvous, by reason",
                                              extra=("reason",))
        for reason in FailureReason:  # every reason's series exists from the start, at 0
            self._kv_auth_failures.labels(**labels.values(), reason=reason.value)
        self.registry.register(_EngineCollector(labels, self._gauge_snapshot, self._cache_snapshot,
                                                self._spec_snapshot if speculative else None))

    # -- series builders: every series gets the pool/node/model labels ------------------------------

    def counter(self, name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
        metric = Counter(name, doc, [*LABEL_NAMES, *extra], registry=self.registry)
        return metric if extra else metric.labels(**self.labels.values())

    def histogram(self, name: str, doc: str, buckets: Sequence[float], extra: Sequence[str] = ()) -> Histogram:
        metric = Histogram(name, doc, [*LABEL_NAMES, *extra], buckets=buckets, registry=self.registry)
        return metric if extra else metric.labels(**self.labels.values())

    # -- engine side --------------------------------------------------------------------------------

    def bind(self, gauges: Callable[[], NodeLoad]) -> None:
        """Sets where scrapes read the load gauges from (once the engine exists)."""
        self._gauges = gauges

    def bind_tier(self, tier: KVTier) -> None:
        """Exports the KV tier's series (a node started with --kv-tier-dir)."""
        self.registry.register(_TierCollector(self.labels, tier, self._cache_snapshot))

    def on_step(self, step: StepRecord) -> None:
        """Engine thread: counts preemptions and keeps the prefix-cache counters for scrapes."""
        if step.stats.num_preempted:
            self._preemptions.inc(step.stats.num_preempted)
        with self._lock:
            self._cache = step.cache
            self._spec = step.spec

    def embedded(self, inputs: int, tokens: int) -> None:
        """One Embed call served (event loop)."""
        self._embed_requests.inc()
        self._embed_inputs.inc(inputs)
        self._embed_tokens.inc(tokens)

    def kv_auth_failed(self, reason: FailureReason, peer: str) -> None:
        """The KV port refused `peer` (a gate thread; `kv_transfer.auth`)."""
        self._kv_auth_failures.labels(**self.labels.values(), reason=reason.value).inc()

    def set_info(self, fingerprint: str, dtype: str, block_size: int, weights: str = "", kernels: str = "",
                 tp: int = 1) -> None:
        """The info series (always 1; once the engine exists): the pdserve version, and which model,
        dtype, block size, weight format (e.g. "Q4_1+Q8_0" or "float32"), quantized-kernel instruction
        set ("" for float weights) and tensor-parallel width (`tp`: ranks) this node serves."""
        build = Gauge("pdserve_build_info", "Always 1; the labels name the pdserve version",
                      [*LABEL_NAMES, "version", "python"], registry=self.registry)
        build.labels(**self.labels.values(), version=pdserve_version(), python=platform.python_version()).set(1)
        model = Gauge("pdserve_model_info", "Always 1; the labels name the served model's fingerprint",
                      [*LABEL_NAMES, "fingerprint", "dtype", "block_size", "weights", "quant_kernels", "tp"],
                      registry=self.registry)
        model.labels(**self.labels.values(), fingerprint=fingerprint[:16], dtype=dtype, block_size=str(block_size),
                     weights=weights or dtype, quant_kernels=kernels, tp=str(tp)).set(1)

    def _gauge_snapshot(self) -> NodeLoad | None:
        return self._gauges() if self._gauges is not None else None

    def _cache_snapshot(self) -> PrefixCacheStats:
        with self._lock:
            return self._cache

    def _spec_snapshot(self) -> SpeculativeStats:
        with self._lock:
            return self._spec

    def serve(self, host: str, port: int) -> MetricsServer:
        """Starts the /metrics endpoint on host:port (0: a free port)."""
        return MetricsServer(self.registry, host, port)
