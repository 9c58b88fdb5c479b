"""What the engine keeps per request next to the scheduler's sequence (`LiveRequest`), and how a new one
is checked and built (`RequestBuilder`): its sequence with its grammar state, its detokenizer, and a
resumed request's tokens replayed through both."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Resume, Sequence
from pdserve.engine.stopping import stop_decision
from pdserve.engine.structured import GrammarCompiler, GrammarState
from pdserve.engine.structured_spec import GrammarError
from pdserve.engine.tokenizer import Tokenizer


@dataclass(eq=False)
class LiveRequest:
    """What the engine keeps per request until its finished output is emitted, next to the scheduler's
    sequence: the detokenizer and, when captured, the logits of each generated token."""

    seq: Sequence
    detok: IncrementalDetokenizer
    logits: list[torch.Tensor] = field(default_factory=list)
    # Text of a resumed request's resumed tokens that the node before did not deliver; it goes out with
    # the request's next output.
    pending_text: str = ""


@dataclass(frozen=True)
class RequestBuilder:
    """Checks and builds the requests of one engine's model."""

    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    grammars: Callable[[], GrammarCompiler]  # the engine's compiler (built on first use)

    def build(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, resume: Resume | None
    ) -> LiveRequest:
        """Validates a request and builds its sequence (with its grammar state, for a structured-output
        request) and detokenizer; registers nothing. A resumed request's context is prompt +
        ``resume.token_ids``, which count as completion tokens (max_tokens, stop, penalties, the seeded
        sampler's position, the grammar replays them); it is prefilled like a preempted sequence. Its
        detokenizer replays them, so text continues where it stopped: what it releases beyond
        ``resume.text_chars`` is pending and goes out with the next output, and a held-back tail that a
        stop string might still complete stays held here. Raises ValueError (GrammarError for a
        response format that does not compile or rejects a resumed token)."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        resumed = list(resume.token_ids) if resume is not None else []
        if any(not 0 <= t < vocab for t in ids) or any(not 0 <= t < vocab for t in resumed):
            raise ValueError(f"prompt and resumed token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the context "
                f"length of {self.max_model_len} tokens"
            )
        if len(resumed) >= params.max_tokens:
            raise ValueError(f"{len(resumed)} resumed tokens leave nothing of max_tokens ({params.max_tokens})")
        eos = self.tokenizer.eos_token_ids
        grammar = self._replay_resumed(params, resumed)
        seq = Sequence(request_id, ids + resumed, params, eos_token_ids=eos, num_prompt_tokens=len(ids),
                       num_resumed_tokens=len(resumed), grammar=grammar)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop)
        request = LiveRequest(seq, detok)
        if resume is not None:
            replay = detok.add(resumed)
            if replay.stopped:
                raise ValueError(f"the resumed tokens already complete the stop string {replay.stop_string!r}")
            if resume.text_chars > len(replay.text):
                raise ValueError(
                    f"resume_text_chars ({resume.text_chars}) is more than the resumed tokens' releasable "
                    f"text ({len(replay.text)} characters)"
                )
            request.pending_text = replay.text[resume.text_chars :]
        return request

    def _replay_resumed(self, params: SamplingParams, resumed: list[int]) -> GrammarState | None:
        """Checks that no resumed token would have ended the request and returns the request's grammar
        state (None without a response format) advanced through them, so it stands where the node before
        left it. Raises ValueError (GrammarError for a grammar that does not compile or rejects a token)."""
        eos = self.tokenizer.eos_token_ids
        grammar = self.grammars().new_state(params.structured) if params.structured is not None else None
        for i, token in enumerate(resumed):
            if grammar is not None and not grammar.advance(token):
                raise GrammarError(f"resumed token {i} ({token}) is not allowed by the response format")
            finish = grammar.finish if grammar is not None else None
            if stop_decision(params, eos, token, i + 1, finish) is not None:
                raise ValueError(f"resumed token {i} ({token}) would have ended the request")
        return grammar
