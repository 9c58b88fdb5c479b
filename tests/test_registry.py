"""Registry against a real etcd on loopback: join/refusal, load publishing, crashes, etcd restarts."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aetcd
import pytest

from pdserve.registry import (
    EtcdNotFoundError,
    EtcdServer,
    Member,
    NodeCapacity,
    NodeLoad,
    NodeRecord,
    NodeRegistration,
    RecordError,
    RegistrationRefused,
    RegistrationState,
    RegistryUnavailable,
    RegistryView,
    ViewChange,
    find_etcd_binary,
    parse_endpoint,
    parse_key,
)
from pdserve.registry.etcd_server import free_port
from pdserve.registry.records import SCHEMA_VERSION
from testing.waits import wait_until_async

REPO_ROOT = Path(__file__).resolve().parents[1]
TTL_S = 2  # etcd's minimum lease TTL with default heartbeat/election settings

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


def make_record(
    node_id: str,
    cluster: str,
    *,
    role: str = "prefill",
    model: str = "tiny-llama",
    fingerprint: str = "fp-aaaa",
    block_size: int = 16,
    seed: int = 0,
) -> NodeRecord:
    return NodeRecord(
        role=role,  # type: ignore[arg-type]
        node_id=node_id,
        cluster=cluster,
        grpc_address="127.0.0.1:50051",
        kv_address="127.0.0.1:29500",
        model=model,
        model_fingerprint=fingerprint,
        dtype="float32",
        block_size=block_size,
        prefix_hash_seed=seed,
        capacity=NodeCapacity(num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=512),
    )


class CountingLoad:
    """A load source whose `running` counts how often it was sampled."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> NodeLoad:
        self.calls += 1
        return NodeLoad(queue_len=1, running=self.calls, kv_blocks_used=3, kv_blocks_free=125, in_flight=self.calls)


async def raw_keys(endpoint: str, prefix: str) -> list[str]:
    host, port = parse_endpoint(endpoint)
    async with aetcd.Client(host=host, port=port, timeout=2) as client:
        return sorted(kv.key.decode() for kv in await client.get_prefix(prefix.encode()))


def test_records_roundtrip_and_key_layout() -> None:
    rec = make_record("p0", "c-rec")
    assert NodeRecord.from_json(rec.to_json()) == rec
    assert rec.key == "/pdserve/v1/c-rec/nodes/prefill/p0"
    assert rec.load_key == "/pdserve/v1/c-rec/load/prefill/p0"
    assert tuple(parse_key(rec.load_key)) == ("c-rec", "load", "prefill", "p0")

    # Newer writers may add fields; older readers ignore them. A newer schema is refused.
    obj = json.loads(rec.to_json())
    obj["added_later"] = 1
    assert NodeRecord.from_json(json.dumps(obj)) == rec
    obj["schema"] = SCHEMA_VERSION + 1
    with pytest.raises(RecordError, match="unsupported schema"):
        NodeRecord.from_json(json.dumps(obj))

    load = NodeLoad(queue_len=2, tokens_per_s=12.5, kv_blocks_held=7, reservation_queue=1, draining=True)
    assert NodeLoad.from_json(load.to_json()) == load
    with pytest.raises(RecordError):
        NodeLoad.from_json(json.dumps({"schema": SCHEMA_VERSION, "draining": "yes"}))
    with pytest.raises(RecordError):
        make_record("a/b", "c-rec")
    with pytest.raises(RecordError):
        parse_key("/pdserve/v1/c-rec/nodes/router/x")


