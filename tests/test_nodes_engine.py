"""The engine side of the nodes, in one process: prefill-only requests that hold their blocks, reserved
requests that receive prompt K/V and a first token from elsewhere, and the asyncio engine thread
(batched deltas, commands between steps, no spinning when idle). KV moves between the two engines by
plain tensor copies here; the node tests move it over real channels."""

from __future__ import annotations

import asyncio
import random
import resource
import time
from collections.abc import Awaitable, Callable

import pytest

from pdserve.engine.async_engine import AsyncEngine, RequestStream
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tiny import default_model_dir
from testing.waits import wait_until_async

pytestmark = pytest.mark.timeout(120)


def make_engine(num_blocks: int = 64) -> LLMEngine:
    cfg = EngineConfig(model=str(default_model_dir("llama")), dtype="float32", num_kv_blocks=num_blocks, num_threads=1)
    return LLMEngine(cfg)


def clean(engine: LLMEngine) -> None:
    engine.scheduler.check_integrity()
    load = engine.load()
    assert load.kv_blocks_used == 0 and load.held_blocks == 0 and load.reserved_blocks == 0, load
    assert not engine.has_unfinished()


def handoff(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """One disaggregated request between two engines; returns its generated tokens."""
    reservation = decode.reserve(rid, prompt, params)
    assert reservation is not None
    import dataclasses

    prefill.add_request(rid, prompt, dataclasses.replace(params, max_tokens=1, stop=[]), hold_blocks=True)
    outs = []
    while prefill.has_unfinished():
        outs += prefill.step()
    (first,) = outs
    assert first.finished and prefill.load().held_requests == 1
    table = prefill.held_block_table(rid)
    src = table[reservation.num_cached_blocks : reservation.num_cached_blocks + len(reservation.fill_block_ids)]
    decode.kv_cache[:, :, list(reservation.fill_block_ids)] = prefill.kv_cache[:, :, src]
    assert prefill.release(rid) and not prefill.release(rid)
    out = decode.append_first_token(rid, first.new_token_ids[0], first.new_logprobs[0] if first.new_logprobs else None)
    tokens = list(out.new_token_ids)
    if out.finished:
        assert decode.release(rid)
        return tokens
    decode.land(rid)
    while decode.has_unfinished():
        for o in decode.step():
            tokens += o.new_token_ids
    return tokens


def test_handoff_matches_single_engine_and_frees_everything() -> None:
    prefill, decode, single = make_engine(), make_engine(), make_engine()
    rng = random.Random(3)
    shared = [rng.randrange(5, 4000) for _ in range(32)]
    cases = [
        ([rng.randrange(5, 4000) for _ in range(45)], SamplingParams(max_tokens=7, ignore_eos=True)),
        (shared + [rng.randrange(5, 4000) for _ in range(20)], SamplingParams(max_tokens=5, ignore_eos=True)),
        # Decode-side prefix hit on the shared blocks: only the rest is copied.
        (shared + [rng.randrange(5, 4000) for _ in range(17)], SamplingParams(max_tokens=5, ignore_eos=True)),
        ([rng.randrange(5, 4000) for _ in range(30)], SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)),
        ([rng.randrange(5, 4000) for _ in range(20)], SamplingParams(max_tokens=1)),
    ]
    for i, (prompt, params) in enumerate(cases):
        got = handoff(prefill, decode, f"r{i}", prompt, params)
        assert got == single.generate([prompt], params)[0].token_ids, f"case {i}"
    clean(prefill)
    clean(decode)


def test_abort_frees_held_reserved_and_queued_requests() -> None:
    engine = make_engine()
    prompt = list(range(5, 60))
    engine.add_request("held", prompt, SamplingParams(max_tokens=1), hold_blocks=True)
    while engine.has_unfinished():
        engine.step()
    assert engine.load().held_blocks > 0
    assert engine.reserve("reserved", list(range(100, 150)), SamplingParams()) is not None
    engine.add_request("queued", list(range(200, 240)), SamplingParams())
    with pytest.raises(ValueError):
        engine.add_request("held", prompt, SamplingParams())  # the id is still taken while held
    assert engine.abort("held") and engine.abort("reserved") and engine.abort("queued")
    assert not engine.abort("queued")
    clean(engine)


def run_on_async_engine(body: Callable[[AsyncEngine], Awaitable[None]]) -> None:
    """Runs `body` on a fresh started AsyncEngine, closes it and checks it is clean, all within a minute."""

    async def run() -> None:
        engine = AsyncEngine(make_engine(), name="t")
        engine.start()
        try:
            await body(engine)
        finally:
            await engine.close()
        clean(engine.engine)

    start = time.monotonic()
    asyncio.run(run())
    assert time.monotonic() - start < 60


async def read_to_the_end(stream: RequestStream) -> list[RequestOutput]:
    """Every output still to come on `stream`, up to the finished one."""
    outs: list[RequestOutput] = []
    while not outs or not outs[-1].finished:
        outs += await stream.next_batch()
    return outs


def test_async_engine_streams_tokens_that_pile_up_as_one_batch() -> None:
    async def body(engine: AsyncEngine) -> None:
        stream = await engine.add_request("a", list(range(5, 40)), SamplingParams(max_tokens=40, ignore_eos=True))
        # Several tokens pile up before the first read: they come out as one batch.
        await wait_until_async(lambda: stream.queue.qsize() > 1, 30, "two outputs queued")
        batch = await stream.next_batch()
        tokens = sum(len(o.new_token_ids) for o in batch)
        assert len(batch) > 1
        while not stream.finished or not stream.queue.empty():
            batch = await stream.next_batch()
            tokens += sum(len(o.new_token_ids) for o in batch)
        assert tokens == 40 and batch[-1].finished

    run_on_async_engine(body)


def test_async_engine_abort_ends_the_stream_and_frees_the_blocks() -> None:
    async def body(engine: AsyncEngine) -> None:
        stream = await engine.add_request("b", list(range(5, 40)), SamplingParams(max_tokens=500, ignore_eos=True))
        await stream.next_batch()
        assert await engine.abort("b")
        outs = await read_to_the_end(stream)
        assert outs[-1].finish_reason == "abort"
        assert engine.load().kv_blocks_used == 0

    run_on_async_engine(body)


def test_async_engine_sleeps_when_idle() -> None:
    async def body(engine: AsyncEngine) -> None:
        # Idle after serving a request: the engine thread sleeps on its condition variable.
        await read_to_the_end(await engine.add_request("a", list(range(5, 40)), SamplingParams(max_tokens=4)))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_utime
        await asyncio.sleep(0.5)  # the idle window measured (time passing is the test)
        assert resource.getrusage(resource.RUSAGE_SELF).ru_utime - before < 0.1

    run_on_async_engine(body)
