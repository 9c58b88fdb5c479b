"""The decode pool's metrics (catalogue: deploy/prometheus/README.md) on top of `NodeMetrics`."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from pdserve.decode_node.request import FailureReason
from pdserve.node_common.metrics import LATENCY_BUCKETS, SIZE_BUCKETS, MetricLabels, NodeMetrics, StepRecord

# Why a remote prefill failed before its first token (`PrefillLink._prefill_here`, a fallback): the
# prefill node was unavailable, refused, errored, gave no first token in time, or left the registry.
FALLBACK_REASONS = (FailureReason.UNAVAILABLE, FailureReason.REFUSED, FailureReason.ERROR, FailureReason.TIMEOUT,
                    FailureReason.LEASE_LOST)
# Why the K/V of a request that already streamed its first token did not land (a re-prefill): the
# prefill call failed (unavailable, error), the prefill node left the registry (lease_lost), it
# reported a failed send (send_failed), the receive failed or its channel closed (receive_failed) or ran
# past its deadline (timeout), or the bytes failed their checksum (checksum).
REPREFILL_REASONS = (FailureReason.UNAVAILABLE, FailureReason.ERROR, FailureReason.TIMEOUT, FailureReason.LEASE_LOST,
                     FailureReason.SEND_FAILED, FailureReason.RECEIVE_FAILED, FailureReason.CHECKSUM)


@dataclass
class _Timing:
    """Per-request times the step observer needs (one record per request, dropped by `forget`)."""

    landed_at: float | None = None  # when its transferred KV was handed to the engine, until its first step
    first_step_s: float | None = None  # landing to the end of its first decode step
    last_token_at: float | None = None  # end of the step that gave its latest token


class DecodeMetrics(NodeMetrics):
    def __init__(self, labels: MetricLabels) -> None:
        super().__init__(labels, speculative=True)
        self.first_step = self.histogram("pdserve_decode_first_step_seconds",
                                         "Admission (KV in place) to the end of the request's first decode step",
                                         LATENCY_BUCKETS)
        self.itl = self.histogram("pdserve_decode_itl_seconds", "Between consecutive decode steps of one sequence",
                                  LATENCY_BUCKETS)
        self.batch_size = self.histogram("pdserve_decode_batch_size", "Sequences per decode step", SIZE_BUCKETS)
        self.tokens = self.counter("pdserve_decode_tokens", "Tokens generated")
        self.fallbacks = self.counter("pdserve_decode_local_prefill_fallbacks",
                                      "Remote prefills that failed before the first token and were done here",
                                      ["reason"])
        for reason in FALLBACK_REASONS:  # every series exists from the start, at zero
            self.fallbacks.labels(**labels.values(), reason=reason.value)
        self.queue_local = self.counter("pdserve_decode_queue_local_prefills",
                                        "Requests prefilled here because the prefill node's queue was full "
                                        "(--max-prefill-queue-tokens)")
        self.reprefills = self.counter("pdserve_decode_reprefills",
                                       "Requests whose KV transfer failed after the first token, re-prefilled here "
                                       "(prompt + tokens so far)", ["reason"])
        for reason in REPREFILL_REASONS:
            self.reprefills.labels(**labels.values(), reason=reason.value)
        self.checksum_failures = self.counter("pdserve_decode_kv_checksum_failures",
                                              "KV transfers whose received bytes failed their checksum (never served)")
        self._lock = threading.Lock()
        self._timings: dict[str, _Timing] = {}

    # -- engine thread ------------------------------------------------------------------------------

    def on_step(self, step: StepRecord) -> None:
        super().on_step(step)
        if step.stats.num_decode_tokens:
            self.batch_size.observe(step.stats.num_decode_tokens)
        generated = 0
        with self._lock:
            for out in step.outputs:
                if out.new_token_ids:
                    generated += len(out.new_token_ids)
                    self._observe_token(self._timings.setdefault(out.request_id, _Timing()), step.ended)
                if out.finished:
                    timing = self._timings.get(out.request_id)
                    if timing is not None:  # the servicer reads first_step_s until it forgets the request
                        timing.landed_at = timing.last_token_at = None
        if generated:
            self.tokens.inc(generated)

    def _observe_token(self, timing: _Timing, ended: float) -> None:
        if timing.landed_at is not None:
            timing.first_step_s = ended - timing.landed_at
            timing.landed_at = None
            self.first_step.observe(timing.first_step_s)
        if timing.last_token_at is not None:
            self.itl.observe(ended - timing.last_token_at)
        timing.last_token_at = ended

    # -- servicer -----------------------------------------------------------------------------------

    def landed(self, request_id: str) -> float:
        """Marks a transferred request's KV as in place; called just before it is handed to the engine.
        Returns the time.monotonic() reading its first decode step is measured from."""
        now = time.monotonic()
        with self._lock:
            self._timings.setdefault(request_id, _Timing()).landed_at = now
        return now

    def local_prefill_fallback(self, reason: FailureReason) -> None:
        """Counts a remote prefill that failed before its first token and is done here instead."""
        self.fallbacks.labels(**self.labels.values(), reason=reason.value).inc()

    def queue_local_prefill(self) -> None:
        """Counts a request prefilled here because the prefill node's queue was full."""
        self.queue_local.inc()

    def reprefill(self, reason: FailureReason) -> None:
        """Counts a request re-prefilled here after its first token (its KV transfer failed)."""
        self.reprefills.labels(**self.labels.values(), reason=reason.value).inc()

    def kv_checksum_failure(self) -> None:
        """Counts a transfer whose bytes did not match the prefill node's checksum."""
        self.checksum_failures.inc()

    def first_step_seconds(self, request_id: str) -> float | None:
        """Landing to the end of the first decode step, once that step ran (None before)."""
        with self._lock:
            timing = self._timings.get(request_id)
            return timing.first_step_s if timing is not None else None

    def forget(self, request_id: str) -> None:
        """Drops what is kept for a request that is over (finished, aborted or failed)."""
        with self._lock:
            self._timings.pop(request_id, None)

    def tracked(self) -> frozenset[str]:
        """Requests with a timing record (for the node's integrity check)."""
        with self._lock:
            return frozenset(self._timings)
