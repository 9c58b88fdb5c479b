"""The decode pool's metrics (catalogue: deploy/prometheus/README.md) on top of `NodeMetrics`."""

from __future__ import annotations

import threading
import time

from node.metrics import LATENCY_BUCKETS, SIZE_BUCKETS, MetricLabels, NodeMetrics, StepRecord


class DecodeMetrics(NodeMetrics):
    def __init__(self, labels: MetricLabels) -> None:
        super().__init__(labels)
        self.first_step = self.histogram("pdserve_decode_first_step_seconds",
                                         "Admission (KV in place) to the end of the request's first decode step",
                                         LATENCY_BUCKETS)
        self.itl = self.histogram("pdserve_decode_itl_seconds", "Between consecutive decode steps of one sequence",
                                  LATENCY_BUCKETS)
        self.batch_size = self.histogram("pdserve_decode_batch_size", "Sequences per decode step", SIZE_BUCKETS)
        self.tokens = self.counter("pdserve_decode_tokens", "Tokens generated")
        self._lock = threading.Lock()
        self._admitted: dict[str, float] = {}  # request -> when its transferred KV was handed to the engine
        self._first_step: dict[str, float] = {}  # request -> seconds from admission to its first step's end
        self._last_token: dict[str, float] = {}  # request -> end of the step that gave its latest token

    # -- engine thread ------------------------------------------------------------------------------

    def on_step(self, step: StepRecord) -> None:
        super().on_step(step)
        if step.stats.num_decode_tokens:
            self.batch_size.observe(step.stats.num_decode_tokens)
        generated = 0
        with self._lock:
            for out in step.outputs:
                rid = out.request_id
                if out.new_token_ids:
                    generated += len(out.new_token_ids)
                    admitted = self._admitted.pop(rid, None)
                    if admitted is not None:
                        seconds = step.ended - admitted
                        self._first_step[rid] = seconds
                        self.first_step.observe(seconds)
                    previous = self._last_token.get(rid)
                    if previous is not None:
                        self.itl.observe(step.ended - previous)
                    self._last_token[rid] = step.ended
                if out.finished:
                    self._last_token.pop(rid, None)
                    self._admitted.pop(rid, None)
        if generated:
            self.tokens.inc(generated)

    # -- servicer -----------------------------------------------------------------------------------

    def admitted(self, request_id: str) -> None:
        """Marks a transferred request's KV as in place; called just before it is handed to the engine."""
        with self._lock:
            self._admitted[request_id] = time.monotonic()

    def first_step_seconds(self, request_id: str) -> float | None:
        """Admission to the end of the first decode step, once that step ran (None before)."""
        with self._lock:
            return self._first_step.get(request_id)

    def forget(self, request_id: str) -> None:
        """Drops what is kept for a request that is over (finished, aborted or failed)."""
        with self._lock:
            self._admitted.pop(request_id, None)
            self._first_step.pop(request_id, None)
            self._last_token.pop(request_id, None)
