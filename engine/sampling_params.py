"""Per-request sampling settings, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.speculative import SPECULATIVE_METHODS
from pdserve.engine.structured_spec import StructuredSpec

MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: -100 bans a token, +100 all but forces it
PRIORITY_BOUND = (1 << 31) - 1  # priorities travel as int32


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = -1  # -1 (or 0) disables
    seed: int | None = None  # per-request generator seed; reproducible regardless of batch mates
    presence_penalty: float = 0.0  # OpenAI semantics, in [-2, 2], over generated tokens
    frequency_penalty: float = 0.0  # OpenAI semantics, in [-2, 2], over generated tokens
    repetition_penalty: float = 1.0  # HF/CTRL semantics, > 0, over prompt + generated tokens
    max_tokens: int = 16  # generated tokens at most
    stop: list[str] = field(default_factory=list)  # stop strings; excluded from the output
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop ids (kept in token output)
    ignore_eos: bool = False  # keep generating past EOS until max_tokens
    logprobs: int | None = None  # None: none; k >= 0: sampled token's logprob plus top-k alternatives
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]
    structured: StructuredSpec | None = None  # output constrained to this grammar (engine.structured)
    # Not sampling but how the request is scheduled; carried with the parameters because every engine the
    # request meets (prefill and decode node) needs it. Lower runs first (vLLM's convention): waiting
    # queues are ordered by it, and the least urgent running sequence is preempted first.
    priority: int = 0
    # Likewise not sampling: the draft proposer of speculative decoding for this request ("off", "ngram",
    # "suffix"; "": the node's `--speculative`). The frontend sets it from the models file.
    speculative: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = {int(t): float(v) for t, v in self.logit_bias.items()}
        if self.top_k == 0:
            self.top_k = -1
        checks = [
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 or >= 1, got {self.top_k}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (-PRIORITY_BOUND <= self.priority <= PRIORITY_BOUND,
             f"priority must be in [-{PRIORITY_BOUND}, {PRIORITY_BOUND}], got {self.priority}"),
            (self.speculative in ("", *SPECULATIVE_METHODS),
             f"speculative must be one of {SPECULATIVE_METHODS} or empty, got {self.speculative!r}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (all(t >= 0 for t in self.logit_bias), "logit_bias token ids must be >= 0"),
            (all(-MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in self.logit_bias.values()),
             f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