def test_register_view_sees_record_and_load_updates(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        cluster = "c-basic"
        changes: list[ViewChange] = []
        async with RegistryView(etcd.endpoints, cluster) as view:
            view.subscribe(changes.append)
            rec = make_record("p0", cluster)
            load = CountingLoad()
            async with NodeRegistration(etcd.endpoints, rec, load, ttl_s=TTL_S) as reg:
                assert reg.state is RegistrationState.REGISTERED
                members = await view.wait_for(lambda m: "p0" in m, timeout=5)
                assert members["p0"].record == rec
                assert members["p0"].load is not None  # the first load goes in with the record
                assert [m.node_id for m in view.members(role="prefill", model="tiny-llama")] == ["p0"]
                assert view.members(role="decode") == [] and view.members(model="other") == []

                first = members["p0"].load.running
                t0 = time.monotonic()
                members = await view.wait_for(lambda m: m["p0"].load.running >= first + 3, timeout=6)
                elapsed = time.monotonic() - t0
                # ~1 Hz: three more reports take about three seconds, clearly not ten times faster or slower.
                assert 1.5 < elapsed < 5.5, elapsed
                assert members["p0"].load.in_flight == members["p0"].load.running
                assert members["p0"].load.updated_at > time.time() - 3
                assert reg.status().last_load_at is not None

        kinds = [c.kind for c in changes if c.node_id == "p0"]
        assert kinds[0] == "joined" and kinds.count("load") >= 3

    asyncio.run(scenario())


def test_close_removes_keys_immediately(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        cluster = "c-close"
        async with RegistryView(etcd.endpoints, cluster) as view:
            reg = NodeRegistration(etcd.endpoints, make_record("d0", cluster, role="decode"), CountingLoad(), ttl_s=30)
            await reg.start()
            await view.wait_for(lambda m: "d0" in m and m["d0"].load is not None, timeout=5)
            assert await raw_keys(etcd.endpoints[0], f"/pdserve/v1/{cluster}/") == [
                f"/pdserve/v1/{cluster}/load/decode/d0",
                f"/pdserve/v1/{cluster}/nodes/decode/d0",
            ]
            await reg.close()
            # The lease TTL is 30 s: keys gone right after close() can only be the revoke's doing.
            assert await raw_keys(etcd.endpoints[0], f"/pdserve/v1/{cluster}/") == []
            t0 = time.monotonic()
            await view.wait_for(lambda m: "d0" not in m, timeout=2)
            assert time.monotonic() - t0 < 1.0
            assert reg.state is RegistrationState.CLOSED

    asyncio.run(scenario())


def test_mismatched_pool_member_is_refused_matching_one_joins(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        cluster = "c-pool"
        prefix = f"/pdserve/v1/{cluster}/"
        eps = etcd.endpoints
        async with NodeRegistration(eps, make_record("d0", cluster, role="decode"), ttl_s=TTL_S):
            cases = [
                (dict(fingerprint="fp-bbbb"), "model_fingerprint 'fp-bbbb' disagrees with 'fp-aaaa'"),
                (dict(block_size=32), "block_size 32 disagrees with 16"),
                (dict(seed=7), "prefix_hash_seed 7 disagrees with 0"),
            ]
            for overrides, message in cases:
                reg = NodeRegistration(eps, make_record("p-bad", cluster, **overrides), ttl_s=TTL_S)  # type: ignore[arg-type]
                with pytest.raises(RegistrationRefused) as info:
                    await reg.start()
                assert message in str(info.value)
                assert "decode node 'd0'" in str(info.value) and "model='tiny-llama'" in str(info.value)
                assert reg.state is RegistrationState.REFUSED
            assert await raw_keys(eps[0], prefix) == [f"{prefix}nodes/decode/d0"]  # refusals leave nothing

            # A live node_id cannot be taken, whatever the role.
            with pytest.raises(RegistrationRefused, match="node_id 'd0' is already registered"):
                await NodeRegistration(eps, make_record("d0", cluster), ttl_s=TTL_S).start()

            # Two conflicting joiners racing each other: the guarded put lets exactly one in.
            racers = [
                NodeRegistration(eps, make_record(f"r{i}", cluster, model="raced", seed=i), ttl_s=TTL_S)
                for i in range(2)
            ]
            results = await asyncio.gather(*(r.start() for r in racers), return_exceptions=True)
            assert sorted(type(r).__name__ for r in results) == ["NoneType", "RegistrationRefused"], results
            for racer in racers:
                await racer.close()

            # Another model is another pool; the same model with the same invariants joins.
            async with (
                NodeRegistration(eps, make_record("p-other", cluster, model="other", block_size=32), ttl_s=TTL_S),
                NodeRegistration(eps, make_record("p-good", cluster), ttl_s=TTL_S) as good,
            ):
                assert good.state is RegistrationState.REGISTERED
                assert await raw_keys(eps[0], f"{prefix}nodes/") == [
                    f"{prefix}nodes/decode/d0",
                    f"{prefix}nodes/prefill/p-good",
                    f"{prefix}nodes/prefill/p-other",
                ]

    asyncio.run(scenario())


NODE_SCRIPT = """
import asyncio, sys
from pdserve.registry import NodeCapacity, NodeLoad, NodeRecord, NodeRegistration

async def main() -> None:
    endpoint, node_id, cluster, ttl = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    rec = NodeRecord(role="decode", node_id=node_id, cluster=cluster, grpc_address="127.0.0.1:1",
                     kv_address="127.0.0.1:2", model="tiny-llama", model_fingerprint="fp-aaaa",
                     dtype="float32", block_size=16, prefix_hash_seed=0, capacity=NodeCapacity(64, 8, 256))
    reg = NodeRegistration([endpoint], rec, NodeLoad, ttl_s=ttl)
    await reg.start()
    print("READY", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def spawn_node(endpoint: str, node_id: str, cluster: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", NODE_SCRIPT, endpoint, node_id, cluster, str(TTL_S)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_sigkilled_node_leaves_view_within_ttl_and_can_be_replaced(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        cluster = "c-crash"
        procs = [spawn_node(etcd.endpoints[0], nid, cluster) for nid in ("k1", "k2")]
        try:
            for proc in procs:
                line = await asyncio.to_thread(proc.stdout.readline)  # type: ignore[union-attr]
                assert line.strip() == "READY"
            async with RegistryView(etcd.endpoints, cluster) as view:
                members = await view.wait_for(lambda m: {"k1", "k2"} <= m.keys(), timeout=5)
                assert members["k1"].record.pid == procs[0].pid

                for proc in procs:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                killed_at = time.monotonic()

                # k2 restarts at once on this host with the same id: its dead predecessor's lease is
                # revoked rather than the restart refused.
                async with NodeRegistration(etcd.endpoints, make_record("k2", cluster, role="decode"), ttl_s=TTL_S):
                    await view.wait_for(lambda m: "k2" in m and m["k2"].record.pid == os.getpid(), timeout=2)
                    assert time.monotonic() - killed_at < TTL_S

                    # k1 never revoked anything: it drops out once its lease expires.
                    await view.wait_for(lambda m: "k1" not in m, timeout=TTL_S + 2)
                    assert time.monotonic() - killed_at < TTL_S + 1.5
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

    asyncio.run(scenario())


def test_lease_lost_while_connected_reregisters_with_new_lease(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        cluster = "c-lease"
        host, port = parse_endpoint(etcd.endpoints[0])
        async with (
            RegistryView(etcd.endpoints, cluster) as view,
            NodeRegistration(etcd.endpoints, make_record("p0", cluster), CountingLoad(), ttl_s=TTL_S) as reg,
        ):
            old_lease = reg.lease_id
            assert old_lease is not None
            # Revoking from outside is what a lease expiry looks like to the node (e.g. a long stall).
            async with aetcd.Client(host=host, port=port, timeout=2) as admin:
                await admin.revoke_lease(old_lease)
            await view.wait_for(lambda m: "p0" not in m, timeout=2)
            await view.wait_for(lambda m: "p0" in m and m["p0"].load is not None, timeout=5)
            assert reg.lease_id not in (None, old_lease)
            # The view may see the re-put before the registration task has processed etcd's reply.
            await wait_until_async(lambda: reg.status().joins == 2, 2, "second join")
            assert reg.state is RegistrationState.REGISTERED

    asyncio.run(scenario())


def test_etcd_restart_keeps_view_and_node_reregisters(tmp_path: Path) -> None:
    async def scenario(server: EtcdServer) -> None:
        cluster = "c-restart"
        eps = server.endpoints
        view = RegistryView(eps, cluster)
        await view.start()
        reg = NodeRegistration(eps, make_record("p0", cluster), CountingLoad(), ttl_s=TTL_S)
        await reg.start()
        try:
            await view.wait_for(lambda m: "p0" in m and m["p0"].load is not None, timeout=5)

            # Phase 1: etcd stops (SIGTERM) and comes back on the same port with its data.
            await asyncio.to_thread(server.stop)
            await view.wait_for(lambda m: not view.connected, timeout=3)
            await wait_until_async(lambda: reg.state is RegistrationState.RECONNECTING, 3, "registration to notice")
            await asyncio.sleep(TTL_S + 0.5)  # outlasting the TTL is the test: the outage keeps the view
            assert [m.node_id for m in view.members()] == ["p0"] and not view.connected

            await asyncio.to_thread(server.start)
            restarted = time.time()
            assert server.endpoints == eps
            await wait_until_async(lambda: reg.state is RegistrationState.REGISTERED, 5, "re-registration")
            assert reg.status().joins == 2
            members = await view.wait_for(
                lambda m: view.connected and "p0" in m and m["p0"].load.updated_at > restarted, timeout=5
            )
            assert members["p0"].record == reg.record

            # Phase 2: etcd comes back without its data (lease and keys gone): new lease, keys re-put.
            old_lease = reg.lease_id
            await asyncio.to_thread(server.stop)
            shutil.rmtree(server.data_dir)
            await asyncio.to_thread(server.start)
            wiped = time.time()
            members = await view.wait_for(
                lambda m: view.connected and "p0" in m and m["p0"].load.updated_at > wiped, timeout=8
            )
            assert reg.lease_id not in (None, old_lease) and isinstance(members["p0"], Member)
            # The view may see the re-put before the registration task has processed etcd's reply.
            await wait_until_async(lambda: reg.state is RegistrationState.REGISTERED, 2, "registered state")
        finally:
            await reg.close()
            await view.close()
        assert await raw_keys(eps[0], f"/pdserve/v1/{cluster}/") == []

    with EtcdServer(tmp_path / "etcd") as server:
        asyncio.run(scenario(server))
        assert server.log_path.is_file() and server.log_path.stat().st_size > 0


def test_unreachable_etcd_fails_start_with_clear_error() -> None:
    async def scenario() -> None:
        dead = [f"127.0.0.1:{free_port()}"]  # nothing listens there
        reg = NodeRegistration(dead, make_record("p0", "c-dead"), join_timeout_s=0.5)
        with pytest.raises(RegistryUnavailable, match="unreachable for 0.5s while registering node 'p0'"):
            await reg.start()
        view = RegistryView(dead, "c-dead")
        with pytest.raises(RegistryUnavailable, match="no snapshot of cluster 'c-dead'"):
            await view.start(sync_timeout_s=0.5)
        assert view.members() == [] and not view.connected

    asyncio.run(scenario())


def run_cli(data_dir: Path) -> tuple[subprocess.Popen[str], dict[str, object]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.registry.etcd_server", "--data-dir", str(data_dir)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, json.loads(proc.stdout.readline())  # type: ignore[union-attr]


async def put_and_get(endpoint: str, key: bytes, value: bytes | None) -> bytes | None:
    host, port = parse_endpoint(endpoint)
    async with aetcd.Client(host=host, port=port, timeout=2) as client:
        if value is not None:
            await client.put(key, value)
        got = await client.get(key)
        return got.value if got is not None else None


def test_etcd_binary_resolution_and_cli_restart(tmp_path: Path) -> None:
    with pytest.raises(EtcdNotFoundError, match="does not exist"):
        find_etcd_binary(tmp_path / "no-such-etcd")
    assert os.access(find_etcd_binary(), os.X_OK)

    endpoints: list[object] = []
    for value in (b"kept", None):  # the second run must find the first run's data on the same port
        proc, info = run_cli(tmp_path / "cli")
        try:
            endpoint = info["endpoints"][0]  # type: ignore[index]
            endpoints.append(endpoint)
            with urllib.request.urlopen(f"http://{endpoint}/health", timeout=2) as resp:
                assert json.loads(resp.read())["health"] == "true"
            assert asyncio.run(put_and_get(str(endpoint), b"/pdserve/test/k", value)) == b"kept"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
            with pytest.raises(ProcessLookupError):
                os.kill(int(info["pid"]), 0)  # type: ignore[call-overload]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert endpoints[0] == endpoints[1]
    assert (tmp_path / "cli" / "etcd.log").is_file() and (tmp_path / "cli" / "data" / "member").is_dir()
