"""Degradation policies on their own (`frontend.degrade`): the models file's `degrade` key and its errors,
the pressure a pool's load reports make and the thresholds of cap_max_tokens, when a chat may be trimmed
and which turns go first, and the long-prompt lane's order, limit and cancellation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdserve.frontend.config import ConfigError, ModelSpec, load_models_file
from pdserve.frontend.degrade import (
    NO_POLICY,
    CapMaxTokens,
    DegradePolicy,
    Lanes,
    LongPromptLane,
    PoolPressure,
    TrimHistory,
    next_drop,
    parse_degrade,
    pool_pressure,
    pressure_cap,
    trim_allowed,
    under_pressure,
)
from pdserve.frontend.errors import APIError
from pdserve.frontend.models import ModelCatalog
from pdserve.registry.records import NodeCapacity, NodeLoad, NodeRecord
from pdserve.registry.view import Member

# --- the models file -------------------------------------------------------------------------------


def _models_file(tmp_path: Path, model_dir: Path, degrade: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(f"models:\n  - {{name: m, path: '{model_dir}', degrade: {degrade}}}\n")
    return path


def test_the_degrade_key_reads_every_policy(tmp_path: Path, tiny_llama_dir: Path) -> None:
    path = _models_file(tmp_path, tiny_llama_dir, "{cap_max_tokens: {max_tokens: 64, kv_use_above: 0.8, "
                        "queue_above: 8}, trim_history: {default: auto}, long_prompt_lane: {above_tokens: 2048}}")
    (spec,) = load_models_file(path)
    assert spec.degrade == DegradePolicy(CapMaxTokens(64, 0.8, 8), TrimHistory("auto"), LongPromptLane(2048, 1, 64))
    assert parse_degrade({"trim_history": "auto"}).trim_history == TrimHistory("auto")  # the short form
    assert parse_degrade(None) == NO_POLICY and ModelSpec(name="m", path=str(tiny_llama_dir)).degrade == NO_POLICY


@pytest.mark.parametrize(("degrade", "message"), [
    ("[cap_max_tokens]", "degrade must be a mapping of policies"),
    ("{cap_tokens: {max_tokens: 4}}", r"unknown policy\(ies\) \['cap_tokens'\]"),
    ("{cap_max_tokens: {max_tokens: 4}}", "needs kv_use_above or queue_above"),
    ("{cap_max_tokens: {max_tokens: 0, queue_above: 1}}", "max_tokens is required and must be a positive integer"),
    ("{cap_max_tokens: {max_tokens: 4, kv_use_above: 1.5}}", r"kv_use_above must be a number in \[0, 1\]"),
    ("{cap_max_tokens: {max_tokens: 4, queue_above: -1}}", "queue_above must be an integer >= 0"),
    ("{trim_history: sometimes}", "default must be auto or disabled, got 'sometimes'"),
    ("{long_prompt_lane: {above_tokens: 10, max_concurent: 2}}", r"unknown field\(s\) \['max_concurent'\]"),
    ("{long_prompt_lane: {max_concurrent: 2}}", "above_tokens is required"),
])
def test_a_bad_degrade_key_names_the_field(tmp_path: Path, tiny_llama_dir: Path, degrade: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        load_models_file(_models_file(tmp_path, tiny_llama_dir, degrade))
    assert "models[0]" in str(err.value)


def test_set_degrade_puts_a_reloaded_policy_in_force(tiny_llama_dir: Path) -> None:
    catalog = ModelCatalog((ModelSpec(name="m", path=str(tiny_llama_dir)),))
    model = catalog.resolve("m")
    assert model.degrade == NO_POLICY
    policy = parse_degrade({"trim_history": "auto"})
    assert catalog.set_degrade({("m", ""): policy}) == ["m@-: degrade none -> trim_history"]
    assert model.degrade is policy and catalog.set_degrade({("m", ""): policy}) == []


# --- cap_max_tokens --------------------------------------------------------------------------------


def member(node_id: str, role: str = "decode", *, queue: int = 0, used: int = 0, total: int = 100,
           load: bool = True) -> Member:
    rec = NodeRecord(role=role, node_id=node_id, cluster="c", grpc_address=f"{node_id}:1", kv_address="x:1",  # type: ignore[arg-type]
                     model="m", model_fingerprint="abc", dtype="float32", block_size=16, prefix_hash_seed=7,
                     capacity=NodeCapacity(num_kv_blocks=total, max_num_seqs=16, max_num_batched_tokens=512))
    return Member(rec, NodeLoad(queue_len=queue, kv_blocks_used=used, kv_blocks_free=total - used,
                                kv_blocks_total=total) if load else None, 0.0)


def test_pool_pressure_is_the_decode_kv_share_in_use_and_every_reported_queue() -> None:
    decode = [member("d0", used=90, queue=2), member("d1", used=10, queue=1), member("d2", load=False)]
    prefill = [member("p0", "prefill", queue=5)]
    assert pool_pressure(decode, prefill) == PoolPressure(kv_use=100 / 300, queue=8)
    assert pool_pressure([], []) == PoolPressure(0.0, 0)


def test_cap_max_tokens_applies_once_a_threshold_is_reached() -> None:
    kv_only = CapMaxTokens(64, kv_use_above=0.8)
    assert not under_pressure(kv_only, PoolPressure(0.79, 1000))  # the queue is not looked at
    assert under_pressure(kv_only, PoolPressure(0.8, 0))
    both = CapMaxTokens(64, kv_use_above=0.8, queue_above=8)
    assert not under_pressure(both, PoolPressure(0.5, 7))
    assert under_pressure(both, PoolPressure(0.5, 8)) and under_pressure(both, PoolPressure(0.9, 0))
    always = CapMaxTokens(16, queue_above=0)  # a threshold of 0: an idle pool is under it too
    assert under_pressure(always, PoolPressure(0.0, 0))
    assert pressure_cap(DegradePolicy(cap_max_tokens=both), PoolPressure(0.9, 0)) == 64
    assert pressure_cap(DegradePolicy(cap_max_tokens=both), PoolPressure(0.1, 0)) is None
    assert pressure_cap(NO_POLICY, PoolPressure(1.0, 1000)) is None


# --- trim_history ----------------------------------------------------------------------------------


def test_trimming_needs_the_request_or_the_models_default() -> None:
    auto = DegradePolicy(trim_history=TrimHistory("auto"))
    assert trim_allowed(NO_POLICY, "auto") and trim_allowed(auto, None)
    assert not trim_allowed(NO_POLICY, None) and not trim_allowed(auto, "disabled")
    assert not trim_allowed(DegradePolicy(trim_history=TrimHistory("disabled")), None)


def _roles(*roles: str) -> list[dict[str, str]]:
    return [{"role": r, "content": f"{r} {i}"} for i, r in enumerate(roles)]


def test_the_oldest_turn_goes_first_and_system_messages_and_the_last_user_turn_stay() -> None:
    chat = _roles("system", "user", "assistant", "system", "user", "assistant", "user")
    assert next_drop(chat) == [1]
    chat = _roles("system", "assistant", "tool", "tool", "user", "assistant", "user")
    assert next_drop(chat) == [1, 2, 3]  # a call's results go with it
    assert next_drop(_roles("system", "developer", "user")) == []
    assert next_drop(_roles("user")) == []
    # The last user turn stays even when a tool call follows it.
    assert next_drop(_roles("user", "assistant", "tool")) == []
    assert next_drop(_roles("user", "assistant", "user", "assistant", "tool")) == [0]


# --- long_prompt_lane ------------------------------------------------------------------------------


def test_the_lane_admits_in_order_up_to_its_limit_and_refuses_past_max_waiting() -> None:
    async def main() -> None:
        lanes, policy = Lanes(), LongPromptLane(above_tokens=10, max_concurrent=1, max_waiting=2)
        first = await lanes.acquire("m", policy, "m")
        assert not first.waited
        order: list[str] = []

        async def wait(name: str) -> None:
            slot = await lanes.acquire("m", policy, "m")
            assert slot.waited
            order.append(name)
            await asyncio.sleep(0)
            slot.release()

        tasks = [asyncio.ensure_future(wait(n)) for n in ("b", "c")]
        await asyncio.sleep(0)
        with pytest.raises(APIError) as err:
            await lanes.acquire("m", policy, "Model `m`")
        assert err.value.status == 503 and err.value.headers == {"retry-after": "1"}
        assert "long-prompt lane" in err.value.message
        assert lanes.lane("m").active == 1 and order == []
        first.release()
        first.release()  # idempotent
        await asyncio.gather(*tasks)
        assert order == ["b", "c"] and lanes.lane("m").active == 0
        assert not (await lanes.acquire("other", policy, "other")).waited  # each model its own lane

    asyncio.run(main())


def test_a_cancelled_waiter_gives_up_its_place() -> None:
    async def main() -> None:
        lanes, policy = Lanes(), LongPromptLane(above_tokens=10, max_concurrent=1)
        first = await lanes.acquire("m", policy, "m")
        gone = asyncio.ensure_future(lanes.acquire("m", policy, "m"))
        nxt = asyncio.ensure_future(lanes.acquire("m", policy, "m"))
        await asyncio.sleep(0)
        gone.cancel()
        first.release()
        slot = await nxt
        assert slot.waited and lanes.lane("m").active == 1 and not lanes.lane("m").waiters
        slot.release()
        # Cancelled just after being handed the place: the place passes on instead of leaking.
        holder = await lanes.acquire("m", policy, "m")
        late = asyncio.ensure_future(lanes.acquire("m", policy, "m"))
        await asyncio.sleep(0)
        holder.release()  # hands the place to `late`...
        late.cancel()  # ...which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await late
        assert lanes.lane("m").active == 0

    asyncio.run(main())
