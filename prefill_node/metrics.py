"""The prefill pool's metrics (catalogue: deploy/prometheus/README.md) on top of `NodeMetrics`."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pdserve.kv_transfer import TransferResult
from pdserve.node_common.metrics import LATENCY_BUCKETS, SIZE_BUCKETS, MetricLabels, NodeMetrics, StepRecord

FAILURE_REASONS: tuple[str, ...] = ("timeout", "peer_gone", "refused", "error")


@dataclass(frozen=True)
class PrefillTiming:
    """Where one request's time on this node went, as the engine thread saw it."""

    queue_s: float  # arrival at the node to the start of its prefill
    prefill_s: float  # start of prefill to its first token


@dataclass(eq=False)
class _Progress:
    started: float | None = None
    finished: float | None = None


def failure_reason(error: str) -> str:
    """Buckets a transfer error message into the catalogue's `reason` values."""
    text = error.lower()
    if "timeout" in text or "timed out" in text:
        return "timeout"
    if "left the registry" in text or "shutting down" in text or "closed" in text or "released" in text:
        return "peer_gone"
    if "refus" in text or "reject" in text or "not queued" in text:
        return "refused"
    return "error"


class PrefillMetrics(NodeMetrics):
    def __init__(self, labels: MetricLabels) -> None:
        super().__init__(labels)
        self.queue = self.histogram("pdserve_prefill_queue_seconds",
                                    "Arrival at the node to the start of its prefill", LATENCY_BUCKETS)
        self.prefill_time = self.histogram("pdserve_prefill_time_seconds",
                                           "Start of prefill to the last prompt token computed", LATENCY_BUCKETS)
        self.batch_tokens = self.histogram("pdserve_prefill_batch_tokens", "Tokens computed per prefill engine step",
                                           SIZE_BUCKETS)
        self.tokens = self.counter("pdserve_prefill_tokens", "Prompt tokens computed (prefix-cache hits excluded)")
        self.transfer_time = self.histogram("pdserve_kv_transfer_seconds",
                                            "One request's KV transfer, send start to the receiver's acknowledgement",
                                            LATENCY_BUCKETS)
        self.transfer_bytes = self.counter("pdserve_kv_transfer_bytes", "KV bytes sent")
        self.layerwise_sends = self.counter(
            "pdserve_prefill_layerwise_sends", "KV sends queued layer by layer during their prefill's last step")
        self.layerwise_steps = self.counter(
            "pdserve_prefill_layerwise_steps", "Engine steps that queued at least one layer-wise KV send")
        failures = self.counter("pdserve_kv_transfer_failures", "KV transfers that did not complete", ["reason"])
        # Every reason exists from the start, so a failure-rate query reads 0 rather than nothing.
        self.transfer_failures = {r: failures.labels(**labels.values(), reason=r) for r in FAILURE_REASONS}
        self._progress: dict[str, _Progress] = {}
        self._progress_lock = threading.Lock()

    # -- engine thread ------------------------------------------------------------------------------

    def on_step(self, step: StepRecord) -> None:
        super().on_step(step)
        if step.stats.num_prefill_tokens:
            self.batch_tokens.observe(step.stats.num_prefill_tokens)
            self.tokens.inc(step.stats.num_prefill_tokens)
        with self._progress_lock:
            for seq in step.started_seqs:
                if seq.num_preemptions == 0:  # a recomputation after preemption is not a new start
                    self._progress.setdefault(seq.seq_id, _Progress()).started = step.started
            for out in step.outputs:
                if out.new_token_ids:
                    self._progress.setdefault(out.request_id, _Progress()).finished = step.ended

    def layerwise_queued(self, num_sends: int) -> None:
        """One engine step queued `num_sends` (> 0) layer-wise sends."""
        self.layerwise_steps.inc()
        self.layerwise_sends.inc(num_sends)

    # -- servicer -----------------------------------------------------------------------------------

    def first_token(self, request_id: str, arrived: float) -> PrefillTiming | None:
        """Called when a request's first token reached the servicer (arrival: when its Prefill call
        came in): observes the queue and prefill times and returns them; forgets the request."""
        with self._progress_lock:
            progress = self._progress.pop(request_id, None)
        if progress is None or progress.started is None or progress.finished is None:
            return None
        timing = PrefillTiming(max(0.0, progress.started - arrived), max(0.0, progress.finished - progress.started))
        self.queue.observe(timing.queue_s)
        self.prefill_time.observe(timing.prefill_s)
        return timing

    def forget(self, request_id: str) -> None:
        """Drops what is kept for a request that ended without its first token reaching us."""
        with self._progress_lock:
            self._progress.pop(request_id, None)

    def transfer_done(self, result: TransferResult | None, error: str | None = None) -> None:
        """Counts one send's outcome: its time and bytes, or a failure (`error` overrides the
        result's own, e.g. when the blocks were given back while it ran)."""
        if result is not None and result.ok and error is None:
            self.transfer_time.observe(result.seconds)
            self.transfer_bytes.inc(result.bytes)
            return
        message = error or (result.error if result is not None else None) or "error"
        self.transfer_failures[failure_reason(message)].inc()
