"""The frontend's spans of one HTTP generation request (`RequestTrace`); exists only when tracing is on
(`rpc.tracing.start_tracing` gave a tracer), so an untraced request costs one `is None` check per hook.

Spans (times are the time.monotonic readings the job already keeps for its metrics):

    POST /v1/chat/completions          server, parent: the client's `traceparent` (else a new trace);
    │                                  arrival at the route to the end of the job (or the refusal)
    ├── frontend.dispatch              arrival to the Generate call of the first choice to produce a
    │   │                              token: the TTFT breakdown's `frontend` stage
    │   └── frontend.admission         arrival to the admitted job
    │       ├── frontend.parse         the body parsed
    │       ├── frontend.tokenize      model resolved, prompts tokenized
    │       ├── frontend.routing       every choice routed (decode and prefill node)
    │       └── frontend.limits        TTFT budget and tenant limits
    ├── frontend.upstream              client, one per Generate call (a retry or migration starts
    │                                  another); its `traceparent` goes to the decode node as gRPC metadata
    └── frontend.stream                first token at the frontend to the end of the response

Spans standing for a TTFT breakdown stage carry `pdserve.ttft_stage` = the stage's name.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pdserve.frontend.errors import APIError
from pdserve.frontend.job import Choice, Job, first_to_token
from pdserve.rpc.tracing import TTFT_STAGE as STAGE

if TYPE_CHECKING:
    from pdserve.rpc.tracing.tracer import Tracer

TRACE_ID_HEADER = "x-trace-id"


def start_request(tracer: Tracer, path: str, headers: Mapping[str, str], arrived: float) -> RequestTrace:
    """The trace of a request that reached `path` at `arrived`, child of the client's traceparent."""
    root = tracer.span(f"POST {path}", parent=tracer.extract(headers), start=arrived, kind="server",
                       attributes={"http.request.method": "POST", "url.path": path})
    return RequestTrace(tracer, root)


class RequestTrace:
    """One request's spans: the root (started at arrival), the Generate calls (started as they go out,
    so their context can travel with them) and, once the job ends, the stage spans."""

    def __init__(self, tracer: Tracer, root: Any) -> None:
        self._tracer, self._root = tracer, root
        self.trace_id = tracer.trace_id(root)
        self._calls: dict[int, Any] = {}  # choice index -> its current Generate call's span
        self._ended = False

    def tag(self, err: APIError) -> APIError:
        """Marks `err` as this request's: its message names the trace id and so does a header."""
        err.trace_id = self.trace_id
        err.headers[TRACE_ID_HEADER] = self.trace_id
        return err

    def call_started(self, job: Job, c: Choice, now: float) -> list[tuple[str, str]]:
        """A Generate call of choice `c` goes out at `now`: ends the span of its previous call (a retry
        or migration) and returns the gRPC metadata that makes the new call's span the decode node's
        parent."""
        previous = self._calls.get(c.index)
        if previous is not None:
            self._tracer.finish(previous, now, error="superseded by another Generate call (a retry, migration or fallback)")
        d = c.decision
        span = self._tracer.span("frontend.upstream", parent=self._root, start=now, kind="client", attributes={
            "rpc.system": "grpc", "rpc.method": "DecodeNode/Generate", "pdserve.request_id": c.request_id,
            "pdserve.choice": c.index, "pdserve.attempt": len(c.tried), "pdserve.migrations": c.migrations,
            "pdserve.decode_node": d.decode_id, "pdserve.prefill_node_hint": d.prefill_hint,
        })
        self._calls[c.index] = span
        return self._tracer.metadata(span)

    def reject(self, status: int, error: str) -> None:
        """The request was refused (or its client left) before a job existed: ends the root span."""
        self._end_root(status, error, time.monotonic(), {})

    def end(self, job: Job, now: float) -> None:
        """The job ended at `now`: the stage spans, the open Generate call spans and the root span."""
        t, s = self._tracer, job.stamps
        p = first_to_token(job)
        dispatched = p.dispatched_at if p is not None and p.dispatched_at is not None else s.admitted
        dispatch = t.span("frontend.dispatch", parent=self._root, start=job.arrived, end=dispatched,
                          attributes={STAGE: "frontend"} if p is not None else None)
        admission = t.span("frontend.admission", parent=dispatch, start=job.arrived, end=s.admitted,
                           attributes={"pdserve.model": job.model.name, "pdserve.tenant": job.tenant.name,
                                       "pdserve.prompt_tokens": sum(len(p) for p in job.prompts)})
        for name, start, end in (("frontend.parse", job.arrived, s.parsed), ("frontend.tokenize", s.parsed, s.tokenized),
                                 ("frontend.routing", s.routed_from, s.routed), ("frontend.limits", s.routed, s.admitted)):
            t.span(name, parent=admission, start=start, end=end)
        if p is not None and p.first_at is not None:
            t.span("frontend.stream", parent=self._root, start=p.first_at, end=now,
                   attributes={"pdserve.stream": job.req.stream,
                               "pdserve.completion_tokens": sum(c.progress.tokens for c in job.choices)})
        for c in job.choices:
            span = self._calls.pop(c.index, None)
            if span is not None:
                cp = c.progress
                t.finish(span, now, error=None if cp.finish_reason is not None else "ended without finishing",
                         attributes={"pdserve.finish_reason": cp.finish_reason or "", "pdserve.decode_node": cp.decoded_by,
                                     "pdserve.prefill_node": cp.prefilled_by, "pdserve.tokens": cp.tokens})
        if job.disconnected:
            status, error = 499, "the client went away"
        elif job.error is not None:
            status, error = job.error.status, job.error.message
        else:
            status, error = job.status, None
        self._end_root(status, error, now, {"pdserve.request_id": job.id, "pdserve.model": job.model.name})

    def _end_root(self, status: int, error: str | None, now: float, attributes: dict[str, Any]) -> None:
        if self._ended:
            return
        self._ended = True
        attributes["http.response.status_code"] = status
        self._tracer.finish(self._root, now, error=error, attributes=attributes)
