"""The decode node's spans of one request (tracing on only: every call site checks `ctx.tracer`).

    decode.generate         server, parent: the caller's traceparent (gRPC metadata); arrival to the end
    │                       of the Generate stream
    ├── decode.reservation_wait    arrival to the reservation of its blocks (TTFT stage `reservation_wait`)
    ├── decode.kv_wait      client: the Prefill call until the transferred K/V landed (or failed); its
    │                       traceparent goes to the prefill node, whose spans are its children
    ├── decode.prefill      a request prefilled here: arrival to its first message (TTFT stage `prefill`)
    ├── decode.first_step   landing to the end of the first decode step (TTFT stage `first_decode_step`)
    └── decode.decode       landing (or arrival, prefilled here) to the end of the stream

Times are the ones the node reports in `pb.Timing` (arrival, `reservation_wait_s`, landing and
`first_decode_step_s` from `DecodeMetrics`), so each stage span lasts what the TTFT breakdown says.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import grpc

from pdserve.decode_node.request import DecodeRequest, RemotePrefill
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc.tracing import TTFT_STAGE

if TYPE_CHECKING:
    from pdserve.rpc.tracing.tracer import Tracer


def start_request(tracer: Tracer, context: grpc.aio.ServicerContext, request: pb.GenerateRequest,
                  node_id: str, arrived: float) -> Any:
    """The request's span from `arrived`, child of the caller's traceparent (else a new trace)."""
    return tracer.span("decode.generate", parent=tracer.extract(context.invocation_metadata() or ()), start=arrived,
                       kind="server", attributes={"rpc.system": "grpc", "rpc.method": "DecodeNode/Generate",
                                                  "pdserve.request_id": request.request_id, "pdserve.attempt": request.attempt,
                                                  "pdserve.node": node_id,
                                                  "pdserve.prompt_tokens": len(request.prompt_token_ids),
                                                  "pdserve.resumed_tokens": len(request.resume_token_ids)})


def refused(tracer: Tracer, span: Any, context: grpc.aio.ServicerContext, err: BaseException) -> None:
    """The request was not taken (the call aborted, or was cancelled, while it was being accepted)."""
    code, details = context.code(), context.details()
    tracer.finish(span, time.monotonic(), error=f"{getattr(code, 'name', code)}: {details}" if code else repr(err))


def start_kv_wait(tracer: Tracer, req: DecodeRequest, rem: RemotePrefill) -> list[tuple[str, str]]:
    """Starts the KV wait span (from the end of admission) and returns the Prefill call's metadata."""
    rem.span = tracer.span("decode.kv_wait", parent=req.span, start=req.arrived + req.timing.reservation_wait_s,
                           kind="client", attributes={"rpc.system": "grpc", "rpc.method": "PrefillNode/Prefill",
                                                      "pdserve.prefill_node": rem.prefill_node.node_id})
    return tracer.metadata(rem.span)


def end_kv_wait(tracer: Tracer, req: DecodeRequest, rem: RemotePrefill, end: float, landed: bool) -> None:
    """Ends the KV wait span (once; later calls do nothing): at landing, or failed with the reason."""
    if rem.span is None:
        return
    span, rem.span = rem.span, None
    failure = rem.failure
    error = None
    if not landed:
        error = failure.error if failure else ("cancelled" if req.cancelled else "the K/V did not land")
    tracer.finish(span, end, error=error, attributes={
        "pdserve.failure": failure.reason.value if failure else "",
        "pdserve.skipped": rem.sent is not None and rem.sent.skipped,
        "pdserve.cached_tokens_prefill": rem.cached_tokens})


def end_request(tracer: Tracer, req: DecodeRequest, timing: pb.Timing | None, last: pb.GenerateResponse | None) -> None:
    """The Generate stream ended: the stage spans from the timing it reported, then the request's span."""
    now = time.monotonic()
    span = req.span
    if timing is not None and timing.reservation_wait_s:
        tracer.span("decode.reservation_wait", parent=span, start=req.arrived, end=req.arrived + timing.reservation_wait_s,
                    attributes={TTFT_STAGE: "reservation_wait"})
    if req.landed_at is not None:
        if timing is not None and timing.first_decode_step_s:
            tracer.span("decode.first_step", parent=span, start=req.landed_at,
                        end=req.landed_at + timing.first_decode_step_s, attributes={TTFT_STAGE: "first_decode_step"})
        tracer.span("decode.decode", parent=span, start=req.landed_at, end=now)
    elif timing is not None and timing.prefill_s and not timing.reservation_wait_s:
        tracer.span("decode.prefill", parent=span, start=req.arrived, end=req.arrived + timing.prefill_s,
                    attributes={TTFT_STAGE: "prefill"})
        tracer.span("decode.decode", parent=span, start=req.arrived + timing.prefill_s, end=now)
    finish = last.finish_reason if last is not None and last.finished else ""
    error = None
    if req.cancelled or not finish:
        error = "cancelled by the caller"
    elif finish == "error":
        error = req.error or "error"
    tracer.finish(span, now, error=error, attributes={
        "pdserve.finish_reason": finish, "pdserve.prefill_node": req.prefill_id,
        "pdserve.completion_tokens": last.num_completion_tokens if last is not None else 0})
