"""The one stop rule of the cluster (`stop_decision`) and the finish reasons a sequence can end with
(`FINISH_REASONS`). Pure values, no engine state."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sampling_params import SamplingParams

FINISH_REASONS = frozenset({"stop", "length", "abort"})


@dataclass(frozen=True)
class StopDecision:
    finish_reason: str  # "stop", "length", or "abort" (a token the grammar rejected)
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
        return StopDecision("stop", None)
    if last_token in params.stop_token_ids:
        return StopDecision("stop", last_token)
    if grammar_finish is not None:
        return StopDecision(grammar_finish, None)
    if num_completion_tokens >= params.max_tokens:
        return StopDecision("length", None)
    return None
