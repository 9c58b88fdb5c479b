"""Paged KV cache: ref-counted blocks, a chained-hash prefix cache over full blocks, LRU eviction.

Pure bookkeeping: no tensors live here. A block id is an index into the node's KV cache; a sequence's
``block_table`` lists the ids holding its tokens in order (token ``p`` lives in slot
``block_table[p // block_size] * block_size + p % block_size``).

Prefix cache. A block whose K/V are fully computed is *committed*: it is registered under a chained hash
``H(seed, parent_hash, tokens)`` that every node sharing ``hash_seed`` and ``block_size`` computes the
same way, so routers can reason about cache affinity across the cluster. A hash alone never proves a
hit: each cached block also stores its tokens and the *cache entry* of the block before it (an id
unique to one content chain, never reused), and a lookup accepts a block only when both match, so
neither a hash collision nor a stale chain can hand a sequence K/V computed for other tokens.

Free blocks sit in one queue in release order. A freed block that is still registered stays findable
(evictable) until the queue reaches it and its slot is handed out; a hit on it revives it, taking it off
the queue.

Tier. With a ``BlockTier`` under the pool (``engine.kv_tier``), every newly committed block is also
handed to it, and a first allocation or reservation whose pool hits end at a miss continues with the
blocks the tier holds: each is read back into a fresh block of the sequence and registered like a
committed one, so the sequence starts after them. A block the tier fails to read ends the run there;
the rest is computed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Protocol
from weakref import WeakKeyDictionary

from pdserve.engine.block_types import PrefixCacheStats, Reservation
from pdserve.engine.kv_events import POOL
from pdserve.engine.prefix_hash import BlockHash, compute_block_hashes
from pdserve.engine.sequence import Sequence


class BlockTier(Protocol):
    """A store under the pool that keeps committed blocks after the pool evicts them (engine.kv_tier.KVTier).
    A block is named by its chained hash and proven by its tokens and its parent's hash."""

    def contains(self, block_hash: BlockHash, tokens: SequenceOf[int], parent: BlockHash | None) -> bool:
        """Whether it holds the block (changes nothing)."""
        ...

    def store(self, block_hash: BlockHash, tokens: SequenceOf[int], parent: BlockHash | None, block_id: int) -> None:
        """Takes a copy of pool block `block_id`, a committed block (changes the store only)."""
        ...

    def load(self, block_hash: BlockHash, tokens: SequenceOf[int], parent: BlockHash | None, block_id: int) -> bool:
        """Writes the block's K/V into pool block `block_id`; False (nothing written) if it cannot."""
        ...


@dataclass(eq=False)
class _Block:
    block_id: int
    ref_count: int = 0  # sequences holding this block
    block_hash: BlockHash | None = None  # set exactly while registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # registered content, compared on every hit
    parent_entry: int | None = None  # cache entry of the preceding block's content; None for a first block
    entry: int = -1  # cache entry of this block's content chain while registered
    parent_hash: BlockHash | None = None  # the preceding block's hash while registered (what a tier checks)


@dataclass(eq=False)
class _Holder:
    seq: Sequence
    # Cache entry of each committed leading block: the block's own, or that of an identical block that
    # was already cached when it was committed. Children are registered under these, so a chain stays
    # findable even when this sequence computed a duplicate of a cached block.
    entries: list[int] = field(default_factory=list)


