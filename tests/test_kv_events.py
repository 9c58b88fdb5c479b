"""KV events and the frontend's index of them (engine.kv_events, node_common.drain.kv_event_messages,
frontend.kv_index): numbered batches per node run, snapshots when a cursor cannot be continued, gaps
refused, the bound, and the overlap routing reads (a pool run, then a tier run)."""

from __future__ import annotations

from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_events import DISK, POOL, KVEventLog
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.frontend.kv_index import KVIndex, Overlap
from pdserve.node_common.drain import kv_event_messages
from pdserve.rpc import pdserve_pb2 as pb

H = [bytes([i]) * 16 for i in range(10)]


def stream(log: KVEventLog, epoch: str, seq: int) -> list[pb.KVEventBatch]:
    return list(kv_event_messages(log.epoch, *log.since(epoch, seq)))


def test_batches_resume_from_a_cursor_and_a_stale_cursor_gets_a_snapshot() -> None:
    log = KVEventLog(capacity=3)
    first = stream(log, "", 0)
    assert len(first) == 2 and first[0].snapshot and not any(m.events[0].block_hashes for m in first)
    log.record(True, POOL, H[0])
    log.record(True, POOL, H[1])
    log.record(True, POOL, H[1])  # no change: no event
    log.record(True, DISK, H[0])
    (b1,) = stream(log, log.epoch, 0)
    assert b1.seq == 1 and not b1.snapshot
    assert [(e.stored, e.tier, list(e.block_hashes)) for e in b1.events] == [
        (True, pb.KV_TIER_POOL, [H[0], H[1]]), (True, pb.KV_TIER_DISK, [H[0]])]
    for i in range(2, 6):
        log.record(True, POOL, H[i])
        stream(log, log.epoch, i - 1)  # each poll seals a batch
    log.record(False, POOL, H[3])
    stream(log, log.epoch, 5)  # batch 6
    assert [m.seq for m in stream(log, log.epoch, 4)] == [5, 6]  # within the last 3 batches: continued
    snap = stream(log, log.epoch, 2)  # batch 3 was dropped: a snapshot of everything held
    assert snap[0].snapshot and {m.seq for m in snap} == {6}
    held = {(e.tier, h) for m in snap for e in m.events for h in e.block_hashes}
    assert held == {(pb.KV_TIER_POOL, h) for h in (H[0], H[1], H[2], H[4], H[5])} | {(pb.KV_TIER_DISK, H[0])}
    assert stream(log, "another-run", 6)[0].snapshot  # a restarted node's epoch differs


def test_the_index_applies_snapshots_and_batches_and_refuses_a_gap() -> None:
    log, index = KVEventLog(), KVIndex()
    for m in stream(log, "", 0):
        assert index.apply("d0", m)
    for h in H[:4]:
        log.record(True, POOL, h)
    log.record(True, DISK, H[4])
    for m in stream(log, *index.cursor("d0")):
        assert index.apply("d0", m)
    assert index.overlap("d0", H[:6]) == Overlap(pool=4, disk=1)
    assert index.overlap("d0", [H[9], *H[:4]]) == Overlap()  # a prefix, not any blocks
    log.record(False, POOL, H[1])  # the pool run now ends after one block; the tier does not hold H[1]
    for m in stream(log, *index.cursor("d0")):
        index.apply("d0", m)
    assert index.overlap("d0", H[:6]) == Overlap(pool=1, disk=0)
    epoch, seq = index.cursor("d0")
    assert not index.apply("d0", pb.KVEventBatch(epoch=epoch, seq=seq + 5))  # a lost batch: a gap
    assert index.cursor("d0") == ("", 0) and index.overlap("d0", H[:6]) == Overlap() and index.gaps == 1
    for m in stream(log, *index.cursor("d0")):  # reopened from nothing: a snapshot
        assert index.apply("d0", m)
    assert index.overlap("d0", H[:6]) == Overlap(pool=1, disk=0) and index.resyncs == 2


def test_a_node_over_the_bound_is_not_trusted_until_a_snapshot_fits() -> None:
    log, index = KVEventLog(), KVIndex(max_blocks=3)
    for m in stream(log, "", 0):
        index.apply("d0", m)
    for h in H[:5]:
        log.record(True, POOL, h)
    for m in stream(log, *index.cursor("d0")):
        index.apply("d0", m)
    assert index.overlap("d0", H[:2]) == Overlap() and index.holds("d0") == 0
    for h in H[2:5]:
        log.record(False, POOL, h)
    for m in stream(log, "", 0):  # a snapshot of 2 blocks fits
        index.apply("d0", m)
    assert index.overlap("d0", H[:2]) == Overlap(pool=2)


def test_an_engine_reports_what_its_pool_and_tier_hold(tiny_llama_dir: Path, tmp_path: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=12, block_size=16,
                                    num_threads=1, kv_tier_dir=str(tmp_path / "tier")))
    prompt = list(range(3, 3 + 4 * 16 + 1))
    engine.generate([prompt], SamplingParams(max_tokens=2))
    engine.kv_tier.flush()
    hashes = engine.block_manager.block_hashes(prompt)[:4]
    assert set(hashes) <= engine.kv_events.held(POOL) and set(hashes) <= engine.kv_events.held(DISK)
    for seed in range(3):  # other prompts evict these from the pool; the tier keeps them
        engine.generate([[(seed * 97 + i * 31) % 3000 + 3 for i in range(65)]], SamplingParams(max_tokens=2))
    engine.kv_tier.flush()
    assert not set(hashes) & engine.kv_events.held(POOL) and set(hashes) <= engine.kv_events.held(DISK)
    index = KVIndex()
    for m in stream(engine.kv_events, "", 0):
        index.apply("n", m)
    assert index.overlap("n", hashes) == Overlap(pool=0, disk=4)
    engine.close()
