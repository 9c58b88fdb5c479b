"""The decode node's GenerateResponse messages: one per batch of a request's outputs, with who prefilled
it, its cached token counts and, on its first and last message, its timing."""

from __future__ import annotations

import time

from pdserve.decode_node.metrics import DecodeMetrics
from pdserve.decode_node.request import DecodeRequest
from pdserve.engine.llm_engine import RequestOutput
from pdserve.engine.stopping import FinishReason
from pdserve.node_common.convert import logprob_to_proto
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc.enums import finish_reason_value


def response(
    request: pb.GenerateRequest, req: DecodeRequest, batch: list[RequestOutput], completion: int, first: bool,
    node_id: str, metrics: DecodeMetrics,
) -> pb.GenerateResponse:
    """The message for `batch` (outputs of `req`, the last one possibly finished); `completion` counts
    the completion tokens so far (resumed ones included), `node_id` is this node's."""
    last = batch[-1]
    msg = pb.GenerateResponse(
        request_id=req.request_id, token_ids=[t for o in batch for t in o.new_token_ids],
        logprobs=[logprob_to_proto(lp) for o in batch for lp in o.new_logprobs],
        finished=last.finished, num_prompt_tokens=len(req.prompt), num_completion_tokens=completion,
        prefill_node_id=req.prefill_id or node_id, decode_node_id=node_id,
        serving_path=pb.SERVING_PATH_DISAGGREGATED if req.remote is not None else pb.SERVING_PATH_LOCAL_PREFILL,
    )
    if request.return_text:
        msg.text = "".join(o.new_text for o in batch)
    cached = max((o.num_cached_tokens for o in batch), default=0)
    if req.remote is not None:
        msg.num_cached_tokens_decode = req.reservation.num_cached_tokens if req.reservation else 0
        msg.num_cached_tokens_prefill = req.remote.cached_tokens
        cached = max(cached, msg.num_cached_tokens_decode, msg.num_cached_tokens_prefill)
    else:
        msg.num_cached_tokens_decode = cached
    msg.num_cached_tokens = cached
    if last.finished:
        msg.finish_reason = finish_reason_value(last.finish_reason)
        if last.stop_reason is not None:
            msg.stop_reason = str(last.stop_reason)
        if last.finish_reason == FinishReason.ERROR:
            msg.error = req.error or "internal error"
    if first or last.finished:  # the last message repeats it, complete (transfer time included)
        msg.timing.CopyFrom(_timing(req, metrics))
    return msg


def _timing(req: DecodeRequest, metrics: DecodeMetrics) -> pb.Timing:
    timing = pb.Timing()
    # Prefilled here (from the start, or after a remote prefill that gave no first token): arrival to
    # the first message, measured once and repeated on the last one. A request re-prefilled here after
    # a remote first token keeps reporting that remote prefill's times.
    if req.remote is None and (req.local_prefill_s or not req.timing.prefill_s):
        if not req.local_prefill_s:
            req.local_prefill_s = time.monotonic() - req.arrived
        timing.prefill_s = req.local_prefill_s
        return timing
    timing.CopyFrom(req.timing)
    first_step = metrics.first_step_seconds(req.key)
    if first_step is not None:
        timing.first_decode_step_s = first_step
    return timing
