from __future__ import annotations

import random

import pytest

from pdserve.engine import prefix_hash as prefix_hash_module
from pdserve.engine.block_manager import BlockManager, compute_block_hashes
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence


def make_seq(seq_id: str, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams())


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Allocates and 'computes' every remaining token of ``seq``, then commits its full blocks."""
    assert bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    bm.check_integrity()
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    bm.check_integrity()


def assert_drained(bm: BlockManager) -> None:
    bm.check_integrity()
    assert bm.num_used_blocks == 0
    assert bm.num_free_blocks == bm.num_blocks


def test_allocate_grow_free_refcounts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, hash_seed=0)
    seq = make_seq("a", list(range(10)))
    assert bm.allocate(seq, 6)
    bm.check_integrity()
    assert len(seq.block_table) == 2 and bm.num_used_blocks == 2 and bm.num_free_blocks == 6
    seq.num_computed_tokens = 6
    assert bm.allocate(seq, 4)  # 10 tokens -> 3 blocks
    assert len(seq.block_table) == 3 and bm.num_used_blocks == 3
    assert bm.allocate(seq, 2)  # 8 tokens: the table never shrinks
    assert len(seq.block_table) == 3
    bm.check_integrity()
    bm.free(seq)
    assert seq.block_table == []
    assert_drained(bm)
    bm.free(seq)  # freeing twice is harmless
    assert_drained(bm)


def test_allocate_failure_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=4, hash_seed=0)
    a = make_seq("a", list(range(8)))
    compute_all(bm, a)
    b = make_seq("b", [100 + i for i in range(9)])
    assert not bm.allocate(b, 9)
    assert b.block_table == [] and b.num_computed_tokens == 0 and not bm.holds(b)
    assert bm.num_free_blocks == 1
    assert bm.allocate(b, 4)
    b.num_computed_tokens = 4
    before = list(b.block_table)
    assert not bm.allocate(b, 5)  # would need a third block
    assert b.block_table == before
    bm.check_integrity()
    bm.free(a)
    bm.free(b)
    assert_drained(bm)


def test_prefix_hits_shared_full_blocks_only() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, hash_seed=1)
    a = make_seq("a", list(range(10)))  # blocks: [0..3] [4..7] partial [8, 9]
    compute_all(bm, a)
    assert bm.num_cached_blocks == 2  # the partial block is never cached

    b = make_seq("b", list(range(10)) + [50, 51, 52])
    assert bm.num_prefix_hit_tokens(b) == 8  # not the partial third block, although its tokens match
    assert bm.allocate(b, 5)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    bm.check_integrity()

    c = make_seq("c", list(range(4)) + [99] * 6)
    assert bm.allocate(c, c.num_tokens - bm.num_prefix_hit_tokens(c))
    assert c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0]
    bm.check_integrity()
    assert bm.num_used_blocks == 3 + 2 + 2  # a; b past its 2 hits; c past its 1 hit

    bm.free(a)
    bm.free(b)
    # Shared blocks stay held by c and are not on the free queue.
    assert bm.num_used_blocks == 3
    bm.check_integrity()
    bm.free(c)
    assert_drained(bm)
    stats = bm.stats()
    assert stats.hit_tokens == 12 and stats.query_tokens == 10 + 13 + 10
    assert stats.hit_rate == pytest.approx(12 / 33)


def test_never_hits_the_whole_sequence() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, hash_seed=1)
    a = make_seq("a", list(range(8)))
    compute_all(bm, a)
    assert bm.num_cached_blocks == 2
    same = make_seq("same", list(range(8)))
    assert bm.num_prefix_hit_tokens(same) == 4  # one token at least must be computed for logits
    longer = make_seq("longer", list(range(9)))
    assert bm.num_prefix_hit_tokens(longer) == 8
    bm.free(a)
    assert_drained(bm)


def test_chained_hash_same_block_under_other_prefix_misses() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, hash_seed=3)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    assert bm.block_hashes(x + y)[1] != bm.block_hashes(z + y)[1]
    a = make_seq("a", x + y + [0])
    compute_all(bm, a)
    b = make_seq("b", z + y + [0])
    assert bm.num_prefix_hit_tokens(b) == 0
    assert bm.allocate(b, b.num_tokens)
    assert set(b.block_table).isdisjoint(a.block_table)
    bm.free(a)
    bm.free(b)
    assert_drained(bm)


def test_block_hashes_are_a_pure_function_of_tokens_block_size_and_seed() -> None:
    tokens = list(range(37))
    one = BlockManager(num_blocks=4, block_size=8, hash_seed=42).block_hashes(tokens)
    other_node = BlockManager(num_blocks=100, block_size=8, hash_seed=42).block_hashes(tokens)
    assert one == other_node == compute_block_hashes(tokens, 8, 42)
    assert len(one) == 4 and len(set(one)) == 4 and all(isinstance(h, bytes) for h in one)
    assert BlockManager(num_blocks=4, block_size=8, hash_seed=43).block_hashes(tokens) != one
    assert compute_block_hashes(tokens, 8, 42, known=one[:2]) == one
    # A block's hash covers everything before it, so the first block's hash names the prefix.
    assert compute_block_hashes(tokens[:8] + [7] * 8, 8, 42)[0] == one[0]
    assert compute_block_hashes(tokens[:8] + [7] * 8, 8, 42)[1] != one[1]


def test_hash_collision_is_caught_by_the_token_check(monkeypatch: pytest.MonkeyPatch) -> None:
    # Order-blind and chain-blind: [1, 2, 3, 4] and [4, 3, 2, 1] collide, and so do repeated blocks.
    def weak_hash(seed: int, parent: bytes | None, token_ids: list[int]) -> bytes:
        return str(sum(token_ids)).encode()

    monkeypatch.setattr(prefix_hash_module, "hash_block_tokens", weak_hash)
    bm = BlockManager(num_blocks=16, block_size=4, hash_seed=0)
    a = make_seq("a", [1, 2, 3, 4, 99])
    compute_all(bm, a)

    reversed_block = make_seq("rev", [4, 3, 2, 1, 99])
    assert bm.num_prefix_hit_tokens(reversed_block) == 0
    assert bm.allocate(reversed_block, 5)
    assert bm.stats().rejected_hits == 1
    assert reversed_block.block_table[0] != a.block_table[0]

    genuine = make_seq("genuine", [1, 2, 3, 4, 7])
    assert bm.allocate(genuine, 1)
    assert genuine.num_cached_tokens == 4 and genuine.block_table[0] == a.block_table[0]
    for s in (a, reversed_block, genuine):
        bm.free(s)
    assert_drained(bm)

    # The second block of `rep` collides with its first; the entry left behind is the second block,
    # whose K/V belong after [1, 2, 3, 4]. A sequence starting with [1, 2, 3, 4] must not get it.
    rep = make_seq("rep", [1, 2, 3, 4, 1, 2, 3, 4, 0])
    compute_all(bm, rep)
    probe = make_seq("probe", [1, 2, 3, 4, 5, 6])
    assert bm.num_prefix_hit_tokens(probe) == 0
    bm.free(rep)
    assert_drained(bm)


def test_lru_eviction_order_and_revival() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, hash_seed=5)
    a = make_seq("a", [1, 2, 3, 4])
    b = make_seq("b", [5, 6, 7, 8])
    compute_all(bm, a)
    compute_all(bm, b)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 0
    bm.free(a)
    bm.free(b)
    assert bm.num_evictable_blocks == 4 and bm.num_free_blocks == 4
    assert_drained(bm)

    a_again = make_seq("a2", [1, 2, 3, 4, 0])
    b_again = make_seq("b2", [5, 6, 7, 8, 0])
    c = make_seq("c", [9, 10])
    assert bm.allocate(c, 2)
    # a was freed first, tail block first: its second block is the one evicted.
    assert c.block_table == [1]
    assert bm.num_prefix_hit_tokens(a_again) == 2 and bm.num_prefix_hit_tokens(b_again) == 4
    d = make_seq("d", [11, 12])
    assert bm.allocate(d, 2)
    assert bm.num_prefix_hit_tokens(a_again) == 0 and bm.num_prefix_hit_tokens(b_again) == 4
    bm.check_integrity()

    # b2 needs its 2 cached blocks (revived off the free queue) plus one new block: none left.
    assert bm.num_free_blocks == 2
    assert not bm.allocate(b_again, 1)
    assert bm.num_free_blocks == 2 and bm.num_evictable_blocks == 2 and not bm.holds(b_again)
    bm.free(c)
    assert bm.allocate(b_again, 1)
    assert b_again.num_cached_tokens == 4 and b_again.block_table == [2, 3, 1]
    assert bm.num_free_blocks == 0
    bm.check_integrity()
    for s in (d, b_again):
        bm.free(s)
    assert_drained(bm)


def test_duplicate_blocks_computed_concurrently_keep_chain_findable() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, hash_seed=9)
    prompt = list(range(8))
    a = make_seq("a", prompt + [100, 101, 102, 103, 1])
    b = make_seq("b", prompt + [200, 201, 202, 203, 1])
    # Both are allocated before either commits, so both compute the shared prefix themselves.
    assert bm.allocate(a, a.num_tokens) and bm.allocate(b, b.num_tokens)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        assert bm.commit(s) == (3 if s is a else 1)  # b's first two blocks duplicate a's
        bm.check_integrity()
    probe = make_seq("probe", prompt + [200, 201, 202, 203, 5])
    assert bm.allocate(probe, 1)
    assert probe.num_cached_tokens == 12
    assert probe.block_table[:2] == a.block_table[:2] and probe.block_table[2] == b.block_table[2]
    for s in (a, b, probe):
        bm.free(s)
    assert_drained(bm)


def test_reservation_for_transferred_kv() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, hash_seed=11)
    local = make_seq("local", list(range(9)))
    compute_all(bm, local)  # caches blocks [0..3] and [4..7]

    # Prompt of 10 tokens plus the first generated token: K/V for 10 tokens, a slot for the 11th.
    remote = make_seq("remote", list(range(10)) + [77])
    res = bm.reserve(remote, 10)
    assert res is not None
    bm.check_integrity()
    assert res.num_cached_blocks == 2 and res.num_cached_tokens == 8
    assert res.cached_block_ids == tuple(local.block_table[:2])
    assert res.block_ids == tuple(remote.block_table) and len(res.block_ids) == 3
    assert res.fill_block_ids == (remote.block_table[2],)
    assert remote.num_computed_tokens == 8 and remote.num_cached_tokens == 8
    assert bm.commit_filled(remote, 10) == 0  # the third block is not full
    assert remote.num_computed_tokens == 10
    bm.check_integrity()

    # Every block of the K/V may hit when nothing is computed locally; the fill list is then empty.
    whole = make_seq("whole", list(range(8)) + [5])
    res = bm.reserve(whole, 8)
    assert res is not None and res.num_cached_blocks == 2 and res.fill_block_ids == ()
    assert len(res.block_ids) == 3

    # A reservation that does not fit changes nothing.
    free_before = bm.num_free_blocks
    big = make_seq("big", [300 + i for i in range(40)])
    assert bm.reserve(big, 39) is None
    assert not bm.holds(big) and big.block_table == [] and bm.num_free_blocks == free_before

    fresh = make_seq("fresh", [400 + i for i in range(8)] + [1])
    res = bm.reserve(fresh, 8)
    assert res is not None and res.num_cached_blocks == 0 and len(res.fill_block_ids) == 2
    assert bm.commit_filled(fresh, 8) == 2
    assert bm.num_prefix_hit_tokens(make_seq("probe", [400 + i for i in range(8)] + [2])) == 8
    with pytest.raises(ValueError):
        bm.commit_filled(fresh, 7)  # cannot un-compute
    for s in (local, remote, whole, fresh):
        bm.free(s)
    assert_drained(bm)


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, hash_seed=0, enable_prefix_caching=False)
    a = make_seq("a", list(range(9)))
    compute_all(bm, a)
    assert bm.num_cached_blocks == 0
    b = make_seq("b", list(range(9)))
    assert bm.num_prefix_hit_tokens(b) == 0
    assert bm.allocate(b, 9) and b.num_cached_tokens == 0
    bm.free(a)
    bm.free(b)
    assert_drained(bm)


def test_misuse_is_refused_and_corruption_is_detected() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, hash_seed=0)
    a = make_seq("a", list(range(6)))
    assert bm.allocate(a, 6)
    twin = make_seq("a", list(range(6)))
    with pytest.raises(ValueError):
        bm.allocate(twin, 1)  # same id, another object
    stale = make_seq("stale", [1, 2, 3])
    stale.num_computed_tokens = 2
    with pytest.raises(ValueError):
        bm.allocate(stale, 1)
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=4, hash_seed=0)

    a.block_table.append(3)  # a block the manager never gave it
    with pytest.raises(AssertionError):
        bm.check_integrity()
    a.block_table.pop()
    bm.check_integrity()
    bm.free(a)
    assert_drained(bm)


def test_randomized_operations_keep_every_invariant() -> None:
    rng = random.Random(1234)
    bs = 4
    bm = BlockManager(num_blocks=24, block_size=bs, hash_seed=77)
    # Slot contents stand in for K/V: a hit must find exactly the sequence's own tokens there.
    slots: dict[int, int] = {}
    bases = [[rng.randrange(5) for _ in range(24)] for _ in range(3)]
    live: list[Sequence] = []
    counters = {"alloc_fail": 0, "reserve_fail": 0, "hit_tokens": 0, "finished": 0}
    next_id = 0

    def write(seq: Sequence, start: int, stop: int) -> None:
        for p in range(start, stop):
            slots[seq.block_table[p // bs] * bs + p % bs] = seq.token_ids[p]

    def verify_kv(seq: Sequence) -> None:
        for p in range(seq.num_computed_tokens):
            assert slots[seq.block_table[p // bs] * bs + p % bs] == seq.token_ids[p], (seq.seq_id, p)

    def new_tokens() -> list[int]:
        base = rng.choice(bases)
        return base[: rng.randrange(0, 20)] + [rng.randrange(5) for _ in range(rng.randrange(1, 10))]

    for _ in range(3000):
        op = rng.random()
        if op < 0.25 or not live:
            seq = make_seq(f"s{next_id}", new_tokens())
            next_id += 1
            hit = bm.num_prefix_hit_tokens(seq)
            free_before = bm.num_free_blocks
            if bm.allocate(seq, rng.randint(1, seq.num_tokens - hit)):
                assert seq.num_computed_tokens == hit == seq.num_cached_tokens
                counters["hit_tokens"] += hit
                verify_kv(seq)
                live.append(seq)
            else:
                counters["alloc_fail"] += 1
                assert not bm.holds(seq) and seq.block_table == [] and seq.num_computed_tokens == 0
                assert bm.num_free_blocks == free_before
        elif op < 0.33:
            seq = make_seq(f"s{next_id}", new_tokens() + [rng.randrange(5)])
            next_id += 1
            num_kv = rng.randint(1, seq.num_tokens)
            res = bm.reserve(seq, num_kv)
            if res is None:
                counters["reserve_fail"] += 1
                assert not bm.holds(seq)
            else:
                verify_kv(seq)
                write(seq, res.num_cached_tokens, num_kv)
                bm.commit_filled(seq, num_kv)
                verify_kv(seq)
                live.append(seq)
        elif op < 0.80:
            seq = rng.choice(live)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(rng.randrange(5))
            start = seq.num_computed_tokens
            capacity = len(seq.block_table) * bs - start
            n = rng.randint(1, seq.num_tokens - start) if rng.random() < 0.5 else 0
            if n and not bm.allocate(seq, n):
                counters["alloc_fail"] += 1
                n = 0
            n = n or min(capacity, seq.num_tokens - start)
            if n:
                write(seq, start, start + n)
                seq.num_computed_tokens += n
                bm.commit(seq)
                verify_kv(seq)
        else:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
            counters["finished"] += 1
        bm.check_integrity()
        assert sum(1 for s in live for _ in s.block_table) >= bm.num_used_blocks

    for seq in live:
        bm.free(seq)
    assert_drained(bm)
    assert bm.num_evictable_blocks == bm.num_cached_blocks > 0
    # The run must actually have exercised hits, pressure and both failure paths.
    assert counters["hit_tokens"] > 100 and counters["alloc_fail"] > 10 and counters["reserve_fail"] > 0
    assert bm.stats().hit_tokens >= counters["hit_tokens"]
