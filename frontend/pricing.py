"""What a request costs in money: a model's price table applied to its token usage.

Prices are US dollars per million tokens, as providers publish them. A prompt's cached tokens (served from
a KV prefix instead of computed) are billed at the cached-input price; a request of a batch job gets the
model's batch discount on all of it. Money limits (tenant budgets) and the cost metric use this one
function, so what is charged and what is reported cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

PER_TOKENS = 1_000_000


@dataclass(frozen=True)
class Prices:
    """One model's prices in USD per million tokens; `batch_discount` is the fraction taken off batch work."""

    input: float = 0.0
    cached_input: float = 0.0
    output: float = 0.0
    batch_discount: float = 0.0

    def __post_init__(self) -> None:
        for name in ("input", "cached_input", "output"):
            value = getattr(self, name)
            assert value >= 0.0, f"price {name} must be >= 0, got {value}"
        assert 0.0 <= self.batch_discount < 1.0, f"batch_discount must be in [0, 1), got {self.batch_discount}"


FREE = Prices()


def cost_usd(prices: Prices | None, input_tokens: int, cached_tokens: int, output_tokens: int,
             batch: bool = False) -> float:
    """USD for one request. `input_tokens` counts the whole prompt, `cached_tokens` the part of it served
    from cache (billed at the cached price instead); None prices cost nothing."""
    if prices is None:
        return 0.0
    assert 0 <= cached_tokens <= input_tokens and output_tokens >= 0, (input_tokens, cached_tokens, output_tokens)
    total = ((input_tokens - cached_tokens) * prices.input + cached_tokens * prices.cached_input
             + output_tokens * prices.output) / PER_TOKENS
    return total * (1.0 - prices.batch_discount) if batch else total
