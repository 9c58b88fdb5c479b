from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from pdserve.engine.batch import SchedulerConfig, SchedulerOutput
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus

TokenFn = Callable[[list[int]], int]


def mixing_token(context: list[int]) -> int:
    """A deterministic stand-in for the model: the next token depends on every token of the context."""
    acc = 17
    for t in context:
        acc = (acc * 1_000_003 + t) % 2_147_483_647
    return 10 + acc % 990  # ids below 10 are left for EOS / stop ids in the tests


def expected_completion(prompt: list[int], max_tokens: int, next_token: TokenFn = mixing_token) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


@dataclass(eq=False)
class FakeRunner:
    """Runs a step the way a model runner would, with tokens standing in for K/V: each computed
    position writes its token into its cache slot, and sampling reads the whole context back from the
    slots, so a wrong prefix hit, a lost block or a bad chunk boundary changes the output."""

    block_manager: BlockManager
    next_token: TokenFn = mixing_token
    slots: dict[int, int] = field(default_factory=dict)

    def slot(self, seq: Sequence, pos: int) -> int:
        bs = self.block_manager.block_size
        return seq.block_table[pos // bs] * bs + pos % bs

    def run(self, out: SchedulerOutput) -> dict[str, int]:
        for seq in out.decode_seqs:
            assert seq.num_computed_tokens == seq.num_tokens - 1
        work = [(s, 1) for s in out.decode_seqs] + list(
            zip(out.prefill_seqs, out.prefill_chunk_lens, strict=True)
        )
        sampled: dict[str, int] = {}
        for seq, n in work:
            start = seq.num_computed_tokens
            assert n >= 1 and start + n <= seq.num_tokens
            assert len(seq.block_table) * self.block_manager.block_size >= start + n
            for pos in range(start, start + n):
                self.slots[self.slot(seq, pos)] = seq.token_ids[pos]
            if start + n == seq.num_tokens:
                context = [self.slots[self.slot(seq, p)] for p in range(seq.num_tokens)]
                assert context == seq.token_ids, f"{seq.seq_id} reads K/V of other tokens"
                sampled[seq.seq_id] = self.next_token(context)
        assert set(sampled) == {s.seq_id for s in out.sampled_seqs()}
        return sampled


def check_output(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg = sched.config
    scheduled = out.decode_seqs + out.prefill_seqs
    assert len({id(s) for s in scheduled}) == len(scheduled)
    assert out.num_batched_tokens == len(out.decode_seqs) + sum(out.prefill_chunk_lens)
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(scheduled) <= cfg.max_num_seqs and sched.num_running <= cfg.max_running
    assert all(s.status == SequenceStatus.RUNNING for s in scheduled)
    assert all(s.status == SequenceStatus.WAITING and not s.block_table for s in out.preempted)
    if cfg.max_prefill_chunk:
        assert all(n <= cfg.max_prefill_chunk for n in out.prefill_chunk_lens)


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Sequence]]:
    out = sched.schedule()
    check_output(sched, out)
    finished = sched.update(out, runner.run(out))
    sched.check_integrity()
    return out, finished


def drive(sched: Scheduler, runner: FakeRunner, max_steps: int = 5000) -> list[Sequence]:
    finished: list[Sequence] = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return finished
        finished += step(sched, runner)[1]
    raise AssertionError("scheduler made no progress")


def assert_drained(sched: Scheduler) -> None:
    sched.check_integrity()
    bm = sched.block_manager
    assert not sched.has_unfinished() and sched.num_running == 0 and sched.num_waiting == 0
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    assert bm.num_evictable_blocks == bm.num_cached_blocks


def make(num_blocks: int = 64, block_size: int = 4, **cfg: int) -> tuple[Scheduler, FakeRunner]:
    bm = BlockManager(num_blocks=num_blocks, block_size=block_size, hash_seed=2024)
    sched = Scheduler(bm, **cfg)
    return sched, FakeRunner(bm)


def make_seq(seq_id: str, prompt: list[int], max_tokens: int = 8, **params: object) -> Sequence:
    return Sequence(seq_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params))  # type: ignore[arg-type]


