"""End-to-end request tracing with OpenTelemetry, off unless an OTLP endpoint is configured.

Every process (frontend, decode node, prefill node) has one `TracingConfig`; `start_tracing` returns a
`Tracer` only when it names an endpoint, and None otherwise, so a process without one imports no
OpenTelemetry code and pays one `is None` check per request. Context crosses processes as a W3C
`traceparent`: an HTTP header (from clients) and gRPC metadata (frontend -> decode -> prefill).

Spans are made with explicit start and end times taken from the monotonic timestamps the processes already
record for their metrics and the TTFT breakdown (`Tracer.span`, `Tracer.epoch_ns`), so a span and the
metric stage it stands for have the same duration. Torch-free; imports nothing of the project.
"""

from pdserve.rpc.tracing.config import (
    ENDPOINT_ENV,
    TRACEPARENT,
    TTFT_STAGE,
    TracingConfig,
    add_tracing_args,
    start_tracing,
    tracing_config_from_args,
)

__all__ = [
    "ENDPOINT_ENV",
    "TRACEPARENT",
    "TTFT_STAGE",
    "TracingConfig",
    "add_tracing_args",
    "start_tracing",
    "tracing_config_from_args",
]
