"""One `Sequence` per request, passed by reference through scheduler, block manager and runner."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.stopping import FinishReason

if TYPE_CHECKING:
    from pdserve.engine.speculative import DraftState
    from pdserve.engine.structured import GrammarState


class SequenceStatus(enum.Enum):
    """Where a sequence stands in its scheduler (which sets every status; see `engine.scheduler`)."""

    RESERVED = "reserved"  # holds blocks for prompt K/V arriving by transfer; never scheduled until it lands
    WAITING = "waiting"  # queued (new, preempted and waiting to be recomputed, or landed awaiting a slot)
    RUNNING = "running"  # holds blocks and is scheduled every step
    FINISHED = "finished"  # done; blocks released (or held until released: see `Scheduler.release`)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-k alternatives (token id, logprob), best first


@dataclass(frozen=True)
class Resume:
    """Where a resumed request continues: the completion tokens another node already delivered, and how
    many characters of their text it delivered (text a stop string could still match was held back)."""

    token_ids: tuple[int, ...]
    text_chars: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a resume needs at least one token")
        if self.text_chars < 0:
            raise ValueError(f"resume text_chars must be >= 0, got {self.text_chars}")


@dataclass(eq=False)
class Sequence:
    seq_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    num_prompt_tokens: int = 0  # 0 = all of token_ids at construction (a transferred seq passes its own)
    # A resumed request: completion tokens delivered before this sequence was created (by another node);
    # token_ids holds them after the prompt. They count as completion tokens (max_tokens, penalties, the
    # seeded sampler's position) but were never sampled here.
    num_resumed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)  # physical block ids, in order
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, tokens that came from a prefix-cache hit
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # matched stop string or stop token id
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token, if asked
    arrival_time: float = field(default_factory=time.monotonic)
    num_preemptions: int = 0
    generator: Any = None  # per-request torch.Generator when seeded; owned by the sampler
    # Prefill-only requests: finishing (other than by abort) keeps the blocks until they are released,
    # so a KV transfer can read them after the request is done.
    hold_blocks: bool = False
    # The request's structured-output matcher (params.structured set), advanced by `append_token` with
    # every token after the prompt; a resumed sequence's is built having replayed the resumed tokens.
    grammar: GrammarState | None = None
    # Speculative decoding: the request's proposer and draft length (engine.speculative), made by the
    # scheduler at the first step it may draft.
    draft: DraftState | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.token_ids = list(self.token_ids)
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        if not 0 < self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError("num_prompt_tokens must be in [1, len(token_ids)]")
        if not 0 <= self.num_resumed_tokens <= self.num_completion_tokens:
            raise ValueError("num_resumed_tokens must be in [0, num_completion_tokens]")

    def append_token(self, token_id: int) -> None:
        """Appends a generated token and advances the grammar with it (a rejected token leaves the
        grammar in error: its `finish` is then "abort")."""
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.advance(token_id)

    @property
    def grammar_finish(self) -> str | None:
        """How the grammar ends the request now ("stop": complete, "abort": rejected), or None."""
        return self.grammar.finish if self.grammar is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_new_tokens(self) -> int:
        """Completion tokens generated for this sequence (the resumed ones excluded)."""
        return len(self.token_ids) - self.num_prompt_tokens - self.num_resumed_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        # True while the prompt (or, after preemption, prompt + output) is not fully in the cache.
        return self.num_computed_tokens < self.num_tokens - 1
