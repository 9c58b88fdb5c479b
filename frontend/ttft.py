"""The one place time to first token is predicted, for early rejection of requests whose TTFT budget
cannot be met given the queue (per tenant `ttft_budget_ms`, per request `x-pdserve-ttft-budget-ms`).

Model: the first token of a new prompt comes once the prefill work queued ahead of it on its node, and its
own, is done. The work ahead is the larger of the prompt tokens this frontend routed to that node whose
first token has not come (`Router.backlog`: exact for this frontend) and the node's reported queue times
the pool's mean prompt (the node's load record: every frontend, about a second old). The rate is learned
end to end per pool: every route whose first token came contributes (work ahead when it was routed) /
(time from routing to its first token), an exponentially weighted mean, so batching, chunked prefill, transfer and
the frontend's own time are all priced in as they are now.

A request is refused only when there is work ahead and the estimate exceeds its budget: a node with
nothing queued always gets the request (the estimate could be stale, and the request refreshes it).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.frontend.routing import Backlog, RouteLease

_ALPHA = 0.2  # weight of the newest sample in the moving means


@dataclass(frozen=True)
class TTFTEstimate:
    seconds: float
    work_tokens: int  # prefill tokens ahead of the request, its own included
    tokens_per_s: float


@dataclass(eq=False)
class _PoolRate:
    tokens_per_s: float
    mean_prompt: float


class TTFTEstimator:
    """Learns each pool's end-to-end prefill rate from finished requests (`observe`, changes the pool's
    means) and predicts TTFT from a backlog (`estimate`, reads only)."""

    def __init__(self) -> None:
        self._pools: dict[str, _PoolRate] = {}

    def observe(self, pool: str, work_tokens: int, prompt_tokens: int, ttft_s: float) -> None:
        """One choice's first token came `ttft_s` after arrival, with `work_tokens` of prefill queued
        ahead when it was routed (its own prompt included)."""
        if work_tokens <= 0 or ttft_s <= 0:
            return
        rate = work_tokens / ttft_s
        st = self._pools.get(pool)
        if st is None:
            self._pools[pool] = _PoolRate(rate, float(prompt_tokens))
            return
        st.tokens_per_s += _ALPHA * (rate - st.tokens_per_s)
        st.mean_prompt += _ALPHA * (prompt_tokens - st.mean_prompt)

    def observe_lease(self, lease: RouteLease, seconds: float) -> None:
        """`Router.on_first_token`: a route's first token came `seconds` after it was leased."""
        self.observe(lease.decision.pool, lease.work_ahead, lease.decision.prompt_tokens, seconds)

    def estimate(self, pool: str, backlog: Backlog, prompt_tokens: int) -> TTFTEstimate | None:
        """The predicted TTFT of a `prompt_tokens` prompt behind `backlog`; None before the pool has a
        sample or when nothing is queued ahead (then there is nothing to judge by)."""
        st = self._pools.get(pool)
        ahead = max(backlog.ours_tokens, round(backlog.reported_queue * (st.mean_prompt if st else 0.0)))
        if st is None or ahead <= 0:
            return None
        work = ahead + prompt_tokens
        return TTFTEstimate(work / st.tokens_per_s, work, st.tokens_per_s)

    def rate(self, pool: str) -> float | None:
        """The pool's learned rate (tokens/s), None before its first sample."""
        st = self._pools.get(pool)
        return None if st is None else st.tokens_per_s
