"""Tracing configuration, one per process, and its command-line options (torch-free, no OpenTelemetry
import: a process without an endpoint never loads the SDK)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from pdserve.rpc.tracing.tracer import Tracer

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"  # the OpenTelemetry convention: base URL of an OTLP/HTTP receiver
TRACES_PATH = "/v1/traces"
TRACEPARENT = "traceparent"  # W3C trace context: the HTTP header and the gRPC metadata key
TRACESTATE = "tracestate"
# The attribute of a span that stands for a TTFT breakdown stage (its value: the stage, as the metric names it).
TTFT_STAGE = "pdserve.ttft_stage"


@dataclass(frozen=True)
class TracingConfig:
    """Where spans go: an OTLP/HTTP (protobuf) receiver, or nowhere ("" = tracing off)."""

    otlp_endpoint: str = ""  # base URL (".../v1/traces" is appended unless the URL already ends with it)
    sample_ratio: float = 1.0  # share of new traces recorded; a propagated parent's decision is followed

    def __post_init__(self) -> None:
        if self.otlp_endpoint:
            url = urlsplit(self.otlp_endpoint)
            if url.scheme not in ("http", "https") or not url.netloc:
                raise ValueError(f"--otlp-endpoint must be an http(s) URL, got {self.otlp_endpoint!r}")
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"--trace-sample-ratio must be in [0, 1], got {self.sample_ratio}")

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_endpoint)

    @property
    def traces_url(self) -> str:
        """The URL spans are POSTed to."""
        base = self.otlp_endpoint.rstrip("/")
        return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


def add_tracing_args(parser: argparse.ArgumentParser) -> None:
    """The command-line options of `TracingConfig`."""
    parser.add_argument("--otlp-endpoint", default=None, metavar="URL",
                        help=f"export traces to this OTLP/HTTP receiver (default: ${ENDPOINT_ENV}; unset: "
                             "tracing off)")
    parser.add_argument("--trace-sample-ratio", type=float, default=1.0,
                        help="share of new traces recorded (a caller's traceparent decides for its requests)")


def tracing_config_from_args(args: argparse.Namespace) -> TracingConfig:
    """`TracingConfig` from parsed `add_tracing_args` options; the flag wins over the environment
    (`--otlp-endpoint ''` turns tracing off whatever the environment says). Raises ValueError."""
    endpoint = args.otlp_endpoint if args.otlp_endpoint is not None else os.environ.get(ENDPOINT_ENV, "")
    return TracingConfig(otlp_endpoint=endpoint.strip(), sample_ratio=args.trace_sample_ratio)


def start_tracing(config: TracingConfig, service_name: str, attributes: Mapping[str, str],
                  clock: Callable[[], float]) -> Tracer | None:
    """The process's `Tracer` when `config` names an endpoint, else None; only then is OpenTelemetry
    imported. `clock` is the monotonic clock whose readings the process passes to `Tracer.span`."""
    if not config.enabled:
        return None
    from pdserve.rpc.tracing.tracer import Tracer

    return Tracer(config, service_name, attributes, clock)
