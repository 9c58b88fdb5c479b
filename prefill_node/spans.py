"""A Prefill call's trace spans (tracing on, `NodeContext.tracer`): the call's span is a child of the
decode node's KV wait span (its `traceparent` in the gRPC metadata); its queue, compute and KV send spans
are cut when the call ends, from the times FirstToken and TransferDone reported, so each lasts what the
TTFT breakdown says."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pdserve.prefill_node.call import PrefillCall
from pdserve.rpc.tracing import TTFT_STAGE

if TYPE_CHECKING:  # imported only with tracing on (it loads the OpenTelemetry SDK)
    from pdserve.rpc.tracing.tracer import Tracer


def start_call_span(tracer: Tracer, call: PrefillCall, metadata: Iterable[tuple[str, str | bytes]], node_id: str,
                    prompt_tokens: int) -> None:
    """Opens the call's span (`call.span`), starting at its arrival."""
    call.span = tracer.span(
        "prefill.request", parent=tracer.extract(metadata), start=call.arrived, kind="server",
        attributes={"rpc.system": "grpc", "rpc.method": "PrefillNode/Prefill", "pdserve.request_id": call.request_id,
                    "pdserve.attempt": call.attempt,
                    "pdserve.node": node_id, "pdserve.decode_node": call.decode_id,
                    "pdserve.prompt_tokens": prompt_tokens})


def finish_call_spans(tracer: Tracer, call: PrefillCall) -> None:
    """The call is over: its queue, compute and KV send spans, then the call's span."""
    if call.timing is not None:
        started = call.arrived + call.timing.queue_s
        tracer.span("prefill.queue", parent=call.span, start=call.arrived, end=started,
                    attributes={TTFT_STAGE: "prefill_queue"})
        tracer.span("prefill.compute", parent=call.span, start=started, end=started + call.timing.prefill_s,
                    attributes={TTFT_STAGE: "prefill"})
    result = call.send_result
    if result is not None and call.send_queued_at is not None:
        # The channel worker's own clock: it started `queued_seconds` after the send was queued.
        start = call.send_queued_at + result.queued_seconds
        send = tracer.span("prefill.kv_send", parent=call.span, start=start,
                           attributes={TTFT_STAGE: "transfer", "pdserve.bytes": result.bytes})
        tracer.finish(send, start + result.seconds, error=None if result.ok else result.error or "failed")
    tracer.finish(call.span, time.monotonic(), error=call.aborted)
