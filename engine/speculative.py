"""Speculative decoding without a second model: drafts proposed from a request's own tokens and verified
in the batched decode step.

    proposer ──draft──> Scheduler (budget, blocks) ──k+1 decode rows──> model ──logits──> Sampler.verify
        ^                                                                                      │
        └──────────── DraftState.record (k adapted, switched off) <── Scheduler.update <───────┘

A decoding sequence with a draft of k tokens is computed as k + 1 decode rows: its last token and the
drafts, row j attending over the context plus drafts [0, j) (rows of one step store their K/V before any
row attends, so this needs no kernel of its own). ``Sampler.verify`` samples each position exactly as an
ordinary step would, the drafts before it taken as given, and accepts a draft while the sampled token
equals it; the first mismatch (or the position after the last draft) yields one more token. For a
point-mass draft d this is the standard acceptance rule: the sampler's exponential race returns d with
the target's probability p(d), and otherwise a token distributed as p with d removed and renormalised.
It draws the same random numbers per emitted token as an ordinary step, so greedy and seeded output are
token-identical with speculation on and off. Rejected drafts' K/V sit in slots past the sequence's
tokens; the next steps overwrite them and blocks left empty are freed (``BlockManager.trim``).

Proposers (one per request, built lazily, fed the request's tokens as they grow):
- ``ngram``: prompt lookup. The last n tokens (n from ``max_ngram`` down to ``min_ngram``) are looked up
  among the earlier tokens (prompt and output); the tokens that followed their latest occurrence are the
  draft.
- ``suffix``: a suffix automaton over the request's tokens finds the longest suffix that occurred
  before, of any length (at least ``min_match``), in O(1) a step; what followed its first occurrence is
  the draft.

``DraftState`` adapts k per request (one more after a fully accepted draft, down to what was accepted
plus one after a miss) and switches speculation off for a request whose drafts keep failing, trying
again after a back-off that doubles each time.

Drafts are not free: each one is a decode row, and a row costs what the machine makes it cost (on a CPU
whose quantized kernels are compute-bound at one row, five rows can take 2.5 times one row's time).
``StepCosts`` learns a decode step's time by its number of rows, and ``draft_length`` keeps only as many
of a proposal's tokens as raise the expected tokens per second of the step.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

SPECULATIVE_METHODS = ("off", "ngram", "suffix")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "off"  # SPECULATIVE_METHODS
    num_tokens: int = 4  # draft tokens a step at most (k)
    min_ngram: int = 2  # ngram: shortest suffix looked up
    max_ngram: int = 4  # ngram: longest suffix looked up
    min_match: int = 2  # suffix: shortest earlier match that yields a draft
    # A request whose acceptance rate (moving average) falls below this after ``probe_steps`` drafted
    # steps stops drafting for ``backoff_tokens`` tokens (doubled at every further switch-off).
    min_acceptance: float = 0.15
    probe_steps: int = 6
    backoff_tokens: int = 32
    # Cut each draft to what pays for its rows (``draft_length``); off: verify whatever the proposer found.
    cost_aware: bool = True

    def __post_init__(self) -> None:
        checks = [
            (self.method in SPECULATIVE_METHODS, f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}"),
            (1 <= self.num_tokens <= 16, f"speculative num_tokens must be in [1, 16], got {self.num_tokens}"),
            (1 <= self.min_ngram <= self.max_ngram <= 16, "speculative ngram sizes need 1 <= min_ngram <= max_ngram <= 16"),
            (self.min_match >= 1, f"speculative min_match must be >= 1, got {self.min_match}"),
            (0.0 <= self.min_acceptance < 1.0, "speculative min_acceptance must be in [0, 1)"),
            (self.probe_steps >= 1 and self.backoff_tokens >= 1, "speculative probe_steps and backoff_tokens must be >= 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def enabled(self) -> bool:
        return self.method != "off"


class Proposer(abc.ABC):
    """Drafts the next tokens of one request from its own tokens. ``propose`` reads ``token_ids`` (the
    request's whole token list, which only ever grows) and changes only the proposer's own index."""

    @abc.abstractmethod
    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that may follow ``token_ids`` (none when nothing matches)."""


class NgramProposer(Proposer):
    """Prompt lookup: the latest earlier occurrence of the last n tokens, longest n first."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> where the tokens after its latest occurrence start
        self._indexed = 0  # n-grams ending before this position are indexed

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        end = len(token_ids)
        # index every n-gram ending before the last token, so a match is always an earlier occurrence
        for p in range(self._indexed, end - 1):
            for n in self.sizes:
                if p + 1 >= n:
                    self._index[tuple(token_ids[p + 1 - n : p + 1])] = p + 1
        self._indexed = max(self._indexed, end - 1)
        for n in self.sizes:
            if end < n:
                continue
            start = self._index.get(tuple(token_ids[end - n :]))
            if start is not None:
                return token_ids[start : start + k]
        return []


class SuffixProposer(Proposer):
    """The longest suffix of the tokens that occurred before, from a suffix automaton built incrementally
    (amortised O(1) a token); the draft is what followed its first occurrence."""

    def __init__(self, min_match: int) -> None:
        self.min_match = min_match
        self._next: list[dict[int, int]] = [{}]  # state -> token -> state
        self._link: list[int] = [-1]  # suffix link
        self._len: list[int] = [0]  # longest string of the state
        self._first: list[int] = [-1]  # end index of the state's first occurrence
        self._last = 0  # the state of the whole token list
        self._fed = 0  # tokens fed so far

    def _extend(self, token: int, pos: int) -> None:
        nxt, link, length, first = self._next, self._link, self._len, self._first
        cur = len(nxt)
        nxt.append({})
        link.append(0)
        length.append(length[self._last] + 1)
        first.append(pos)
        p = self._last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(nxt)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                first.append(first[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self._last = cur

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        for pos in range(self._fed, len(token_ids)):
            self._extend(token_ids[pos], pos)
        self._fed = len(token_ids)
        match = self._link[self._last]  # the longest suffix that also ends earlier
        if match <= 0 or self._len[match] < self.min_match:
            return []
        start = self._first[match] + 1
        return token_ids[start : start + k]


def make_proposer(cfg: SpeculativeConfig) -> Proposer:
    if cfg.method == "ngram":
        return NgramProposer(cfg.min_ngram, cfg.max_ngram)
    if cfg.method == "suffix":
        return SuffixProposer(cfg.min_match)
    raise ValueError(f"no proposer for speculative method {cfg.method!r}")


class DraftState:
    """One request's speculation: its proposer, the draft length k it has earned, and whether it is
    switched off. Owned by the request's ``Sequence``; the scheduler asks it for drafts and reports back
    what verification accepted."""

    def __init__(self, cfg: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.cfg = cfg
        self.proposer = proposer or make_proposer(cfg)
        self.k = cfg.num_tokens
        self.rate = 1.0  # moving average of accepted / drafted
        self.num_drafted = 0  # draft tokens proposed and verified
        self.num_accepted = 0
        self.num_draft_steps = 0
        self._probe = 0  # drafted steps since speculation was last switched on
        self._off_until = 0  # no drafts while the sequence has fewer tokens than this
        self._backoff = cfg.backoff_tokens

    def draft(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) draft tokens to follow ``token_ids`` (none while switched off)."""
        n = min(self.k, limit)
        if n <= 0 or len(token_ids) < self._off_until:
            return []
        return self.proposer.propose(token_ids, n)

    def skipped(self) -> None:
        """A proposal was not worth its rows this step: the rate drifts back up, so that a request whose
        drafts failed for a while is tried again (its rate is only measured when it drafts)."""
        self.rate += 0.1 * (1.0 - self.rate)

    def record(self, num_drafted: int, num_accepted: int, num_tokens: int) -> None:
        """Verification accepted ``num_accepted`` of ``num_drafted`` draft tokens; the sequence now has
        ``num_tokens`` tokens. Adapts k and may switch drafting off for a while."""
        assert 0 <= num_accepted <= num_drafted and num_drafted > 0
        cfg = self.cfg
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_draft_steps += 1
        self.rate = 0.7 * self.rate + 0.3 * (num_accepted / num_drafted)
        self.k = min(self.k + 1, cfg.num_tokens) if num_accepted == num_drafted else max(1, num_accepted + 1)
        self._probe += 1
        if self._probe >= cfg.probe_steps and self.rate < cfg.min_acceptance:
            self._off_until = num_tokens + self._backoff
            self._backoff *= 2
            self._probe = 0
            self.rate = 1.0
            self.k = cfg.num_tokens


class StepCosts:
    """Seconds a decode-only step takes, learned per number of decode rows (moving averages). Unmeasured
    row counts are interpolated between measured ones and taken as the largest measured count's beyond
    it: optimistic, so that longer drafts get tried and measured."""

    def __init__(self, max_rows: int = 1024) -> None:
        self.max_rows = max_rows
        self._seconds: dict[int, float] = {}

    def record(self, rows: int, seconds: float) -> None:
        if not 0 < rows <= self.max_rows or seconds <= 0:
            return
        old = self._seconds.get(rows)
        self._seconds[rows] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def estimate(self, rows: int) -> float | None:
        """The expected seconds of a step of ``rows`` decode rows (None before any measurement)."""
        known = self._seconds
        if not known:
            return None
        below = max((r for r in known if r <= rows), default=None)
        above = min((r for r in known if r >= rows), default=None)
        if below is None:
            return known[above]  # type: ignore[index]
        if above is None:
            return known[below]
        w = (rows - below) / (above - below) if above > below else 0.0
        guess = known[below] * (1 - w) + known[above] * w
        # more rows never cost less: a noisy high reading is capped by any cheaper larger step
        return min(guess, min(t for r, t in known.items() if r >= rows))


def draft_length(costs: StepCosts, rows: int, tokens: float, proposed: int, rate: float) -> int:
    """How many of ``proposed`` draft tokens to verify in a step that already has ``rows`` decode rows
    expected to yield ``tokens`` tokens: the length d maximising expected tokens per second, (tokens +
    rate + rate^2 + ... + rate^d) / seconds(rows + d), ``rate`` the request's acceptance rate."""
    base = costs.estimate(rows)
    if base is None:
        return proposed
    best, best_rate, gain = 0, tokens / base, 0.0
    for d in range(1, proposed + 1):
        gain += rate**d
        seconds = costs.estimate(rows + d) or base
        if (tokens + gain) / seconds > best_rate * 1.02:  # a 2% margin: noise must not buy rows
            best, best_rate = d, (tokens + gain) / seconds
    return best


@dataclass
class SpeculativeStats:
    """Counters of one engine's speculation since it started (for metrics)."""

    drafted_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of those, accepted
    emitted_tokens: int = 0  # tokens produced by steps of drafting sequences (accepted + one each)
    draft_steps: int = 0  # sequence-steps that carried a draft
    decode_steps: int = 0  # sequence-steps of decoding sequences (with or without a draft)
    decode_tokens: int = 0  # tokens those steps produced

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.decode_tokens / self.decode_steps if self.decode_steps else 0.0
