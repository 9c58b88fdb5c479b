"""Simulated traffic: `loadgen`'s workloads (length distributions, Poisson arrivals, JSONL traces) as the
simulator's `SimRequest`s, drawn exactly as `pdserve bench` draws them (same seeds, same lengths)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from pdserve.planner.loadgen.workload import (
    LengthDist,
    MixtureDist,
    TextMaker,
    WorkloadConfig,
    draw_lengths,
    parse_dist,
    poisson_arrivals,
    read_trace,
)
from pdserve.planner.sim import SimRequest


@dataclass(frozen=True)
class Traffic:
    """Synthetic traffic: lengths from `loadgen` distributions; arrivals set per run by a rate. A shared
    system prompt (`shared_prefix_tokens`) is added to every prompt (the simulator has no prefix cache)."""

    prompt_tokens: LengthDist | MixtureDist
    output_tokens: LengthDist | MixtureDist
    shared_prefix_tokens: int = 0
    seed: int = 0

    @classmethod
    def parse(cls, prompt: str, output: str, shared_prefix_tokens: int = 0, seed: int = 0) -> Traffic:
        """From `pdserve bench`'s `--prompt-tokens` / `--output-tokens` syntax. Raises ValueError."""
        return cls(parse_dist(prompt), parse_dist(output), shared_prefix_tokens, seed)

    def requests(self, rate: float, n: int) -> list[SimRequest]:
        """`n` requests arriving as a Poisson process at `rate` req/s (inf: all at once)."""
        cfg = WorkloadConfig(self.prompt_tokens, self.output_tokens, seed=self.seed)
        arrivals = poisson_arrivals(rate, random.Random(f"{self.seed}-arrivals-0"), n)
        out = []
        for i, t in enumerate(arrivals):
            n_prompt, n_out = draw_lengths(cfg, random.Random(f"{self.seed}-{i}"))
            out.append(SimRequest(i, t, n_prompt + self.shared_prefix_tokens, n_out))
        return out

    def describe(self) -> str:
        prefix = f" + {self.shared_prefix_tokens} shared" if self.shared_prefix_tokens else ""
        return f"prompt {self.prompt_tokens}{prefix}, output {self.output_tokens}"


def trace_requests(path: str | Path, tokenizer: str | None = None) -> list[SimRequest]:
    """The requests of a `pdserve bench --trace` file, sorted by arrival; a line's text prompt is counted
    with `tokenizer` (else ~1 token a word, as loadgen approximates). Raises TraceError."""
    maker = TextMaker(tokenizer)
    out = []
    for i, e in enumerate(read_trace(path)):
        n = e.prompt_tokens
        if n is None:
            assert e.prompt is not None
            n = maker.count(e.prompt) or len(e.prompt.split())
        out.append(SimRequest(i, e.arrival_s, max(1, n), e.output_tokens))
    return out
