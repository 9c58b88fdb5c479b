"""What one scheduling step is bound by and decides: `SchedulerConfig` (the batch's limits),
`SchedulerOutput` (the batch the model runner computes) and `StepPlan` (the `Scheduler`'s record of a
step while it decides it). Values only; the `Scheduler` (engine.scheduler) owns the sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.sequence import Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences scheduled per step at most
    max_num_batched_tokens: int = 2048  # tokens per step: a decode counts 1, a prefill chunk its length
    max_prefill_chunk: int = 0  # cap on one sequence's prefill chunk per step; 0: only the budget caps it

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_prefill_chunk < 0:
            raise ValueError(f"max_prefill_chunk must be >= 0, got {self.max_prefill_chunk}")

    @property
    def max_running(self) -> int:
        """Sequences allowed to hold blocks and run at once. Never more than the token budget, so every
        running sequence can decode in the same step and none is left idle holding blocks."""
        return min(self.max_num_seqs, self.max_num_batched_tokens)


@dataclass
class SchedulerOutput:
    # Sequences computing one token each this step: token_ids[-1] at position num_tokens - 1
    # (num_computed_tokens == num_tokens - 1), plus their draft tokens. The runner samples a token for
    # every one of them (and verifies the drafts: `engine.speculative`).
    decode_seqs: list[Sequence]
    # Sequences computing a chunk of their prompt (or, after preemption, prompt + generated tokens).
    prefill_seqs: list[Sequence]
    # Chunk i is prefill_seqs[i].token_ids[c : c + prefill_chunk_lens[i]] with c = num_computed_tokens
    # as it is before ``update``; the runner samples only for a chunk that reaches num_tokens.
    prefill_chunk_lens: list[int]
    # Sequences sent back to the waiting queue this step (blocks freed, to be recomputed later).
    preempted: list[Sequence]
    # Sequences finished this step because they can never fit the KV cache (see the module docstring).
    rejected: list[Sequence]
    # len(decode_seqs) + draft tokens + sum(prefill_chunk_lens); never above max_num_batched_tokens.
    num_batched_tokens: int
    # Draft tokens of decode_seqs[i] (empty: none), at positions num_tokens .. num_tokens + len - 1.
    decode_drafts: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.decode_drafts:
            self.decode_drafts = [[] for _ in self.decode_seqs]
        assert len(self.decode_drafts) == len(self.decode_seqs)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(d) for d in self.decode_drafts)

    @property
    def is_empty(self) -> bool:
        return self.num_batched_tokens == 0

    def sampled_seqs(self) -> list[Sequence]:
        """Sequences the runner must sample a token for. Valid between ``schedule`` and ``update``."""
        done_prefills = [
            s
            for s, n in zip(self.prefill_seqs, self.prefill_chunk_lens, strict=True)
            if s.num_computed_tokens + n == s.num_tokens
        ]
        return self.decode_seqs + done_prefills


@dataclass(eq=False)
class StepPlan:
    """What one ``Scheduler.schedule`` call has decided so far (the scheduler's scratch record)."""

    budget: int  # tokens still available this step
    tokens: dict[Sequence, int] = field(default_factory=dict)  # scheduled sequence -> tokens this step
    decoding: set[Sequence] = field(default_factory=set)  # the scheduled sequences that decode
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)  # decoding sequence -> its draft tokens
    preempted: list[Sequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, num_tokens: int, decode: bool) -> None:
        assert 0 < num_tokens <= self.budget, "scheduling past the token budget"
        self.tokens[seq] = num_tokens
        if decode:
            self.decoding.add(seq)
        self.budget -= num_tokens

    def add_draft(self, seq: Sequence, draft: list[int]) -> None:
        assert seq in self.decoding and seq not in self.drafts and 0 < len(draft) <= self.budget
        self.drafts[seq] = draft
        self.tokens[seq] += len(draft)
        self.budget -= len(draft)

    def drop(self, seq: Sequence) -> None:
        """Unschedules ``seq`` (it is being preempted) and gives its tokens back to the budget."""
        self.budget += self.tokens.pop(seq, 0)
        self.decoding.discard(seq)
        self.drafts.pop(seq, None)
