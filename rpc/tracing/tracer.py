"""The OpenTelemetry side of `tracing`: a `Tracer` per process, made by `start_tracing` only when an
endpoint is configured (this module, and with it the SDK, is imported only then).

Spans are created with explicit times: `span(start=t0, end=t1)` takes the process's own monotonic
timestamps (the ones its metrics use) and maps them to epoch nanoseconds by one offset read at start-up,
so a span's duration is exactly the difference of the two timestamps. Spans are batched and exported over
OTLP/HTTP (protobuf); `shutdown` exports what is still queued.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdserve.rpc.tracing.config import TRACEPARENT, TRACESTATE, TracingConfig

_KINDS = {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT}

Parent = Span | Context | None  # None: a new trace


class Tracer:
    """One process's spans: creation with explicit times, W3C propagation, export."""

    def __init__(self, config: TracingConfig, service_name: str, attributes: Mapping[str, str],
                 clock: Callable[[], float]) -> None:
        resource = Resource.create({"service.name": service_name, **attributes})
        self._provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
                                        resource=resource, shutdown_on_exit=False)
        # The schedule delay and queue sizes follow the OTEL_BSP_* environment variables.
        self._exporter = OTLPSpanExporter(endpoint=config.traces_url)
        self._provider.add_span_processor(BatchSpanProcessor(self._exporter))
        self._tracer = self._provider.get_tracer("pdserve")
        self._propagator = TraceContextTextMapPropagator()
        # `clock` is the process's monotonic clock (time.monotonic, in the nodes and the frontend); one
        # offset maps its readings to epoch nanoseconds.
        self._offset_ns = time.time_ns() - round(clock() * 1e9)

    def epoch_ns(self, t: float) -> int:
        """Epoch nanoseconds of a reading `t` of the process's clock."""
        return round(t * 1e9) + self._offset_ns

    # -- context ------------------------------------------------------------------------------------

    def extract(self, carrier: Mapping[str, str] | Iterable[tuple[str, str | bytes]]) -> Context | None:
        """The remote parent a `traceparent` (and `tracestate`) in HTTP headers or gRPC metadata names;
        None when there is none or it is malformed (the request then starts a new trace)."""
        if isinstance(carrier, Mapping):
            found = {k: carrier[k] for k in (TRACEPARENT, TRACESTATE) if k in carrier}
        else:
            found = {k: v if isinstance(v, str) else v.decode(errors="replace")
                     for k, v in carrier if k in (TRACEPARENT, TRACESTATE)}
        if TRACEPARENT not in found:
            return None
        ctx = self._propagator.extract(found)
        return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None

    def metadata(self, span: Span) -> list[tuple[str, str]]:
        """`traceparent` (and `tracestate`) naming `span` as the parent, for gRPC metadata or headers."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, trace.set_span_in_context(span))
        return list(carrier.items())

    @staticmethod
    def trace_id(span: Span) -> str:
        """The span's trace id as 32 lowercase hex digits."""
        return format(span.get_span_context().trace_id, "032x")

    # -- spans --------------------------------------------------------------------------------------

    def span(self, name: str, *, parent: Parent, start: float, end: float | None = None, kind: str = "internal",
             attributes: Mapping[str, str | int | float | bool] | None = None) -> Span:
        """A span from clock reading `start`, ended at `end` when given (else by `finish`)."""
        ctx = trace.set_span_in_context(parent) if isinstance(parent, Span) else (parent or Context())
        span = self._tracer.start_span(name, context=ctx, kind=_KINDS[kind], attributes=attributes,
                                       start_time=self.epoch_ns(start))
        if end is not None:
            span.end(end_time=self.epoch_ns(max(start, end)))
        return span

    def finish(self, span: Span, end: float, error: str | None = None,
               attributes: Mapping[str, str | int | float | bool] | None = None) -> None:
        """Ends `span` at clock reading `end`, marked failed with `error` when given."""
        if attributes:
            span.set_attributes(attributes)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self.epoch_ns(end))

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Exports the spans still queued, waiting at most about `timeout_s` for the receiver, then stops
        (call once, at process exit). An unreachable receiver does not hold the exit up: its export,
        retrying with backoff, is cut short."""
        # The SDK's flush waits out an export in progress whatever its timeout says: it runs aside.
        flush = threading.Thread(target=self._provider.force_flush, name="trace-flush", daemon=True)
        flush.start()
        flush.join(timeout_s)
        self._exporter.shutdown()  # interrupts an export still retrying
        self._provider.shutdown()

