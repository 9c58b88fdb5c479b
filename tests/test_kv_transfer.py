"""KV data plane between two real processes on loopback.

This process plays the prefill node (the sender). A spawned child plays up to three decode nodes
(one ChannelManager each), driven over a multiprocessing pipe that stands in for the gRPC control
plane: it carries the transfer metadata as plain dicts, and the child's pool contents back as
numpy arrays so this process compares them with the source blocks bit for bit.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
import torch

from pdserve.kernels import get_kernel_ops
from pdserve.kv_transfer import (
    ChannelConfig,
    ChannelManager,
    ChannelState,
    KVReceiver,
    KVSender,
    NodeAddress,
    SendHandle,
    StaleEpochError,
    TransferMeta,
    TransferResult,
    message_ranges,
)
from pdserve.kv_transfer.checksum import KVDigest
from testing.faults import Faults, FaultySender
from testing.threads import start_thread

GEOMETRY = (4, 16, 2, 64)  # (L, BS, Hkv, D): the tiny model
PREFILL_BLOCKS = 64
DECODE_BLOCKS = 48  # a different pool size on purpose
DECODE_IDS = ("d0", "d1", "d2")
NODE_HOSTS = {"d0": "127.0.0.1", "d1": "127.0.0.2", "d2": "127.0.0.2"}
DECODE_IDLE_S = 2.0


# --------------------------------------------------------------------------- decode side (child)
@dataclass
class _Pending:
    handle: Any  # kv_transfer.TransferHandle
    layers: list[int]


def _decode_node_main(conn: Connection, idle_timeout_s: float) -> None:
    ops = get_kernel_ops("torch")
    num_layers, bs, h, d = GEOMETRY
    # d1 and d2 live on another loopback address: gloo must bind and advertise each node's own
    # address, as it must when nodes sit in separate network namespaces.
    managers = {
        node: ChannelManager(
            ChannelConfig(node, "decode", f"{NODE_HOSTS[node]}:0", max_channels=4, idle_timeout_s=idle_timeout_s)
        )
        for node in DECODE_IDS
    }
    pools = {node: torch.zeros(num_layers, 2, DECODE_BLOCKS, bs, h, d) for node in DECODE_IDS}  # [L, 2, NB, BS, H, D]
    receiver = KVReceiver(ops)
    pending: dict[str, _Pending] = {}
    lock = threading.Lock()

    def submit(item: dict[str, Any]) -> str | None:
        meta = TransferMeta.from_dict(item["meta"])
        node = meta.decode_id
        try:
            channel = managers[node].channel_from(meta.prefill_id, item["prefill_addr"], meta.epoch)
        except StaleEpochError as e:
            return f"stale: {e}"
        layers: list[int] = []
        if item.get("discard"):
            handle = receiver.discard(channel, meta, timeout_s=item["timeout"])
        else:
            handle = receiver.recv(channel, pools[node], item["dst"], meta, timeout_s=item["timeout"],
                                   on_layer=layers.append)
        with lock:
            pending[item["token"]] = _Pending(handle, layers)
        return None

    def recv_all(items: list[dict[str, Any]]) -> dict[str, str | None]:
        # One thread per submission, started in the given order with a stagger, so the channel
        # worker really sees sequence numbers arrive out of order and from several threads.
        errors: dict[str, str | None] = {}

        def run(i: int, item: dict[str, Any]) -> None:
            time.sleep(0.01 * i)  # the stagger: the arrival order under test
            errors[item["token"]] = submit(item)

        for future in [start_thread(run, i, it) for i, it in enumerate(items)]:
            future.result(timeout=60)  # re-raises a submission's failure
        return errors

    def wait(tokens: list[str], timeout: float) -> dict[str, TransferResult]:
        return {t: pending.pop(t).handle.result(timeout) for t in tokens}

    def layers_seen(token: str, count: int, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        seen = pending[token].layers
        while len(seen) < count and time.monotonic() < deadline:
            time.sleep(0.005)  # the poll interval
        return list(seen)

    def read(node: str, ids: list[int]) -> np.ndarray:
        return pools[node][:, :, ids].numpy().copy()

    def fill(node: str, ids: list[int], value: float) -> None:
        pools[node][:, :, ids] = value

    def open_channels() -> dict[str, list[int]]:
        return {node: [k.epoch for k in m.open_channels()] for node, m in managers.items()}

    handlers = {
        "recv": lambda a: recv_all(a),
        "wait": lambda a: wait(*a),
        "layers": lambda a: layers_seen(*a),
        "read": lambda a: read(*a),
        "fill": lambda a: fill(*a),
        "open": lambda a: open_channels(),
        "stale_check": lambda a: _stale_check(managers, *a),
    }
    conn.send({node: m.kv_address for node, m in managers.items()})
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            break
        try:
            conn.send(("ok", handlers[cmd](arg)))
        except Exception as e:  # report to the test instead of dying silently
            conn.send(("error", repr(e)))
    for m in managers.values():
        m.close()
    conn.send(("ok", None))


def _stale_check(managers: dict[str, ChannelManager], node: str, prefill_id: str, addr: str, epoch: int) -> str:
    try:
        managers[node].channel_from(prefill_id, addr, epoch)
    except StaleEpochError as e:
        return f"stale: {e}"
    return "opened"


# --------------------------------------------------------------------------- prefill side (this process)
class DecodePeer:
    """This process's handle on the child's decode nodes."""

    def __init__(self, idle_timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_decode_node_main, args=(child, idle_timeout_s), daemon=True)
        self._proc.start()
        if not self._conn.poll(60):
            raise RuntimeError("decode process did not start")
        self.addresses: dict[str, str] = self._conn.recv()

    def call(self, cmd: str, arg: Any = None, timeout: float = 30.0) -> Any:
        self._conn.send((cmd, arg))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"decode process did not answer {cmd!r}")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"decode process failed {cmd!r}: {value}")
        return value

    def recv(self, items: list[dict[str, Any]]) -> dict[str, str | None]:
        return self.call("recv", items)

    def wait(self, tokens: list[str], timeout: float = 20.0) -> dict[str, TransferResult]:
        return self.call("wait", (tokens, timeout), timeout=timeout + 10)

    def read(self, node: str, ids: list[int]) -> torch.Tensor:
        return torch.from_numpy(self.call("read", (node, ids)))

    def stop(self) -> None:
        try:
            self.call("stop", timeout=10)
        except (TimeoutError, EOFError, OSError):
            pass
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()


@dataclass
class Cluster:
    peer: DecodePeer
    prefill: ChannelManager
    sender: KVSender
    kv: torch.Tensor  # [L, 2, NB, BS, H, D], the prefill pool, random


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    peer = DecodePeer(DECODE_IDLE_S)
    # The prefill side closes idle channels before the decode side does (see ChannelConfig).
    prefill = ChannelManager(ChannelConfig("p0", "prefill", "127.0.0.1:0", idle_timeout_s=DECODE_IDLE_S / 2))
    gen = torch.Generator().manual_seed(0)
    num_layers, bs, h, d = GEOMETRY
    kv = torch.randn(num_layers, 2, PREFILL_BLOCKS, bs, h, d, generator=gen)
    # A small message size so whole-request transfers span several pipelined messages.
    sender = KVSender(get_kernel_ops("torch"), message_bytes=640 << 10)
    yield Cluster(peer, prefill, sender, kv)
    prefill.close()
    peer.stop()


def _shuffled_ids(count: int, pool: int, seed: int) -> list[int]:
    return torch.randperm(pool, generator=torch.Generator().manual_seed(seed))[:count].tolist()


def _item(c: Cluster, handle: SendHandle, token: str, dst: list[int], timeout: float = 20.0) -> dict[str, Any]:
    return {"token": token, "meta": handle.meta.to_dict(), "dst": dst, "timeout": timeout,
            "prefill_addr": c.prefill.kv_address}


def _expect_blocks(c: Cluster, node: str, src: list[int], dst: list[int]) -> None:
    got = c.peer.read(node, dst)  # [L, 2, n, BS, H, D]
    want = c.kv[:, :, src]
    assert got.shape == want.shape
    assert torch.equal(got, want), f"max diff {(got - want).abs().max().item()}"


# --------------------------------------------------------------------------- tests
def test_message_plan_and_address_parsing() -> None:
    assert message_ranges(4, 1, 3) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert message_ranges(5, 2, 3) == [(0, 2), (2, 4), (4, 5)]
    assert message_ranges(4, 4, 0) == []
    assert NodeAddress.parse("[::1]:7000") == NodeAddress("::1", 7000)
    assert str(NodeAddress.parse("10.1.2.3:0")) == "10.1.2.3:0"
    with pytest.raises(ValueError):
        NodeAddress.parse("no-port")


@pytest.mark.timeout(60)
def test_whole_request_lands_in_different_block_ids(cluster: Cluster) -> None:
    c = cluster
    src = _shuffled_ids(20, PREFILL_BLOCKS, seed=1)
    dst = _shuffled_ids(20, DECODE_BLOCKS, seed=2)
    h = c.sender.send(c.prefill.channel_to("d0"), c.kv, src, request_id="whole", num_tokens=20 * 16 - 5,
                      timeout_s=20.0)
    assert h.meta.layers_per_message == 2  # 320 KiB per layer, 640 KiB messages: two pipelined messages
    assert c.peer.recv([_item(c, h, "whole", dst)]) == {"whole": None}
    got = c.peer.wait(["whole"])["whole"]
    sent = asyncio.run(asyncio.wait_for(h.wait(), 20))  # what an asyncio server does
    assert sent.ok and got.ok, (sent, got)
    layer_bytes = 2 * 20 * 16 * 2 * 64 * 4
    assert sent.bytes == got.bytes == GEOMETRY[0] * layer_bytes
    # Both sides digest the messages in order: the digest of the whole v1 buffer [L, 2, n, BS, H, D].
    whole = KVDigest()
    whole.update(c.kv[:, :, src].contiguous())
    assert sent.checksum == got.checksum == whole.value()
    _expect_blocks(c, "d0", src, dst)
    untouched = sorted(set(range(DECODE_BLOCKS)) - set(dst))[:5]
    assert torch.count_nonzero(c.peer.read("d0", untouched)) == 0


@pytest.mark.timeout(60)
def test_layer_by_layer_overlaps_with_compute(cluster: Cluster) -> None:
    c = cluster
    assert c.peer.addresses["d1"].startswith("127.0.0.2:")  # d1 is reached on its own address
    num_layers = GEOMETRY[0]
    # 16 blocks: 256 KiB a layer, the sender's default layerwise_min_bytes, so one message per layer.
    src = _shuffled_ids(16, PREFILL_BLOCKS, seed=3)
    dst = _shuffled_ids(16, DECODE_BLOCKS, seed=4)
    h = c.sender.send(c.prefill.channel_to("d1"), c.kv, src, request_id="lbl", num_tokens=16 * 16,
                      timeout_s=20.0, layerwise=True)
    assert h.meta.layers_per_message == 1
    c.peer.recv([_item(c, h, "lbl", dst)])
    for layer in range(num_layers - 1):
        h.layer_ready(layer)
    # The decode node holds every finished layer while the last one is still "being computed".
    seen = c.peer.call("layers", ("lbl", num_layers - 1, 10.0))
    assert seen == list(range(num_layers - 1))
    assert not h.done()
    h.layer_ready(num_layers - 1)
    got = c.peer.wait(["lbl"])["lbl"]
    assert h.result(20).ok and got.ok, (h.result(), got)
    assert got.checksum is not None and h.result().checksum == got.checksum
    _expect_blocks(c, "d1", src, dst)


@pytest.mark.timeout(60)
def test_a_transfer_longer_than_its_timeout_lives_while_it_moves(cluster: Cluster) -> None:
    """The timeout bounds how long a channel stands still: a layer-wise send whose layers come slower
    than the whole timeout allows (a slow prefill step), and a transfer queued behind it on both sides,
    complete, since each layer restarts every deadline on the channel."""
    c = cluster
    num_layers = GEOMETRY[0]
    src = _shuffled_ids(16, PREFILL_BLOCKS, seed=21)
    dst_a, dst_b = _shuffled_ids(32, DECODE_BLOCKS, seed=22)[:16], _shuffled_ids(32, DECODE_BLOCKS, seed=22)[16:]
    channel = c.prefill.channel_to("d1")
    timeout = 1.0
    slow = c.sender.send(channel, c.kv, src, request_id="slow", num_tokens=16 * 16, timeout_s=timeout,
                         layerwise=True)
    behind = c.sender.send(channel, c.kv, src, request_id="behind", num_tokens=16 * 16, timeout_s=timeout)
    c.peer.recv([_item(c, slow, "slow", dst_a, timeout=timeout), _item(c, behind, "behind", dst_b, timeout=timeout)])
    start = time.monotonic()
    for layer in range(num_layers):
        time.sleep(0.6 * timeout)  # each layer within the timeout, all of them well past it
        slow.layer_ready(layer)
    got = c.peer.wait(["slow", "behind"])
    assert time.monotonic() - start > 2 * timeout
    for token, handle in (("slow", slow), ("behind", behind)):
        assert got[token].ok and handle.result(20).ok, (token, got[token], handle.result())
    _expect_blocks(c, "d1", src, dst_a)
    _expect_blocks(c, "d1", src, dst_b)
    assert channel.usable


def test_small_layers_travel_in_groups_layer_by_layer() -> None:
    """A layer-wise message holds the fewest whole layers that reach `layerwise_min_bytes`."""
    sender = KVSender(get_kernel_ops("torch"))  # 256 KiB by default
    assert sender.layers_per_message(30, 92_160, layerwise=True) == 3  # 128 tokens of the default model
    assert sender.layers_per_message(30, 737_280, layerwise=True) == 1  # 1,024 tokens
    assert sender.layers_per_message(4, 16 << 10, layerwise=True) == 4  # never more than all layers
    assert KVSender(get_kernel_ops("torch"), layerwise_min_bytes=0).layers_per_message(30, 1, layerwise=True) == 1


@pytest.mark.timeout(60)
def test_grouped_layers_ship_once_the_whole_group_is_ready(cluster: Cluster) -> None:
    """With 64 KiB layers and a 128 KiB minimum, layers go in pairs: the decode node gets layers 0 and 1
    once both are ready, the last pair only when layer 3 is, and every byte lands intact."""
    c = cluster
    sender = KVSender(get_kernel_ops("torch"), layerwise_min_bytes=128 << 10)
    src = _shuffled_ids(4, PREFILL_BLOCKS, seed=21)
    dst = _shuffled_ids(4, DECODE_BLOCKS, seed=22)
    h = sender.send(c.prefill.channel_to("d0"), c.kv, src, request_id="pairs", num_tokens=4 * 16,
                    timeout_s=20.0, layerwise=True)
    assert h.meta.layers_per_message == 2
    c.peer.recv([_item(c, h, "pairs", dst)])
    for layer in range(3):
        h.layer_ready(layer)
    assert c.peer.call("layers", ("pairs", 2, 10.0)) == [0, 1]
    assert not h.done()  # layer 2 waits in its group for layer 3
    h.layer_ready(3)
    got = c.peer.wait(["pairs"])["pairs"]
    sent = h.result(20)
    assert sent.ok and got.ok, (sent, got)
    assert sent.bytes == got.bytes == 4 * 2 * 4 * (16 * 2 * 64 * 4)
    assert sent.checksum == got.checksum is not None
    # Each side's phase split: the layer wait, copy, digest and wire times it measured, within its run time.
    for side in (sent, got):
        assert side.phases is not None and side.phases.copy > 0 and side.phases.digest > 0 and side.phases.wire > 0
        assert side.phases.total <= side.seconds
    assert sent.phases.layers > 0 and got.phases.layers == 0  # the sender waited for layer 3
    _expect_blocks(c, "d0", src, dst)


@pytest.mark.timeout(60)
def test_a_byte_corrupted_after_the_checksum_is_detected(cluster: Cluster) -> None:
    """A corrupting sender (`testing.faults`) flips one staged byte after digesting it: the transfer itself
    completes, but the receiver's digest differs from the sender's (the decode node then fails it)."""
    c = cluster
    corrupting = FaultySender(get_kernel_ops("torch"), Faults(send_corrupt=True), message_bytes=640 << 10)
    src = _shuffled_ids(10, PREFILL_BLOCKS, seed=21)
    dst = _shuffled_ids(10, DECODE_BLOCKS, seed=22)
    h = corrupting.send(c.prefill.channel_to("d0"), c.kv, src, request_id="flip", num_tokens=160, timeout_s=20.0)
    c.peer.recv([_item(c, h, "flip", dst)])
    got = c.peer.wait(["flip"])["flip"]
    sent = h.result(20)
    assert sent.ok and got.ok and sent.checksum is not None and got.checksum is not None
    assert sent.checksum != got.checksum
    diff = c.peer.read("d0", dst).view(torch.uint8) != c.kv[:, :, src].contiguous().view(torch.uint8)
    assert int(diff.sum()) == 1  # exactly the one byte flipped in flight
    # The channel stays in step: the next (honest) transfer's digests agree again.
    h2 = c.sender.send(c.prefill.channel_to("d0"), c.kv, src, request_id="after", num_tokens=160, timeout_s=20.0)
    c.peer.recv([_item(c, h2, "after", dst)])
    assert c.peer.wait(["after"])["after"].checksum == h2.result(20).checksum
    _expect_blocks(c, "d0", src, dst)


@pytest.mark.timeout(60)
def test_prefix_cached_blocks_are_skipped(cluster: Cluster) -> None:
    c = cluster
    src = _shuffled_ids(12, PREFILL_BLOCKS, seed=5)
    dst = _shuffled_ids(12, DECODE_BLOCKS, seed=6)
    cached = 5  # the decode node's prefix cache already holds the request's first 5 blocks
    c.peer.call("fill", ("d0", dst[:cached], 7.0))
    h = c.sender.send(c.prefill.channel_to("d0"), c.kv, src[cached:], request_id="prefix",
                      num_tokens=12 * 16, timeout_s=20.0)
    assert h.meta.num_blocks == 12 - cached
    c.peer.recv([_item(c, h, "prefix", dst[cached:])])
    got = c.peer.wait(["prefix"])["prefix"]
    assert got.ok and got.bytes == GEOMETRY[0] * 2 * (12 - cached) * 16 * 2 * 64 * 4
    _expect_blocks(c, "d0", src[cached:], dst[cached:])
    assert torch.all(c.peer.read("d0", dst[:cached]) == 7.0)


@pytest.mark.timeout(60)
def test_concurrent_transfers_on_one_channel_never_mix(cluster: Cluster) -> None:
    c = cluster
    channel = c.prefill.channel_to("d2")
    plans = []
    perm_src = _shuffled_ids(40, PREFILL_BLOCKS, seed=7)
    perm_dst = _shuffled_ids(40, DECODE_BLOCKS, seed=8)
    sizes = [3, 5, 5, 5, 7, 2, 5, 8]  # equal sizes too, so a mix-up would show in content, not length
    at = 0
    for size in sizes:
        plans.append((perm_src[at:at + size], perm_dst[at:at + size]))
        at += size
    handles: list[SendHandle | None] = [None] * len(plans)

    def submit(i: int) -> None:
        src, _ = plans[i]
        handles[i] = c.sender.send(channel, c.kv, src, request_id=f"c{i}", num_tokens=len(src) * 16,
                                   timeout_s=20.0, layerwise=i % 2 == 1)
        if i % 2 == 1:
            handles[i].all_layers_ready()

    for future in [start_thread(submit, i) for i in range(len(plans))]:
        future.result(timeout=60)
    assert sorted(h.meta.seq_no for h in handles) == list(range(len(plans)))
    # The decode node learns about the transfers in reverse sequence order.
    order = sorted(range(len(plans)), key=lambda i: -handles[i].meta.seq_no)
    items = [_item(c, handles[i], f"c{i}", plans[i][1]) for i in order]
    assert all(e is None for e in c.peer.recv(items).values())
    got = c.peer.wait([f"c{i}" for i in range(len(plans))])
    for i, (src, dst) in enumerate(plans):
        assert handles[i].result(20).ok and got[f"c{i}"].ok, got[f"c{i}"]
        assert got[f"c{i}"].seq_no == handles[i].meta.seq_no
        _expect_blocks(c, "d2", src, dst)


@pytest.mark.timeout(60)
def test_rejected_and_discarded_transfers_keep_the_channel_in_step(cluster: Cluster) -> None:
    c = cluster
    src = _shuffled_ids(4, PREFILL_BLOCKS, seed=15)
    dst = _shuffled_ids(11, DECODE_BLOCKS, seed=16)
    bad_dst, ok_dst = dst[:3], dst[3:7]  # three ids for four blocks: a caller bug
    c.peer.call("fill", ("d0", dst, 3.0))
    channel = c.prefill.channel_to("d0")
    dropped, bad, ok = (
        c.sender.send(channel, c.kv, src, request_id=name, num_tokens=64, timeout_s=20.0)
        for name in ("dropped", "bad", "ok")
    )
    items = [_item(c, dropped, "dropped", []), _item(c, bad, "bad", bad_dst), _item(c, ok, "ok", ok_dst)]
    items[0]["discard"] = True
    c.peer.recv(items)
    got = c.peer.wait(["dropped", "bad", "ok"])
    assert got["dropped"].ok and got["dropped"].bytes == dropped.result(20).bytes > 0
    assert not got["bad"].ok and "3 destination blocks for 4" in (got["bad"].error or ""), got["bad"]
    assert got["ok"].ok, got["ok"]
    assert all(h.result(20).ok for h in (dropped, bad, ok))  # the sender saw three normal transfers
    _expect_blocks(c, "d0", src, ok_dst)
    assert torch.all(c.peer.read("d0", bad_dst + dst[7:]) == 3.0)  # nothing else was written


@pytest.mark.timeout(60)
def test_timeout_breaks_channel_and_new_epoch_works(cluster: Cluster) -> None:
    c = cluster
    src = _shuffled_ids(6, PREFILL_BLOCKS, seed=9)
    dst = _shuffled_ids(6, DECODE_BLOCKS, seed=10)
    old = c.prefill.channel_to("d0")
    # A working transfer first, so the decode node joined this epoch.
    h = c.sender.send(old, c.kv, src, request_id="warm", num_tokens=96, timeout_s=20.0)
    c.peer.recv([_item(c, h, "warm", dst)])
    assert c.peer.wait(["warm"])["warm"].ok
    # Now the decode node never posts the receive.
    t0 = time.monotonic()
    lost = c.sender.send(old, c.kv, src, request_id="lost", num_tokens=96, timeout_s=1.0)
    res = lost.result(10)
    elapsed = time.monotonic() - t0
    assert not res.ok and "timeout" in (res.error or ""), res
    assert elapsed < 3.0, elapsed
    assert old.state == ChannelState.BROKEN
    assert all(k.epoch != old.key.epoch for k in c.prefill.open_channels())
    late = c.sender.send(old, c.kv, src, request_id="late", num_tokens=96, timeout_s=1.0)
    assert late.done() and not late.result().ok  # a broken channel is never reused

    new = c.prefill.channel_to("d0")
    assert new is not old and new.key.epoch > old.key.epoch
    c.peer.call("fill", ("d0", dst, 0.0))
    h = c.sender.send(new, c.kv, src, request_id="again", num_tokens=96, timeout_s=20.0)
    c.peer.recv([_item(c, h, "again", dst)])
    assert c.peer.wait(["again"])["again"].ok and h.result(20).ok
    _expect_blocks(c, "d0", src, dst)
    # The decode node closed the old epoch when the new one appeared and refuses to reopen it.
    assert c.peer.call("open")["d0"] == [new.key.epoch]
    verdict = c.peer.call("stale_check", ("d0", "p0", c.prefill.kv_address, old.key.epoch))
    assert verdict.startswith("stale"), verdict


@pytest.mark.timeout(60)
def test_receiver_waits_for_missing_seq_then_times_out(cluster: Cluster) -> None:
    c = cluster
    src = _shuffled_ids(4, PREFILL_BLOCKS, seed=11)
    dst = _shuffled_ids(4, DECODE_BLOCKS, seed=12)
    channel = c.prefill.channel_to("d1")
    first = c.sender.send(channel, c.kv, src, request_id="m0", num_tokens=64, timeout_s=20.0)
    second = c.sender.send(channel, c.kv, src, request_id="m1", num_tokens=64, timeout_s=20.0)
    # The metadata of `first` is lost: the receiver holds `second` back, then gives up.
    c.peer.recv([_item(c, second, "m1", dst, timeout=1.0)])
    got = c.peer.wait(["m1"])["m1"]
    assert not got.ok and f"timed out while queued (seq {first.meta.seq_no} never came)" in (got.error or ""), got
    # The decode side aborted the group, so the sender's pending transfers fail fast too.
    assert not first.result(10).ok and not second.result(10).ok


@pytest.mark.timeout(60)
def test_idle_channels_close_and_lru_bound_holds(cluster: Cluster) -> None:
    c = cluster
    src = _shuffled_ids(2, PREFILL_BLOCKS, seed=13)
    dst = _shuffled_ids(2, DECODE_BLOCKS, seed=14)
    with ChannelManager(
        ChannelConfig("p1", "prefill", "127.0.0.1:0", max_channels=2, idle_timeout_s=1.0, reap_interval_s=0.05)
    ) as mgr:
        first_epoch: dict[str, int] = {}
        for node in DECODE_IDS:
            ch = mgr.channel_to(node)
            first_epoch[node] = ch.key.epoch
            h = c.sender.send(ch, c.kv, src, request_id=f"lru-{node}", num_tokens=32, timeout_s=20.0)
            item = _item(c, h, node, dst)
            item["prefill_addr"] = mgr.kv_address
            c.peer.recv([item])
            assert c.peer.wait([node])[node].ok and h.result(20).ok
            assert len(mgr.open_channels()) <= 2
        assert [k.decode_id for k in mgr.open_channels()] == ["d1", "d2"]  # d0 was least recently used
        # The evicted peer gets a fresh epoch that works.
        ch = mgr.channel_to("d0")
        assert ch.key.epoch > first_epoch["d0"]
        assert [k.decode_id for k in mgr.open_channels()] == ["d2", "d0"]
        h = c.sender.send(ch, c.kv, src, request_id="lru-back", num_tokens=32, timeout_s=20.0)
        item = _item(c, h, "back", dst)
        item["prefill_addr"] = mgr.kv_address
        c.peer.recv([item])
        assert c.peer.wait(["back"])["back"].ok
        # Idle: the prefill side closes after 1 s, the decode side (2 s) after it.
        deadline = time.monotonic() + 5.0
        while mgr.open_channels() and time.monotonic() < deadline:
            time.sleep(0.1)  # the poll interval
        assert mgr.open_channels() == []
        deadline = time.monotonic() + 6.0
        while time.monotonic() < deadline:
            if not any(c.peer.call("open").values()):
                break
            time.sleep(0.2)  # the poll interval
        assert c.peer.call("open") == {node: [] for node in DECODE_IDS}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2,
                                   torch.float8_e4m3fn])
def test_hostcopy_matches_the_kernel_wire_format(dtype: torch.dtype) -> None:
    """The transfer's serial CPU copies produce exactly the kernel ops' wire format v1, both ways."""
    from pdserve.kernels import get_kernel_ops
    from pdserve.kv_transfer import hostcopy

    ops = get_kernel_ops("torch", "cpu")
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(3, 2, 20, 4, 2, 8, generator=gen).to(dtype)  # [L, 2, NB, BS, Hkv, D]
    ids = torch.randperm(20, generator=gen)[:7]
    assert hostcopy.supported(pool)
    out = torch.empty(3, 2, 7, 4, 2, 8, dtype=dtype)
    hostcopy.gather(pool, ids, out)
    assert torch.equal(out.view(torch.uint8), ops.pack_blocks(pool, ids).view(torch.uint8))
    one = torch.empty(1, 2, 7, 4, 2, 8, dtype=dtype)
    hostcopy.gather(pool[1:2], ids, one)
    assert torch.equal(one[0], ops.pack_blocks(pool, ids, layer=1))
    dst_ids = torch.randperm(30, generator=gen)[:7]
    ours, theirs = torch.zeros(3, 2, 30, 4, 2, 8, dtype=dtype), torch.zeros(3, 2, 30, 4, 2, 8, dtype=dtype)
    hostcopy.scatter(out, ours, dst_ids.numpy())
    ops.unpack_blocks(out, theirs, dst_ids)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