class BlockManager:
    """Owns the KV cache blocks of one node. Every method that takes a sequence may change its
    ``block_table`` (and, where stated, ``num_computed_tokens`` / ``num_cached_tokens``)."""

    def __init__(
        self, num_blocks: int, block_size: int, hash_seed: int, enable_prefix_caching: bool = True,
        tier: BlockTier | None = None, events: Callable[[bool, int, BlockHash], None] | None = None,
    ) -> None:
        """``events`` is told of each block registered in (True) or removed from (False) the prefix cache,
        as (stored, POOL, hash) (engine.kv_events)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not -(2**127) <= hash_seed < 2**127:
            raise ValueError("hash_seed must fit in 128 signed bits")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._hash_seed = hash_seed
        self._enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Insertion order is release order: the front is handed out (and evicted) first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._holders: dict[str, _Holder] = {}
        self._hash_memo: WeakKeyDictionary[Sequence, list[BlockHash]] = WeakKeyDictionary()
        self._next_entry = 0
        self._stats = PrefixCacheStats()
        self._tier = tier if enable_prefix_caching else None
        self._events = events

    # ----------------------------------------------------------------------------------- read-only state

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def hash_seed(self) -> int:
        return self._hash_seed

    @property
    def enable_prefix_caching(self) -> bool:
        return self._enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: never used, or free but still cached (evictable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, held or evictable."""
        return len(self._cached)

    @property
    def num_evictable_blocks(self) -> int:
        return sum(1 for b in self._free if self._blocks[b].block_hash is not None)

    @property
    def num_holders(self) -> int:
        """Sequences holding blocks (each must be known to its scheduler: see ``Scheduler.check_integrity``)."""
        return len(self._holders)

    def stats(self) -> PrefixCacheStats:
        """A snapshot of the prefix-cache counters."""
        s = self._stats
        return PrefixCacheStats(s.query_tokens, s.hit_tokens, s.rejected_hits, s.tier_hit_tokens)

    def holds(self, seq: Sequence) -> bool:
        """Whether ``seq`` currently holds blocks allocated or reserved here."""
        holder = self._holders.get(seq.seq_id)
        return holder is not None and holder.seq is seq

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self._block_size - 1) // self._block_size

    def block_hashes(self, token_ids: SequenceOf[int]) -> list[BlockHash]:
        """Chained hashes of the full blocks of ``token_ids``; depends only on tokens, block size, seed."""
        return compute_block_hashes(token_ids, self._block_size, self._hash_seed)

    def num_prefix_hit_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` a first allocation would take from the prefix cache right now: whole blocks
        only, and never all of ``seq.token_ids`` (the last token must be computed to get logits).
        Changes nothing."""
        if self.holds(seq):
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        hits, tiered = self._match(seq, (seq.num_tokens - 1) // self._block_size, record=False)
        return (len(hits) + tiered) * self._block_size

    # ----------------------------------------------------------------------------------- operations

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Makes ``seq.block_table`` large enough for ``num_computed_tokens + num_new_tokens`` tokens.

        On the first allocation of a sequence (no blocks, nothing computed) the prefix-cache hits of
        ``num_prefix_hit_tokens`` are applied first: their blocks are shared and ``num_computed_tokens``
        and ``num_cached_tokens`` are set to the hit length. Returns False, changing nothing, when the
        free blocks do not suffice."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        holder = self._holders.get(seq.seq_id)
        if holder is not None:
            if holder.seq is not seq:
                raise ValueError(f"another sequence with id {seq.seq_id} holds blocks")
            return self._grow(seq, seq.num_computed_tokens + num_new_tokens)
        self._check_fresh(seq)
        hits, tiered = self._match(seq, (seq.num_tokens - 1) // self._block_size, record=True)
        loaded = self._take(seq, hits, tiered, (len(hits) + tiered) * self._block_size + num_new_tokens)
        if loaded is None:
            return False
        hit_tokens = (len(hits) + loaded) * self._block_size
        seq.num_computed_tokens = seq.num_cached_tokens = hit_tokens
        self._stats.query_tokens += seq.num_tokens
        self._stats.hit_tokens += hit_tokens
        self._stats.tier_hit_tokens += loaded * self._block_size
        return True

    def reserve(self, seq: Sequence, num_kv_tokens: int) -> Reservation | None:
        """Reserves blocks for a sequence whose first ``num_kv_tokens`` tokens get their K/V from outside
        (a transfer), plus one slot for the token decoded next. Full blocks already in the prefix cache
        are shared instead (all of them may hit: nothing is computed here). Sets ``num_computed_tokens``
        and ``num_cached_tokens`` to the hit length. Returns None, changing nothing, if the blocks do not
        fit. Call ``commit_filled`` once the transfer has written ``fill_block_ids``."""
        if not 1 <= num_kv_tokens <= seq.num_tokens:
            raise ValueError(f"num_kv_tokens must be in [1, {seq.num_tokens}], got {num_kv_tokens}")
        if seq.seq_id in self._holders:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        self._check_fresh(seq)
        hits, tiered = self._match(seq, num_kv_tokens // self._block_size, record=True)
        loaded = self._take(seq, hits, tiered, num_kv_tokens + 1)
        if loaded is None:
            return None
        num_cached = len(hits) + loaded
        hit_tokens = num_cached * self._block_size
        seq.num_computed_tokens = seq.num_cached_tokens = hit_tokens
        self._stats.query_tokens += num_kv_tokens
        self._stats.hit_tokens += hit_tokens
        self._stats.tier_hit_tokens += loaded * self._block_size
        return Reservation(
            block_ids=tuple(seq.block_table),
            num_cached_blocks=num_cached,
            fill_block_ids=tuple(seq.block_table[num_cached : self.blocks_needed(num_kv_tokens)]),
            num_cached_tokens=hit_tokens,
        )

    def commit_filled(self, seq: Sequence, num_kv_tokens: int) -> int:
        """Marks the first ``num_kv_tokens`` tokens of a reserved sequence as computed (their K/V were
        written from outside) and commits its now-full blocks. Returns the blocks newly registered."""
        if not self.holds(seq):
            raise ValueError(f"sequence {seq.seq_id} holds no reservation")
        if (
            not seq.num_computed_tokens
            <= num_kv_tokens
            <= min(seq.num_tokens, len(seq.block_table) * self._block_size)
        ):
            raise ValueError(f"num_kv_tokens {num_kv_tokens} is outside the reserved, uncomputed range")
        seq.num_computed_tokens = num_kv_tokens
        return self.commit(seq)

    def commit(self, seq: Sequence) -> int:
        """Registers in the prefix cache every block of ``seq`` that is full and whose K/V are computed
        (the first ``num_computed_tokens // block_size``) and not yet committed. Returns how many
        blocks were newly registered (blocks identical to an already cached one are not)."""
        holder = self._holders.get(seq.seq_id)
        if holder is None or holder.seq is not seq:
            raise ValueError(f"sequence {seq.seq_id} holds no blocks")
        bs = self._block_size
        num_full = seq.num_computed_tokens // bs
        assert num_full <= len(seq.block_table), "computed tokens beyond the block table"
        if not self._enable_prefix_caching or num_full <= len(holder.entries):
            return 0
        hashes = self._hashes(seq, num_full)
        registered = 0
        for i in range(len(holder.entries), num_full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = holder.entries[i - 1] if i else None
            existing = self._cached.get(hashes[i])
            if existing is not None:
                other = self._blocks[existing]
                if other.parent_entry == parent and other.token_ids == tokens:
                    holder.entries.append(other.entry)
                    continue
                # A collision or a chain whose parent is gone: the newest content takes the slot.
                self._uncache(other)
            block = self._blocks[seq.block_table[i]]
            assert block.block_hash is None, "a block of a sequence was cached before it was committed"
            self._register(block, holder, hashes, i, tokens)
            if self._tier is not None:
                self._tier.store(hashes[i], tokens, block.parent_hash, block.block_id)
            registered += 1
        return registered

    def _register(self, block: _Block, holder: _Holder, hashes: list[BlockHash], i: int, tokens: tuple[int, ...]) -> None:
        """Registers `block` as the i-th full block of the holder's sequence (its K/V are in place)."""
        block.block_hash, block.token_ids = hashes[i], tokens
        block.parent_entry = holder.entries[i - 1] if i else None
        block.parent_hash = hashes[i - 1] if i else None
        block.entry = self._next_entry
        self._next_entry += 1
        self._cached[hashes[i]] = block.block_id
        holder.entries.append(block.entry)
        if self._events is not None:
            self._events(True, POOL, hashes[i])

    def trim(self, seq: Sequence) -> int:
        """Frees the blocks of ``seq`` past those its tokens need (left empty by rejected draft tokens;
        never committed). They go to the front of the free queue: they hold nothing worth keeping, so
        they are handed out before any cached block is evicted. Returns how many were freed."""
        holder = self._holders.get(seq.seq_id)
        if holder is None or holder.seq is not seq:
            raise ValueError(f"sequence {seq.seq_id} holds no blocks")
        keep = max(self.blocks_needed(seq.num_tokens), self.blocks_needed(seq.num_computed_tokens))
        extra = seq.block_table[keep:]
        for block_id in extra:
            block = self._blocks[block_id]
            assert block.ref_count == 1 and block.block_hash is None, f"block {block_id} is shared or cached"
            block.ref_count = 0
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)
        del seq.block_table[keep:]
        return len(extra)

    def free(self, seq: Sequence) -> None:
        """Releases every block of ``seq`` and empties its ``block_table`` (other fields are left to the
        caller). Committed blocks stay cached until evicted. Safe to call on a sequence holding none."""
        self._hash_memo.pop(seq, None)
        holder = self._holders.get(seq.seq_id)
        if holder is None or holder.seq is not seq:
            assert not seq.block_table, f"sequence {seq.seq_id} has blocks this manager did not give it"
            return
        del self._holders[seq.seq_id]
        # Tail blocks first: a shared prefix is the part most likely to be hit again, so it is evicted last.
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                assert block_id not in self._free
                self._free[block_id] = None
        seq.block_table = []

    # ----------------------------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        """Asserts every invariant of the KV cache's blocks; changes nothing."""
        holders_of = [0] * self._num_blocks
        for seq_id, holder in self._holders.items():
            seq = holder.seq
            assert seq.seq_id == seq_id, f"holder key {seq_id} names sequence {seq.seq_id}"
            table = seq.block_table
            assert len(set(table)) == len(table), f"{seq_id} lists a block twice"
            assert seq.num_computed_tokens <= len(table) * self._block_size, (
                f"{seq_id} computed past its blocks"
            )
            assert seq.num_computed_tokens <= seq.num_tokens, f"{seq_id} computed past its tokens"
            assert len(holder.entries) <= seq.num_computed_tokens // self._block_size, (
                f"{seq_id} committed too much"
            )
            for block_id in table:
                assert 0 <= block_id < self._num_blocks, f"{seq_id} holds unknown block {block_id}"
                holders_of[block_id] += 1
        for block in self._blocks:
            assert block.ref_count == holders_of[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} but {holders_of[block.block_id]} holders"
            )
            assert (block.ref_count == 0) == (block.block_id in self._free), (
                f"block {block.block_id} is not exactly one of free/used"
            )
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id, (
                    f"block {block.block_id} lost its entry"
                )
                assert len(block.token_ids) == self._block_size, f"cached block {block.block_id} is not full"
        for block_hash, block_id in self._cached.items():
            assert self._blocks[block_id].block_hash == block_hash, f"hash entry points at block {block_id}"
        assert len(self._free) == len(set(self._free)), "free queue holds duplicates"
        num_used = sum(1 for b in self._blocks if b.ref_count > 0)
        assert num_used + len(self._free) == self._num_blocks, "free and used blocks do not add up"
        if not self._enable_prefix_caching:
            assert not self._cached, "prefix caching is off but blocks are cached"

    # ----------------------------------------------------------------------------------- internals

    def _check_fresh(self, seq: Sequence) -> None:
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(
                f"sequence {seq.seq_id} claims blocks or computed tokens it was not given here "
                "(reset num_computed_tokens after freeing it)"
            )

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        # Tokens only ever get appended, so the hashes of a sequence's full blocks never change.
        hashes = self._hash_memo.get(seq, [])
        if len(hashes) < num_blocks:
            hashes = compute_block_hashes(
                seq.token_ids[: num_blocks * self._block_size], self._block_size, self._hash_seed, hashes
            )
            self._hash_memo[seq] = hashes
        return hashes

    def _match(self, seq: Sequence, max_blocks: int, record: bool) -> tuple[list[int], int]:
        """Ids of the cached blocks holding the longest verified prefix of ``seq`` (at most max_blocks),
        and how many blocks after them the tier holds (when the pool's run ended at a miss, not a refused
        match). ``record`` counts refused hash matches in the stats (not for look-ups that may repeat)."""
        if not self._enable_prefix_caching or max_blocks <= 0 or (not self._cached and self._tier is None):
            return [], 0
        bs = self._block_size
        hashes = self._hashes(seq, max_blocks)
        hits: list[int] = []
        parent: int | None = None
        for i in range(max_blocks):
            block_id = self._cached.get(hashes[i])
            if block_id is None:
                return hits, self._tier_run(seq, hashes, i, max_blocks)
            block = self._blocks[block_id]
            if block.parent_entry != parent or block.token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                self._stats.rejected_hits += int(record)
                break
            hits.append(block_id)
            parent = block.entry
        return hits, 0

    def _tier_run(self, seq: Sequence, hashes: list[BlockHash], start: int, max_blocks: int) -> int:
        """How many consecutive blocks from the ``start``-th the tier holds for ``seq``."""
        if self._tier is None:
            return 0
        bs, n = self._block_size, 0
        for i in range(start, max_blocks):
            if not self._tier.contains(hashes[i], seq.token_ids[i * bs : (i + 1) * bs], hashes[i - 1] if i else None):
                break
            n += 1
        return n

    def _take(self, seq: Sequence, hits: list[int], tiered: int, num_tokens: int) -> int | None:
        """Gives a fresh ``seq`` the hit blocks plus new blocks up to ``num_tokens`` tokens, the first
        ``tiered`` new ones read back from the tier. Returns how many were (a failed read ends the run), or
        None, changing nothing, when the blocks do not fit."""
        num_new = max(self.blocks_needed(num_tokens) - len(hits), 0)
        num_revived = sum(1 for b in hits if self._blocks[b].ref_count == 0)
        if num_new > len(self._free) - num_revived:
            return None
        holder = _Holder(seq, entries=[self._blocks[b].entry for b in hits])
        # Hits come off the free queue before new blocks are popped, so a new block never evicts a hit.
        for block_id in hits:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        seq.block_table = list(hits)
        self._holders[seq.seq_id] = holder
        self._append_new_blocks(seq, num_new)
        return self._load_tiered(seq, holder, len(hits), min(tiered, num_new))

    def _load_tiered(self, seq: Sequence, holder: _Holder, start: int, count: int) -> int:
        """Reads blocks [start, start + count) of ``seq`` from the tier into its new blocks and registers
        them; stops at the first the tier cannot give. Returns how many it read."""
        if not count:
            return 0
        assert self._tier is not None
        bs = self._block_size
        hashes = self._hashes(seq, start + count)
        for i in range(start, start + count):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block = self._blocks[seq.block_table[i]]
            if hashes[i] in self._cached or not self._tier.load(hashes[i], tokens, hashes[i - 1] if i else None,
                                                                 block.block_id):
                return i - start
            self._register(block, holder, hashes, i, tokens)
        return count

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        num_new = self.blocks_needed(num_tokens) - len(seq.block_table)
        if num_new > len(self._free):
            return False
        self._append_new_blocks(seq, num_new)
        return True

    def _append_new_blocks(self, seq: Sequence, num_new: int) -> None:
        for _ in range(num_new):
            block_id, _ = self._free.popitem(last=False)
            block = self._blocks[block_id]
            assert block.ref_count == 0, f"free block {block_id} is referenced"
            if block.block_hash is not None:
                self._uncache(block)
            block.ref_count = 1
            seq.block_table.append(block_id)

    def _uncache(self, block: _Block) -> None:
        assert block.block_hash is not None and self._cached.get(block.block_hash) == block.block_id
        del self._cached[block.block_hash]
        if self._events is not None:
            self._events(False, POOL, block.block_hash)
        block.block_hash, block.token_ids, block.parent_entry, block.entry = None, (), None, -1
        block.parent_hash = None
