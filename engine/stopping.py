"""The one stop rule of the cluster (`stop_decision`) and the finish reasons (`FinishReason`; those a
sequence can end with in the scheduler: `FINISH_REASONS`). Pure values, no engine state."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.engine.sampling_params import SamplingParams


class FinishReason(enum.StrEnum):
    """How a request's generation ended; the values are the proto's FinishReason words (`rpc.enums`)."""

    STOP = "stop"  # EOS, a stop token or string, or a complete structured output
    LENGTH = "length"  # max_tokens, or the request outgrew the KV cache
    ABORT = "abort"  # aborted, or a token the grammar rejected
    ERROR = "error"  # the node failed the request (never the scheduler's)
    HAND_OVER = "hand_over"  # a draining decode node gave it to the caller to continue elsewhere


# What the scheduler finishes a sequence with; ERROR and HAND_OVER are outputs a node ends a stream with.
FINISH_REASONS = frozenset({FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT})


@dataclass(frozen=True)
class StopDecision:
    finish_reason: FinishReason  # STOP, LENGTH, or ABORT (a token the grammar rejected)
    stop_reason: int | None  # the stop token id that matched, if any


def stop_decision(
    params: SamplingParams, eos_token_ids: frozenset[int], last_token: int, num_completion_tokens: int,
    grammar_finish: str | None = None,
) -> StopDecision | None:
    """Whether a sequence's latest token ends it: EOS (unless ``ignore_eos``), a stop token id, the
    structured-output grammar (``grammar_finish``, `Sequence.grammar_finish`: "stop" once the output is
    complete, "abort" for a token it rejected), or ``max_tokens``. The one stop decision of the cluster:
    the scheduler applies it to every sampled token, the prefill node to the first token (to skip a
    transfer nobody will use). Stop strings are text, and are matched by the detokenizer where the text
    is made. Changes nothing."""
    if not params.ignore_eos and last_token in eos_token_ids:
        return StopDecision(FinishReason.STOP, None)
    if last_token in params.stop_token_ids:
        return StopDecision(FinishReason.STOP, last_token)
    if grammar_finish is not None:
        return StopDecision(FinishReason(grammar_finish), None)
    if num_completion_tokens >= params.max_tokens:
        return StopDecision(FinishReason.LENGTH, None)
    return None
