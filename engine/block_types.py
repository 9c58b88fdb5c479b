"""The values a `BlockManager` hands out: reservations for transferred prompts and prefix-cache counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    query_tokens: int = 0  # tokens looked up on first allocations and reservations
    hit_tokens: int = 0  # of those, tokens served from the prefix cache
    rejected_hits: int = 0  # hash matches refused because the stored tokens or chain differed
    tier_hit_tokens: int = 0  # of hit_tokens, those read back from the tier under the pool (engine.kv_tier)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(frozen=True)
class Reservation:
    """Blocks reserved for a prompt whose K/V arrive from elsewhere (a transfer)."""

    block_ids: tuple[int, ...]  # the sequence's whole block table after the reservation
    num_cached_blocks: int  # leading blocks already holding this prompt's K/V: a transfer skips them
    fill_block_ids: tuple[int, ...]  # blocks the transfer must write, in order, right after the cached ones
    num_cached_tokens: int  # num_cached_blocks * block_size

    @property
    def cached_block_ids(self) -> tuple[int, ...]:
        return self.block_ids[: self.num_cached_blocks]