def test_config_is_validated() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, hash_seed=0)
    with pytest.raises(ValueError):
        Scheduler(bm, max_num_seqs=0)
    with pytest.raises(ValueError):
        Scheduler(bm, max_num_batched_tokens=0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_prefill_chunk=-1)
    # A budget below max_num_seqs caps the running set, so every running sequence can decode each step.
    assert SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=64).max_running == 64


@pytest.mark.parametrize(("max_num_seqs", "budget"), [(4, 16), (8, 4)])
def test_budget_and_max_num_seqs_respected_and_outputs_exact(max_num_seqs: int, budget: int) -> None:
    rng = random.Random(7)
    sched, runner = make(num_blocks=128, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    seqs = []
    for i in range(12):
        prompt = [rng.randrange(10, 1000) for _ in range(rng.randint(1, 2 * budget))]
        seqs.append(make_seq(f"r{i}", prompt, max_tokens=rng.randint(1, 10)))
        sched.add(seqs[-1])
    assert sched.num_waiting == 12
    max_running = 0
    while sched.has_unfinished():
        out, _ = step(sched, runner)
        max_running = max(max_running, len(out.decode_seqs) + len(out.prefill_seqs), sched.num_running)
    assert max_running == min(max_num_seqs, budget)
    for seq in seqs:
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        assert seq.completion_token_ids == expected_completion(prompt, seq.params.max_tokens)
        assert seq.finish_reason == "length" and seq.is_finished
    assert_drained(sched)


def test_long_prompt_is_prefilled_in_chunks() -> None:
    sched, runner = make(max_num_seqs=2, max_num_batched_tokens=16)
    seq = make_seq("long", list(range(100, 150)), max_tokens=3)
    sched.add(seq)
    chunks, backlog = [], [sched.prefill_backlog_tokens()]
    for _ in range(4):
        out, finished = step(sched, runner)
        assert out.decode_seqs == [] and out.prefill_seqs == [seq]
        chunks.append(out.prefill_chunk_lens[0])
        backlog.append(sched.prefill_backlog_tokens())
        assert not finished
    assert chunks == [16, 16, 16, 2]
    assert backlog == [50, 34, 18, 2, 0]  # a decoding sequence has nothing left to prefill
    assert seq.num_completion_tokens == 1  # sampled only once the last chunk reached the end
    out, _ = step(sched, runner)
    assert out.decode_seqs == [seq] and out.prefill_seqs == []
    drive(sched, runner)
    assert seq.completion_token_ids == expected_completion(list(range(100, 150)), 3)
    assert_drained(sched)


def test_prefill_chunk_cap_shares_the_budget() -> None:
    sched, runner = make(max_num_seqs=4, max_num_batched_tokens=16, max_prefill_chunk=8)
    a = make_seq("a", list(range(100, 130)), max_tokens=2)
    b = make_seq("b", list(range(200, 230)), max_tokens=2)
    sched.add(a)
    sched.add(b)
    out, _ = step(sched, runner)
    assert out.prefill_seqs == [a, b] and out.prefill_chunk_lens == [8, 8]
    drive(sched, runner)
    assert a.completion_token_ids == expected_completion(list(range(100, 130)), 2)
    assert b.completion_token_ids == expected_completion(list(range(200, 230)), 2)
    assert_drained(sched)


def test_decodes_are_scheduled_before_prefills() -> None:
    sched, runner = make(max_num_seqs=4, max_num_batched_tokens=16)
    a = make_seq("a", [11, 12, 13], max_tokens=6)
    sched.add(a)
    step(sched, runner)
    b = make_seq("b", list(range(100, 140)), max_tokens=2)
    sched.add(b)
    out, _ = step(sched, runner)
    assert out.decode_seqs == [a] and out.prefill_seqs == [b] and out.prefill_chunk_lens == [15]
    # A partial prefill still running goes before new waiting requests.
    c = make_seq("c", list(range(300, 320)), max_tokens=2)
    sched.add(c)
    out, _ = step(sched, runner)
    assert out.decode_seqs == [a] and out.prefill_seqs == [b] and out.prefill_chunk_lens == [15]
    out, _ = step(sched, runner)
    assert out.decode_seqs == [a] and out.prefill_seqs == [b, c] and out.prefill_chunk_lens == [10, 5]
    drive(sched, runner)
    assert_drained(sched)


def test_preemption_on_a_tiny_pool_recomputes_and_finishes_everything() -> None:
    rng = random.Random(11)
    sched, runner = make(num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    seqs = []
    for i in range(6):
        prompt = [rng.randrange(10, 1000) for _ in range(rng.randint(6, 12))]
        seqs.append(make_seq(f"r{i}", prompt, max_tokens=rng.randint(8, 14)))
        sched.add(seqs[-1])
    num_preempted = 0
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        before = sched.running_seqs
        out, _ = step(sched, runner)
        num_preempted += len(out.preempted)
        survivors = [s for s in before if s.status == SequenceStatus.RUNNING]
        for victim in out.preempted:
            # Only the newest running sequences are preempted, newest first.
            assert all(before.index(s) < before.index(victim) for s in survivors)
            assert sched.waiting_seqs[: len(out.preempted)] == tuple(reversed(out.preempted))
    assert num_preempted > 0 and sched.num_preemptions == num_preempted == sum(
        s.num_preemptions for s in seqs
    )
    for seq in seqs:
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        assert seq.completion_token_ids == expected_completion(prompt, seq.params.max_tokens)
        assert seq.finish_reason == "length"
    assert sched.block_manager.stats().hit_tokens > 0  # recomputation reused committed blocks
    assert_drained(sched)


def test_newest_decode_is_preempted_for_an_older_partial_prefill() -> None:
    sched, runner = make(
        num_blocks=6, block_size=4, max_num_seqs=2, max_num_batched_tokens=8, max_prefill_chunk=5
    )
    old = make_seq("old", list(range(100, 120)), max_tokens=1)  # 20 tokens: 5 blocks, 4 chunks
    new = make_seq("new", [11, 12, 13], max_tokens=4)
    sched.add(old)
    out, _ = step(sched, runner)
    assert out.prefill_chunk_lens == [5]
    sched.add(new)
    out, _ = step(sched, runner)
    assert out.prefill_seqs == [old, new] and out.prefill_chunk_lens == [5, 3]
    out, _ = step(sched, runner)
    assert out.decode_seqs == [new] and out.prefill_seqs == [old]
    assert sched.block_manager.num_free_blocks == 1
    # new's decode needs a second block and old its fifth: one is free, and new is the newer one,
    # so new is unscheduled and preempted although it was picked first as a decode.
    out, _ = step(sched, runner)
    assert out.preempted == [new] and out.decode_seqs == [] and out.prefill_seqs == [old]
    assert new.num_preemptions == 1 and new.num_computed_tokens == 0 and new.num_completion_tokens == 2
    assert out.num_batched_tokens == 5
    drive(sched, runner)
    assert new.completion_token_ids == expected_completion([11, 12, 13], 4)
    assert old.completion_token_ids == expected_completion(list(range(100, 120)), 1)
    assert_drained(sched)


def test_abort_in_every_state_frees_everything() -> None:
    sched, runner = make(num_blocks=32, block_size=4, max_num_seqs=3, max_num_batched_tokens=8)
    bm = sched.block_manager
    decoding = make_seq("decoding", [11, 12, 13], max_tokens=50)
    prefilling = make_seq("prefilling", list(range(100, 140)), max_tokens=50)
    sched.add(decoding)
    step(sched, runner)
    sched.add(prefilling)
    step(sched, runner)
    assert decoding.num_completion_tokens >= 1 and prefilling.is_prefilling

    transferred = make_seq("transferred", list(range(200, 209)), max_tokens=50)
    res = sched.reserve(transferred)
    assert res is not None and transferred.status == SequenceStatus.RESERVED
    for pos in range(res.num_cached_tokens, 9):
        runner.slots[runner.slot(transferred, pos)] = transferred.token_ids[pos]
    assert sched.append_first_token("transferred", 7) is None
    sched.land("transferred")
    in_flight = make_seq("in_flight", [21, 22], max_tokens=50)
    sched.add(in_flight)
    waiting = make_seq("waiting", [31, 32, 33], max_tokens=50)
    sched.add(waiting)

    out = sched.schedule()  # admits transferred (3rd slot); in_flight and waiting must wait
    check_output(sched, out)
    assert transferred in out.decode_seqs and sched.num_waiting == 2
    sampled = runner.run(out)
    aborted = sched.abort("transferred")  # between schedule and update
    assert aborted is transferred and transferred.finish_reason == "abort" and not bm.holds(transferred)
    finished = sched.update(out, sampled)
    assert transferred not in finished and transferred.num_tokens == 10  # its sampled token is dropped
    sched.check_integrity()

    for seq in (waiting, prefilling, decoding, in_flight):
        assert sched.abort(seq.seq_id) is seq
        assert seq.status == SequenceStatus.FINISHED and seq.finish_reason == "abort"
        assert seq.block_table == [] and not bm.holds(seq)
        sched.check_integrity()
    assert sched.abort("decoding") is None and sched.abort("nobody") is None
    assert sched.schedule().is_empty
    assert_drained(sched)


def test_abort_a_transferred_sequence_before_it_runs() -> None:
    sched, runner = make(num_blocks=16, max_num_seqs=1, max_num_batched_tokens=8)
    bm = sched.block_manager
    running = make_seq("running", [11, 12], max_tokens=5)
    sched.add(running)
    step(sched, runner)
    parked = make_seq("parked", [1, 2, 3, 4], max_tokens=5)
    assert sched.reserve(parked) is not None
    assert sched.append_first_token("parked", 5) is None
    sched.land("parked")
    out, _ = step(sched, runner)  # no running slot for it
    assert parked not in out.decode_seqs and parked.status == SequenceStatus.WAITING and bm.holds(parked)
    assert sched.abort("parked") is parked and not bm.holds(parked)
    drive(sched, runner)
    assert_drained(sched)


def test_stop_rules() -> None:
    eos, stop_id = 2, 5

    def scripted(script: list[int]) -> TokenFn:
        return lambda ctx: script[len(ctx) - 3]  # every prompt below has 3 tokens

    cases = [
        # (params, script, expected completion, finish_reason, stop_reason)
        ({}, [40, 41, eos, 43], [40, 41, eos], "stop", None),
        ({"ignore_eos": True}, [40, eos, 41, eos], [40, eos, 41, eos], "length", None),
        ({"stop_token_ids": [stop_id]}, [40, stop_id, 41, 42], [40, stop_id], "stop", stop_id),
        (
            {"stop_token_ids": [stop_id], "ignore_eos": True},
            [eos, stop_id, 41, 42],
            [eos, stop_id],
            "stop",
            stop_id,
        ),
        ({"max_tokens": 1}, [40, 41, 42, 43], [40], "length", None),
        ({}, [40, 41, 42, 43], [40, 41, 42, 43], "length", None),
        ({"max_tokens": 3}, [40, 41, eos, 43], [40, 41, eos], "stop", None),  # stop wins over length
    ]
    for params, script, completion, reason, stop_reason in cases:
        sched, runner = make()
        runner.next_token = scripted(script)
        kwargs = {"max_tokens": 4, **params}
        seq = Sequence("s", [100, 101, 102], SamplingParams(**kwargs), eos_token_ids=frozenset({eos}))  # type: ignore[arg-type]
        sched.add(seq)
        finished = drive(sched, runner)
        assert finished == [seq], params
        assert seq.completion_token_ids == completion, params
        assert (seq.finish_reason, seq.stop_reason) == (reason, stop_reason), params
        assert_drained(sched)


def test_prompt_that_never_fits_is_rejected_and_others_proceed() -> None:
    sched, runner = make(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    too_big = make_seq("too_big", list(range(100, 117)))  # 17 tokens: 5 blocks of a 4-block pool
    fine = make_seq("fine", [11, 12, 13], max_tokens=3)
    sched.add(too_big)
    sched.add(fine)
    out = sched.schedule()
    assert out.rejected == [too_big] and out.prefill_seqs == [fine]
    assert too_big.finish_reason == "abort" and too_big.is_finished and too_big.num_completion_tokens == 0
    finished = sched.update(out, runner.run(out))
    assert finished == [too_big]
    drive(sched, runner)
    assert fine.completion_token_ids == expected_completion([11, 12, 13], 3)
    assert_drained(sched)


def test_sequence_outgrowing_the_pool_finishes_with_length() -> None:
    sched, runner = make(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    seq = make_seq("grows", list(range(100, 110)), max_tokens=50)
    sched.add(seq)
    finished = drive(sched, runner)
    assert finished == [seq] and seq.finish_reason == "length" and seq.num_preemptions == 1
    # 16 slots: the token sampled from position 15 is the last one it can hold a step for.
    assert seq.num_tokens == 17
    assert seq.completion_token_ids == expected_completion(list(range(100, 110)), 7)
    assert_drained(sched)


def test_transferred_sequence_goes_straight_to_decoding() -> None:
    sched, runner = make(num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    prompt = list(range(100, 110))
    first = mixing_token(prompt)  # what the prefill node sampled
    seq = make_seq("remote", prompt, max_tokens=5)
    res = sched.reserve(seq)
    assert res is not None and res.num_cached_blocks == 0 and len(res.fill_block_ids) == 3
    for pos in range(len(prompt)):  # the transfer writes the prompt K/V into the fill blocks
        runner.slots[runner.slot(seq, pos)] = prompt[pos]
    assert not sched.has_unfinished(), "a reserved sequence is never scheduled"
    assert sched.append_first_token("remote", first) is None and seq.num_prompt_tokens == len(prompt)
    sched.land("remote")
    out, _ = step(sched, runner)
    assert out.decode_seqs == [seq] and out.prefill_seqs == [] and out.num_batched_tokens == 1
    drive(sched, runner)
    assert seq.completion_token_ids == expected_completion(prompt, 5)
    assert_drained(sched)

    sched.add(make_seq("unreserved", [1, 2, 3]))
    with pytest.raises(KeyError):
        sched.land("unreserved")


def test_engine_finish_for_a_stop_string() -> None:
    sched, runner = make()
    seq = make_seq("s", [11, 12, 13], max_tokens=10)
    sched.add(seq)
    step(sched, runner)
    step(sched, runner)
    assert seq.status == SequenceStatus.RUNNING and sched.block_manager.holds(seq)
    sched.finish(seq, "stop", stop_reason="###")  # the engine matched a stop string
    assert (seq.finish_reason, seq.stop_reason) == ("stop", "###") and not sched.has_unfinished()
    assert_drained(sched)

    other = make_seq("t", [11, 12, 13], max_tokens=1)
    sched.add(other)
    assert drive(sched, runner) == [other] and other.finish_reason == "length"
    sched.finish(other, "stop", stop_reason="END")  # the last token also completed a stop string
    assert (other.finish_reason, other.stop_reason) == ("stop", "END")
    with pytest.raises(ValueError):
        sched.finish(other, "done")
    assert_drained(sched)


def test_prefix_cache_reuse_across_requests() -> None:
    sched, runner = make(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    system = list(range(500, 516))
    a = make_seq("a", system + [1, 2, 3], max_tokens=4)
    sched.add(a)
    drive(sched, runner)
    b = make_seq("b", system + [7, 8], max_tokens=4)
    sched.add(b)
    out, _ = step(sched, runner)
    assert out.prefill_seqs == [b] and out.prefill_chunk_lens == [2] and b.num_cached_tokens == 16
    drive(sched, runner)
    assert b.completion_token_ids == expected_completion(system + [7, 8], 4)
    assert_drained(sched)


def test_add_rejects_duplicates_and_used_sequences() -> None:
    sched, runner = make()
    seq = make_seq("dup", [1, 2, 3])
    sched.add(seq)
    with pytest.raises(ValueError):
        sched.add(make_seq("dup", [4, 5]))
    used = make_seq("used", [1, 2, 3])
    used.num_computed_tokens = 2
    with pytest.raises(ValueError):
        sched.add(used)
    assert sched.abort("dup") is seq
    assert_drained(sched)


def test_reserved_sequence_ended_by_its_first_token_holds_its_blocks_until_released() -> None:
    sched, _ = make(num_blocks=16, block_size=4)
    bm = sched.block_manager
    seq = make_seq("remote", list(range(100, 110)), max_tokens=1)
    assert sched.reserve(seq) is not None
    with pytest.raises(ValueError):
        sched.reserve(make_seq("remote", [1, 2, 3]))  # the id is taken while reserved
    decision = sched.append_first_token("remote", 42)
    assert decision is not None and decision.finish_reason == "length"
    assert seq.status == SequenceStatus.FINISHED and bm.holds(seq), "a transfer may still be writing its blocks"
    sched.check_integrity()
    with pytest.raises(KeyError):
        sched.land("remote")
    assert sched.release("remote") is seq and not bm.holds(seq)
    aborted = make_seq("aborted", list(range(200, 210)))
    assert sched.reserve(aborted) is not None and sched.abort("aborted") is aborted
    assert aborted.finish_reason == "abort" and not bm.holds(aborted)
    assert_drained(sched)


# --- priorities -----------------------------------------------------------------------------------


def test_waiting_requests_start_in_priority_order_fifo_within_a_priority() -> None:
    sched, runner = make(num_blocks=64, block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    order = [("b1", 5), ("i1", 0), ("b2", 5), ("i2", 0), ("u1", -3)]
    seqs = {name: make_seq(name, [20 + i, 30, 40], max_tokens=1, priority=p) for i, (name, p) in enumerate(order)}
    for seq in seqs.values():
        sched.add(seq)
    assert [s.seq_id for s in sched.waiting_seqs] == ["u1", "i1", "i2", "b1", "b2"]
    started = []
    while sched.has_unfinished():
        out, _ = step(sched, runner)
        started += [s.seq_id for s in out.prefill_seqs]
    assert started == ["u1", "i1", "i2", "b1", "b2"]
    assert_drained(sched)


def test_under_kv_pressure_the_least_urgent_running_sequence_is_preempted_first() -> None:
    rng = random.Random(5)
    sched, runner = make(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = []
    for i in range(4):  # interleaved: batch (1), interactive (0), batch, interactive
        prompt = [rng.randrange(10, 1000) for _ in range(6)]
        seqs.append(make_seq(f"r{i}", prompt, max_tokens=14, priority=1 - i % 2))
        sched.add(seqs[-1])
    preempted: list[Sequence] = []
    while sched.has_unfinished():
        before = [s for s in sched.running_seqs]
        out, _ = step(sched, runner)
        for victim in out.preempted:
            # nothing less urgent was left running when a sequence was preempted
            assert all(s.params.priority <= victim.params.priority for s in before
                       if s.status == SequenceStatus.RUNNING)
        preempted += out.preempted
    assert preempted and all(s.params.priority == 1 for s in preempted[:2])
    assert all(s.num_preemptions == 0 for s in seqs if s.params.priority == 0)
    for seq in seqs:  # preemption and recompute change nothing in the output
        assert seq.completion_token_ids == expected_completion(seq.token_ids[: seq.num_prompt_tokens], 14)
    assert_drained(sched)


def test_an_urgent_request_preempts_less_urgent_running_work_for_blocks_and_slots() -> None:
    sched, runner = make(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    batch = [make_seq(f"b{i}", [10 + i] * 12, max_tokens=20, priority=5) for i in range(2)]
    for seq in batch:
        sched.add(seq)
    step(sched, runner)
    assert sched.num_running == 2  # both slots and 6 of 8 blocks held by batch work
    urgent = make_seq("i0", [77] * 12, max_tokens=2, priority=0)
    sched.add(urgent)
    out, _ = step(sched, runner)
    assert urgent in out.prefill_seqs and out.preempted == [batch[1]]  # the newest batch sequence
    equal = make_seq("b9", [55] * 4, max_tokens=1, priority=5)  # as urgent as the running batch: waits
    sched.add(equal)
    out, _ = step(sched, runner)
    assert equal not in out.prefill_seqs and not out.preempted
    drive(sched, runner)
    for seq in [*batch, urgent, equal]:
        assert seq.completion_token_ids == expected_completion(seq.token_ids[: seq.num_prompt_tokens],
                                                               seq.params.max_tokens)
    assert_drained(sched)
