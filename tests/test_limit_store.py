"""Tenant limits shared by several frontends in a real Redis (frontend.limit_store): three real frontend
processes against real etcd, a scripted decode node and a private redis-server; the local share as the
fallback while Redis is down; money budgets and the daily quota across restarts and period roll-overs
(the period moved by the frontends' clock-file hook, never by a stand-in for Redis)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.frontend.config_files import ConfigError
from pdserve.frontend.errors import APIError
from pdserve.frontend.limit_store import CLOCK_FILE_ENV, Limiter, RedisLimitStore, WallClock
from pdserve.frontend.limits import SECONDS_PER_DAY, TenantLimiter, UsageLedger, next_month_start
from pdserve.frontend.tenants import Tenant, TenantLimits, TenantTable, hash_key
from pdserve.registry import EtcdServer
from pdserve.registry.etcd_server import free_port
from testing.procs import FrontendProc, Proc, start_frontend, start_scripted_node
from testing.redis import RedisServer, redis_server  # noqa: F401

pytestmark = pytest.mark.timeout(240)

REPLY = "The quick brown fox jumps over the lazy dog."
TENANTS: dict[str, dict[str, Any]] = {
    "rpm": {"requests_per_minute": 60},
    "quota": {"daily_token_quota": 400},
    "solo": {"daily_token_quota": 400},  # the frontend without Redis
    "share": {"requests_per_minute": 30},  # 10 a frontend while Redis is down
    "broke": {"daily_budget_usd": 0},
    "spender": {"daily_budget_usd": 0.02},
}
OUTPUT_USD_PER_MILLION = 1000.0  # the models file's output price: 8 completion tokens cost $0.008
KEYS = {name: f"sk-{name}-{'k' * 24}" for name in TENANTS}
N_FRONTENDS = 3


@dataclass(eq=False)
class Cluster:
    tmp: Path
    etcd: EtcdServer
    redis: RedisServer
    node: Proc
    tenants: Path
    models: Path
    clock_file: Path
    frontends: list[FrontendProc]

    def start(self, i: int, *extra: str, name: str | None = None) -> FrontendProc:
        return start_frontend(name or f"fe-{i}", self.tmp, self.etcd.endpoints, free_port(), "--tenants",
                              str(self.tenants), "--models", str(self.models), "--request-log", "off",
                              "--log-level", "warning", "--limit-share", str(N_FRONTENDS), "--limit-share-index",
                              str(i), *extra, env={CLOCK_FILE_ENV: str(self.clock_file)})

    def start_shared(self, i: int) -> FrontendProc:
        return self.start(i, "--limits-redis", self.redis.url)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path,
            redis_server: RedisServer) -> Iterator[Cluster]:  # noqa: F811
    tmp = tmp_path_factory.mktemp("limit-store")
    tenants = tmp / "tenants.yaml"
    tenants.write_bytes(orjson.dumps({"tenants": [
        {"name": name, "keys_sha256": [hash_key(KEYS[name])], **limits} for name, limits in TENANTS.items()]}))
    models = tmp / "models.yaml"
    models.write_bytes(orjson.dumps({"models": [{"name": "tiny-llama", "path": str(tiny_llama_dir),
                                                 "prices": {"output": OUTPUT_USD_PER_MILLION}}]}))
    clock_file = tmp / "clock-offset"
    clock_file.write_text("0")
    with EtcdServer(tmp / "etcd") as etcd:
        node = start_scripted_node("scripted", tmp, etcd.endpoints, "--tokenizer", str(tiny_llama_dir), "--reply",
                                   REPLY, "--model", "tiny-llama", "--node-id", "d", "--prefill-ids", "p0")
        c = Cluster(tmp, etcd, redis_server, node, tenants, models, clock_file, [])
        try:
            c.frontends = [c.start_shared(i) for i in range(N_FRONTENDS)]
            yield c
        finally:
            for fe in c.frontends:
                assert fe.stop() == 0, fe.proc.tail()
                assert "Traceback" not in fe.proc.log_text(), fe.proc.tail(60)
            node.stop()


def _body(max_tokens: int = 2) -> dict[str, Any]:
    return {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}


async def _send(urls: list[str], tenant: str, n: int, max_tokens: int = 2) -> list[httpx.Response]:
    """`n` chat requests at once, spread round-robin over `urls`."""
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    async with httpx.AsyncClient(timeout=60, limits=limits,
                                 headers={"authorization": f"Bearer {KEYS[tenant]}"}) as client:
        return await asyncio.gather(*(client.post(f"{urls[i % len(urls)]}/v1/chat/completions",
                                                  json=_body(max_tokens)) for i in range(n)))


def send(frontends: list[FrontendProc], tenant: str, n: int, max_tokens: int = 2) -> list[httpx.Response]:
    return asyncio.run(_send([fe.base_url for fe in frontends], tenant, n, max_tokens))


def one(fe: FrontendProc, tenant: str, max_tokens: int = 2) -> httpx.Response:
    return httpx.post(f"{fe.base_url}/v1/chat/completions", json=_body(max_tokens), timeout=30,
                      headers={"authorization": f"Bearer {KEYS[tenant]}"})


def metric(fe: FrontendProc, name: str) -> float:
    text = httpx.get(f"{fe.base_url}/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def test_three_frontends_sharing_redis_admit_one_tenants_60_rpm_once(cluster: Cluster) -> None:
    """300 requests in a burst over three frontends (each alone would have a share of 20): 60 in total
    are admitted, plus the one a second the bucket refills while the burst lasts."""
    start = time.monotonic()
    replies = send(cluster.frontends, "rpm", 300)
    elapsed = time.monotonic() - start
    admitted = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code == 429]
    print(f"\n300 requests over {N_FRONTENDS} frontends in {elapsed:.2f}s: {len(admitted)} admitted, "
          f"{len(refused)} refused")
    assert len(admitted) + len(refused) == 300, {r.status_code for r in replies}
    assert 60 <= len(admitted) <= 63, (len(admitted), elapsed)
    assert len(admitted) <= 60 + elapsed  # the bucket refills one a second
    by_frontend = [sum(1 for i, r in enumerate(replies) if i % N_FRONTENDS == k and r.status_code == 200)
                   for k in range(N_FRONTENDS)]
    assert max(by_frontend) > 20, by_frontend  # more than any one share: the limit was shared, not split
    err = refused[0].json()["error"]
    assert err["code"] == "rate_limit_exceeded" and "requests per minute (RPM)" in err["message"]
    assert refused[0].headers["x-should-retry"] == "true" and int(refused[0].headers["retry-after"]) >= 1
    assert all(metric(fe, "pdserve_frontend_limits_store_up") == 1 for fe in cluster.frontends)


def _use_up_quota(frontends: list[FrontendProc], tenant: str) -> tuple[int, dict[str, Any]]:
    """Sends one request at a time until the daily quota refuses; (requests admitted, the refusal)."""
    for n in range(200):
        r = one(frontends[n % len(frontends)], tenant, max_tokens=8)
        if r.status_code == 429:
            return n, r.json()["error"]
        assert r.status_code == 200, r.text
    raise AssertionError("the daily quota never refused")


def _restart_every_frontend_and_expect(cluster: Cluster, tenant: str, refusal: dict[str, Any]) -> None:
    """Restarts all the shared frontends; each then refuses the tenant with the same message."""
    for i, fe in enumerate(cluster.frontends):
        assert fe.stop() == 0
        cluster.frontends[i] = cluster.start_shared(i)
    after = [one(fe, tenant, max_tokens=8) for fe in cluster.frontends]
    assert [r.status_code for r in after] == [429] * N_FRONTENDS
    assert all(r.json()["error"]["message"] == refusal["message"] for r in after)


def test_daily_quota_survives_a_restart_of_every_frontend_and_rolls_over_at_midnight(cluster: Cluster) -> None:
    admitted, refusal = _use_up_quota(cluster.frontends, "quota")
    assert admitted >= 3 and refusal["code"] == "insufficient_quota"
    assert "exceeded its daily token quota (400 tokens" in refusal["message"]
    _restart_every_frontend_and_expect(cluster, "quota", refusal)
    # The same without Redis: one frontend, its ledger beside its state, restarted.
    solo = cluster.start(0, name="solo")
    try:
        admitted_solo, refusal_solo = _use_up_quota([solo], "solo")
        assert admitted_solo >= 1 and refusal_solo["code"] == "insufficient_quota"
        assert solo.stop() == 0
        solo = cluster.start(0, name="solo")
        r = one(solo, "solo", max_tokens=8)
        assert r.status_code == 429 and r.json()["error"]["message"] == refusal_solo["message"]
        # Midnight UTC passes (the clock hook): a new day's quota, in Redis and in the ledger alike.
        now = time.time()
        cluster.clock_file.write_text(repr((int(now // SECONDS_PER_DAY) + 1) * SECONDS_PER_DAY + 5 - now))
        time.sleep(0.05)
        assert one(cluster.frontends[1], "quota").status_code == 200
        assert one(solo, "solo").status_code == 200
    finally:
        cluster.clock_file.write_text("0")
        assert solo.stop() == 0
    print(f"\nquota 400 tokens: {admitted} requests admitted over {N_FRONTENDS} frontends, still refused after "
          f"restarting all of them; {admitted_solo} without Redis, still refused after a restart")


def test_spend_survives_a_restart_of_every_frontend(cluster: Cluster) -> None:
    """Spend charged at the models file's prices by three frontends sharing Redis reaches the tenant's daily
    budget; restarting every frontend keeps it reached (the spend is the store's, not a process's)."""
    admitted, refusal = _use_up_quota(cluster.frontends, "spender")
    assert admitted == 3, (admitted, refusal)  # $0.008 a request: refused once $0.024 >= $0.02 was spent
    assert refusal["code"] == "insufficient_quota"
    assert "tenant 'spender' reached its daily budget of $0.02 ($0.0240 spent)" in refusal["message"]
    spent = sum(metric(fe, "pdserve_frontend_cost_total") for fe in cluster.frontends)
    _restart_every_frontend_and_expect(cluster, "spender", refusal)
    print(f"\ndaily budget $0.02: {admitted} requests admitted (cost metric ${spent:.4f} over all tenants), "
          f"still refused after restarting all {N_FRONTENDS} frontends")


def test_budget_zero_admits_nothing_on_every_frontend(cluster: Cluster) -> None:
    for fe in cluster.frontends:
        r = one(fe, "broke")
        err = r.json()["error"]
        assert r.status_code == 429 and err["code"] == "insufficient_quota" and err["type"] == "insufficient_quota"
        assert "tenant 'broke' has a daily budget of $0.00: no request is admitted" in err["message"]
        assert r.headers["x-should-retry"] == "false"


def test_redis_down_each_frontend_holds_its_share_and_says_so(cluster: Cluster) -> None:
    """Redis killed mid-run: every frontend admits at most its share (30 RPM / 3 = 10), the gauge reads 0,
    one log line each; Redis back: the gauge reads 1 and admissions are shared again."""
    fallbacks_before = [metric(fe, "pdserve_frontend_limits_store_fallbacks_total") for fe in cluster.frontends]
    cluster.redis.stop()
    try:
        per_frontend = [send([fe], "share", 40) for fe in cluster.frontends]
        admitted = [sum(r.status_code == 200 for r in replies) for replies in per_frontend]
        print(f"\nRedis down: 40 requests to each frontend, admitted {admitted} (share 10 each of 30 RPM)")
        assert all(10 <= a <= 11 for a in admitted), admitted
        assert all(r.status_code in (200, 429) for replies in per_frontend for r in replies)
        for fe, before in zip(cluster.frontends, fallbacks_before, strict=True):
            assert metric(fe, "pdserve_frontend_limits_store_up") == 0
            assert metric(fe, "pdserve_frontend_limits_store_fallbacks_total") >= before + 40
            assert fe.proc.log_text().count("unreachable") == 1, fe.proc.tail()
    finally:
        cluster.redis.start()
    deadline = time.monotonic() + 10
    while not all(metric(fe, "pdserve_frontend_limits_store_up") == 1 for fe in cluster.frontends):
        assert time.monotonic() < deadline, [fe.proc.tail(5) for fe in cluster.frontends]
        time.sleep(0.2)
    counts = [metric(fe, "pdserve_frontend_limits_store_fallbacks_total") for fe in cluster.frontends]
    assert one(cluster.frontends[0], "rpm").status_code == 200  # a fresh Redis: a full bucket
    assert metric(cluster.frontends[0], "pdserve_frontend_limits_store_fallbacks_total") == counts[0]
    assert all("reachable again" in fe.proc.log_text() for fe in cluster.frontends)


def test_a_live_tenants_file_with_a_bad_budget_keeps_the_table_in_force(cluster: Cluster, tmp_path: Path) -> None:
    for value, says in ((-1, "must be a number of US dollars >= 0"), ("five", "got 'five'")):
        bad = tmp_path / "tenants.yaml"
        bad.write_bytes(orjson.dumps({"tenants": [{"name": "acme", "keys_sha256": ["a" * 64],
                                                   "monthly_budget_usd": value}]}))
        with pytest.raises(ConfigError, match="monthly_budget_usd") as err:
            TenantTable.from_file(bad)
        assert says in str(err.value)
    tenants = cluster.tmp / "live-tenants.yaml"
    tenants.write_bytes(cluster.tenants.read_bytes())
    fe = start_frontend("live", cluster.tmp, cluster.etcd.endpoints, free_port(), "--tenants", str(tenants),
                        "--models", str(cluster.models), "--request-log", "off", "--limits-redis", cluster.redis.url)
    try:
        entries = orjson.loads(tenants.read_bytes())["tenants"]
        for e in entries:
            if e["name"] == "broke":
                e["daily_budget_usd"] = -5
        (cluster.tmp / "next.yaml").write_bytes(orjson.dumps({"tenants": entries}))
        (cluster.tmp / "next.yaml").replace(tenants)
        deadline = time.monotonic() + 5
        while "cannot be used; keeping the tenants in force" not in fe.proc.log_text():
            assert time.monotonic() < deadline, fe.proc.tail()
            time.sleep(0.1)
        assert "daily_budget_usd must be a number of US dollars >= 0" in fe.proc.log_text()
        r = one(fe, "broke")
        assert r.status_code == 429 and "$0.00" in r.json()["error"]["message"]  # the old table's budget
    finally:
        assert fe.stop() == 0


# --- the store and the ledger in this process, against the real redis-server -------------------------


def _tenant(name: str, **limits: Any) -> Tenant:
    return Tenant(name, frozenset({"*"}), TenantLimits(**limits))


def _refusal(call: Any) -> APIError:
    try:
        call()
    except APIError as err:
        return err
    raise AssertionError("admitted")


def test_budgets_in_redis_refuse_until_the_day_and_the_month_roll_over(redis_server: RedisServer,  # noqa: F811
                                                                      tmp_path: Path) -> None:
    clock_file = tmp_path / "offset"
    now = time.time()
    clock_file.write_text(repr(next_month_start(now) + 86400 + 43200 - now))  # noon on the 2nd of next month
    wall = WallClock(str(clock_file))
    acme = _tenant("acme", daily_budget_usd=5.0, monthly_budget_usd=12.0)

    def move_to(target: float) -> None:
        clock_file.write_text(repr(float(clock_file.read_text()) + target - wall()))

    async def scenario() -> list[str]:
        limiter = Limiter(TenantLimiter(wall_clock=wall), RedisLimitStore(redis_server.url, f"b{time.time_ns()}", wall))
        await limiter.start()
        said: list[str] = []

        async def ask(cost: float) -> None:
            try:
                grant = await limiter.grant(acme, 10, 5)
            except APIError as err:
                assert err.status == 429 and err.code == "insufficient_quota" and err.headers["x-should-retry"] == "false"
                said.append(err.message)
                return
            grant.release(5, cost)
            await asyncio.sleep(0.05)  # the release is a task
            said.append("admitted")

        try:
            for cost in (2.5, 2.5, 2.5):  # $5 spent today: the third is refused
                await ask(cost)
            move_to((int(wall() // SECONDS_PER_DAY) + 1) * SECONDS_PER_DAY + 60)  # 00:01 the next day
            for cost in (2.5, 2.5, 2.5):  # $10 this month, $5 today
                await ask(cost)
            move_to((int(wall() // SECONDS_PER_DAY) + 1) * SECONDS_PER_DAY + 60)
            for cost in (2.5, 1.0):  # $12.50 this month
                await ask(cost)
            move_to(next_month_start(wall()) + 60)
            await ask(0.0)
        finally:
            await limiter.close()
        return said

    said = asyncio.run(scenario())
    daily = "tenant 'acme' reached its daily budget of $5.00 ($5.0000 spent); resets at 00:00 UTC."
    monthly = ("tenant 'acme' reached its monthly budget of $12.00 ($12.5000 spent); resets on the 1st of the month "
               "at 00:00 UTC.")
    assert said == ["admitted", "admitted", daily, "admitted", "admitted", daily, "admitted", monthly, "admitted"]


def test_monthly_budget_names_itself_and_zero_admits_nothing(redis_server: RedisServer) -> None:  # noqa: F811
    acme = _tenant("acme-month", monthly_budget_usd=1.0)
    zero = _tenant("acme-zero", daily_budget_usd=0.0)

    async def scenario() -> tuple[str, str]:
        limiter = Limiter(TenantLimiter(), RedisLimitStore(redis_server.url, f"month-{time.time_ns()}", time.time))
        await limiter.start()
        try:
            (await limiter.grant(acme, 1, 1)).release(1, 1.25)
            await asyncio.sleep(0.05)
            refused = []
            for tenant in (acme, zero):
                try:
                    await limiter.grant(tenant, 1, 1)
                except APIError as err:
                    refused.append(err.message)
            return refused[0], refused[1]
        finally:
            await limiter.close()

    month, zero_msg = asyncio.run(scenario())
    assert month == ("tenant 'acme-month' reached its monthly budget of $1.00 ($1.2500 spent); resets on the 1st of "
                     "the month at 00:00 UTC.")
    assert zero_msg.startswith("tenant 'acme-zero' has a daily budget of $0.00: no request is admitted")


def test_a_killed_frontends_holds_expire_with_their_lease(redis_server: RedisServer) -> None:  # noqa: F811
    one_slot = _tenant("lease", max_concurrent_requests=1, max_tokens_in_flight=100)

    async def scenario() -> tuple[str, float]:
        cluster = f"lease-{time.time_ns()}"
        dead = RedisLimitStore(redis_server.url, cluster, time.time, lease_s=1.0)
        await dead.admit(one_slot, 60, 10, 0)  # never released, never renewed: its frontend died
        await dead.close()
        alive = RedisLimitStore(redis_server.url, cluster, time.time, lease_s=1.0)
        try:
            try:
                await alive.admit(one_slot, 10, 10, 0)
                message = "admitted"
            except APIError as err:
                message = err.message
            start = time.monotonic()
            while True:
                try:
                    grant = await alive.admit(one_slot, 90, 10, 0)  # the dead one's 70 tokens are gone too
                    break
                except APIError:
                    await asyncio.sleep(0.1)
            waited = time.monotonic() - start
            grant.release(10)
            await asyncio.sleep(0.05)
            (await alive.admit(one_slot, 90, 10, 0)).release(0)  # released at the end: the slot is free again
            return message, waited
        finally:
            await alive.close()

    message, waited = asyncio.run(scenario())
    assert "Too many concurrent requests for tenant 'lease': limit 1" in message
    assert 0.5 < waited < 2.5, waited


def test_spend_and_tokens_survive_a_restart_in_the_local_ledger(tmp_path: Path) -> None:
    path = str(tmp_path / "limits.db")
    acme = _tenant("acme", daily_budget_usd=1.0, daily_token_quota=100)
    first = TenantLimiter(ledger=UsageLedger(path))
    first.grant(acme, 30, 20).release(10, 0.6)
    first.grant(acme, 30, 20).release(10, 0.6)
    first.ledger.close()
    again = TenantLimiter(ledger=UsageLedger(path))  # a restarted frontend
    err = _refusal(lambda: again.grant(acme, 1, 1))
    assert err.message == "tenant 'acme' reached its daily budget of $1.00 ($1.2000 spent); resets at 00:00 UTC."
    quota = TenantLimiter(ledger=UsageLedger(path))
    other = _tenant("acme", daily_token_quota=100)  # no budget now: the quota's turn
    err = _refusal(lambda: quota.grant(other, 30, 1))
    assert err.code == "insufficient_quota" and "80 used" in err.message
    share = TenantLimiter(share=2, index=0, ledger=UsageLedger(path, slot="0/2"))  # its own rows
    share.grant(other, 30, 10).release(10, 0.0)
