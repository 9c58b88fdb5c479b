"""Tenant limits shared by every frontend of a cluster, in Redis (`--limits-redis redis://...`), with the
local share (`frontend.limits.TenantLimiter`, `--limit-share K`) as the fallback while Redis is unreachable.

One round trip per admission: the `_ADMIT` Lua script checks every limit of the tenant (money budgets,
concurrency, the daily token quota, tokens in flight, the RPM / input TPM / output TPM buckets) and takes
them all together, or takes nothing and names the limit that refused; Redis runs a script atomically, so
the frontends' requests cannot interleave inside one. Bucket time is Redis's own clock (`TIME`), so the
frontends' clocks need not agree; the day and month of the quota and the budgets are the frontend's wall
clock (`wall_clock`). Keys (all of one tenant in one hash slot: `pdserve:limits:{cluster/tenant}:...`):

- `rpm`, `itpm`, `otpm`: a token bucket (hash: level, stamp), expiring once it would be full again;
- `leases` (sorted set: grant id -> expiry) and `tif` (hash: grant id -> tokens in flight): concurrency and
  tokens in flight. A grant is released when its request ends (`_RELEASE`); while it runs its frontend
  renews its lease every lease/3 s, so a killed frontend's holds expire after `lease_s`, not never;
- `tokens:d<day>`: tokens charged that UTC day (expires after 2 days);
- `usd:d<day>`, `usd:m<YYYYMM>`: USD spent that day / month (charged at the end; expire after 2 / 32 days).

Fallback (`Limiter`): an admission that cannot reach Redis is decided by the local share, and so is every
admission until a background ping finds Redis back (one log line each way,
`pdserve_frontend_limits_store_up` 0/1, `pdserve_frontend_limits_store_fallbacks_total` per admission
decided locally). A frontend thus never admits more than its share while alone. What is charged locally
stays in the local `UsageLedger`; it is not copied into Redis when Redis returns.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.frontend.errors import QUOTA, RATE_LIMIT, APIError
from pdserve.frontend.limits import (
    SECONDS_PER_DAY,
    AnyGrant,
    TenantLimiter,
    UsageLedger,
    budget_refusal,
    utc_day,
    utc_month,
)
from pdserve.frontend.tenants import Tenant

log = logging.getLogger(__name__)

# A test hook for the period boundaries: a file holding seconds added to the wall clock of the limits (the
# day and month of quotas and budgets), re-read when it changes, so a test can move a running frontend
# past midnight. Unset in production.
CLOCK_FILE_ENV = "PDSERVE_LIMITS_CLOCK_FILE"
_PING_S = 0.5  # how often an unreachable store is tried again
_REDIS_TIMEOUT_S = 0.5  # a store slower than this for one command counts as unreachable


class WallClock:
    """time.time(), plus the offset in the file named by $PDSERVE_LIMITS_CLOCK_FILE when set."""

    def __init__(self, path: str | None = None) -> None:
        self._path = path if path is not None else os.environ.get(CLOCK_FILE_ENV) or None
        self._stamp: float | None = None
        self._offset = 0.0

    def __call__(self) -> float:
        if self._path is not None:
            try:
                stamp = os.stat(self._path).st_mtime
                if stamp != self._stamp:
                    with open(self._path) as f:
                        self._offset, self._stamp = float(f.read().strip() or 0), stamp
            except (OSError, ValueError):
                pass
        return time.time() + self._offset


_BUCKET = """
local function bucket(key, limit, now)
  if limit < 0 then return nil end
  local v = redis.call('HMGET', key, 'level', 'stamp')
  local level, stamp = tonumber(v[1]), tonumber(v[2])
  if level == nil or stamp == nil then return limit end
  if now > stamp then level = level + (now - stamp) * limit / 60 end
  if level > limit then level = limit end
  return level
end
local function put(key, limit, level, now)
  redis.call('HSET', key, 'level', tostring(level), 'stamp', tostring(now))
  local full_in = 60
  if limit > 0 then full_in = (limit - level) * 60 / limit end
  redis.call('PEXPIRE', key, math.ceil(full_in * 1000) + 1000)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# KEYS: rpm itpm otpm leases tif tokens_day usd_day usd_month
# ARGV: rpm itpm otpm concurrency tif_cap quota day_budget month_budget (-1: none), input firm estimate,
#       grant id, lease_s, day_ttl, month_ttl
_ADMIT = _BUCKET + """
local a = {}
for i = 1, 11 do a[i] = tonumber(ARGV[i]) end
local rpm, itpm, otpm, conc, tif_cap, quota, dbudget, mbudget = a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8]
local input, firm, est = a[9], a[10], a[11]
local id, lease_s, day_ttl, month_ttl = ARGV[12], tonumber(ARGV[13]), tonumber(ARGV[14]), tonumber(ARGV[15])
if dbudget >= 0 then
  local spent = tonumber(redis.call('GET', KEYS[7]) or '0')
  if dbudget == 0 or spent >= dbudget then return {0, 'daily_budget', tostring(spent)} end
end
if mbudget >= 0 then
  local spent = tonumber(redis.call('GET', KEYS[8]) or '0')
  if mbudget == 0 or spent >= mbudget then return {0, 'monthly_budget', tostring(spent)} end
end
local expired = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
if #expired > 0 then
  redis.call('HDEL', KEYS[5], unpack(expired))
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
end
if conc >= 0 then
  local n = redis.call('ZCARD', KEYS[4])
  if n >= conc then return {0, 'concurrency', tostring(n)} end
end
local ol = bucket(KEYS[3], otpm, now)
if ol ~= nil then est = math.min(est, math.max(0, otpm - firm)) end
local reserve = firm + math.max(0, est)
local used = 0
if quota >= 0 then
  used = tonumber(redis.call('GET', KEYS[6]) or '0')
  local over = used + input + reserve - quota
  if over > 0 then reserve = reserve - math.min(over, math.max(0, est)) end
  if used + input + reserve > quota then return {0, 'quota', tostring(used), tostring(input + reserve)} end
end
local amount = input + reserve
if tif_cap >= 0 then
  if amount > tif_cap then return {0, 'tokens_in_flight_too_large', tostring(amount)} end
  local inflight = 0
  for _, v in ipairs(redis.call('HVALS', KEYS[5])) do inflight = inflight + tonumber(v) end
  if inflight + amount > tif_cap then return {0, 'tokens_in_flight', tostring(inflight), tostring(amount)} end
end
local rl = bucket(KEYS[1], rpm, now)
local il = bucket(KEYS[2], itpm, now)
local checks = {{KEYS[1], rl, rpm, 1, 'rpm'}, {KEYS[2], il, itpm, input, 'input_tpm'},
                {KEYS[3], ol, otpm, reserve, 'output_tpm'}}
for _, c in ipairs(checks) do
  if c[2] ~= nil then
    if c[4] > c[3] then return {0, c[5] .. '_too_large', tostring(c[4])} end
    if c[2] < c[4] then
      return {0, c[5], tostring(c[4]), tostring(c[2]), tostring((c[4] - c[2]) * 60 / c[3])}
    end
  end
end
for _, c in ipairs(checks) do
  if c[2] ~= nil then put(c[1], c[3], c[2] - c[4], now) end
end
redis.call('ZADD', KEYS[4], now + lease_s, id)
redis.call('HSET', KEYS[5], id, amount)
redis.call('EXPIRE', KEYS[4], math.ceil(lease_s) + 60)
redis.call('EXPIRE', KEYS[5], math.ceil(lease_s) + 60)
local today = redis.call('INCRBY', KEYS[6], amount)
redis.call('EXPIRE', KEYS[6], day_ttl)
return {1, tostring(reserve), tostring(today)}
"""

# KEYS: otpm leases tif tokens_day(of the grant) usd_day usd_month
# ARGV: grant id, unused output (< 0: generated beyond the reservation), otpm (-1: none), usd, day_ttl, month_ttl
_RELEASE = _BUCKET + """
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
local unused, otpm, usd = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if otpm >= 0 and unused ~= 0 then
  local level = bucket(KEYS[1], otpm, now) + unused
  if level > otpm then level = otpm end
  put(KEYS[1], otpm, level, now)
end
if unused ~= 0 then
  local today = tonumber(redis.call('GET', KEYS[4]) or 'nil')
  if today ~= nil then
    local left = today - unused
    if left < 0 then left = 0 end
    redis.call('SET', KEYS[4], left, 'KEEPTTL')
  end
end
if usd > 0 then
  redis.call('INCRBYFLOAT', KEYS[5], ARGV[4])
  redis.call('EXPIRE', KEYS[5], tonumber(ARGV[5]))
  redis.call('INCRBYFLOAT', KEYS[6], ARGV[4])
  redis.call('EXPIRE', KEYS[6], tonumber(ARGV[6]))
end
return 1
"""

# KEYS: leases tif; ARGV: lease_s, grant ids (only leases still held are renewed)
_RENEW = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i]) end
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1])) + 60)
redis.call('EXPIRE', KEYS[2], math.ceil(tonumber(ARGV[1])) + 60)
return 1
"""

_DAY_TTL_S = 2 * 86400
_MONTH_TTL_S = 32 * 86400


def _arg(limit: int | float | None) -> str:
    return "-1" if limit is None else repr(limit)


@dataclass(eq=False)
class SharedGrant:
    """A grant held in Redis. `release` hands the settlement to the store (a task: the job's end is
    synchronous); when that fails the lease expires by itself and the spend goes to the local ledger."""

    store: RedisLimitStore
    tenant: Tenant
    id: str
    input_tokens: int
    output_reserved: int
    day: int
    released: bool = field(default=False)

    def release(self, output_used: int, cost_usd: float = 0.0) -> None:
        if self.released:
            return
        self.released = True
        self.store.release_later(self, output_used, cost_usd)


class RedisLimitStore:
    """The shared limits of a cluster's tenants in one Redis (see the module docstring)."""

    def __init__(self, url: str, cluster: str, wall: Callable[[], float], lease_s: float = 30.0) -> None:
        assert lease_s > 0, lease_s
        self.url, self.lease_s, self._wall = url, lease_s, wall
        self._prefix = f"pdserve:limits:{{{cluster}/"
        # Imported here: redis-py pulls in the OpenTelemetry SDK, which a frontend without a store never loads.
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import RedisError

        self.errors: tuple[type[Exception], ...] = (RedisError, OSError)  # what "unreachable" means
        self.redis = aioredis.Redis.from_url(url, socket_timeout=_REDIS_TIMEOUT_S,
                                             socket_connect_timeout=_REDIS_TIMEOUT_S, retry=Retry(NoBackoff(), 0),
                                             health_check_interval=0)
        self._admit = self.redis.register_script(_ADMIT)
        self._release = self.redis.register_script(_RELEASE)
        self._renew = self.redis.register_script(_RENEW)
        self.held: dict[str, dict[str, SharedGrant]] = {}  # tenant -> grant id -> grant, for lease renewal
        self.on_release_failed: Callable[[SharedGrant, int, float, Exception], None] = lambda *_: None
        self._tasks: set[asyncio.Task[Any]] = set()

    def _key(self, tenant: str, name: str) -> str:
        return f"{self._prefix}{tenant}}}:{name}"

    async def ping(self) -> None:
        await self.redis.ping()

    async def admit(self, tenant: Tenant, input_tokens: int, output_reserve: int, output_estimate: int) -> SharedGrant:
        """Takes every limit of `tenant` for one request, or raises the 429 APIError naming the one that
        refused. RedisError/OSError: the store is unreachable (nothing was taken)."""
        lim, wall = tenant.limits, self._wall()
        day, month = utc_day(wall), utc_month(wall)
        k = self._key
        name = tenant.name
        grant_id = uuid.uuid4().hex
        keys = [k(name, "rpm"), k(name, "itpm"), k(name, "otpm"), k(name, "leases"), k(name, "tif"),
                k(name, f"tokens:d{day}"), k(name, f"usd:d{day}"), k(name, f"usd:m{month}")]
        args = [_arg(lim.requests_per_minute), _arg(lim.input_tokens_per_minute), _arg(lim.output_tokens_per_minute),
                _arg(lim.max_concurrent_requests), _arg(lim.max_tokens_in_flight), _arg(lim.daily_token_quota),
                _arg(lim.daily_budget_usd), _arg(lim.monthly_budget_usd), str(input_tokens), str(output_reserve),
                str(max(0, output_estimate)), grant_id, repr(self.lease_s), str(_DAY_TTL_S), str(_MONTH_TTL_S)]
        result = await self._admit(keys=keys, args=args)
        if int(result[0]) != 1:
            raise _refusal(tenant, [r.decode() if isinstance(r, bytes) else str(r) for r in result[1:]], wall)
        reserved = int(float(result[1]))  # firm + the estimate as cut to the output bucket and the quota
        grant = SharedGrant(self, tenant, grant_id, input_tokens, reserved, day)
        self.held.setdefault(name, {})[grant_id] = grant
        return grant

    def release_later(self, grant: SharedGrant, output_used: int, cost_usd: float) -> None:
        self.held.get(grant.tenant.name, {}).pop(grant.id, None)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError as err:  # no event loop (shutting down): the lease expires, the ledger keeps the rest
            self.on_release_failed(grant, output_used, cost_usd, err)
            return
        task = loop.create_task(self._settle(grant, output_used, cost_usd))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _settle(self, grant: SharedGrant, output_used: int, cost_usd: float) -> None:
        name, wall = grant.tenant.name, self._wall()
        k = self._key
        keys = [k(name, "otpm"), k(name, "leases"), k(name, "tif"), k(name, f"tokens:d{grant.day}"),
                k(name, f"usd:d{utc_day(wall)}"), k(name, f"usd:m{utc_month(wall)}")]
        otpm = grant.tenant.limits.output_tokens_per_minute
        args = [grant.id, str(grant.output_reserved - output_used), _arg(otpm), repr(max(0.0, cost_usd)),
                str(_DAY_TTL_S), str(_MONTH_TTL_S)]
        try:
            await self._release(keys=keys, args=args)
        except self.errors as err:
            self.on_release_failed(grant, output_used, cost_usd, err)

    async def renew(self) -> None:
        """Extends the leases of the grants this frontend holds (one script per tenant, pipelined)."""
        held = {name: list(grants) for name, grants in self.held.items() if grants}
        for name in [n for n, g in self.held.items() if not g]:
            del self.held[name]
        if not held:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for name, ids in held.items():
                await self._renew(keys=[self._key(name, "leases"), self._key(name, "tif")],
                                  args=[repr(self.lease_s), *ids], client=pipe)
            await pipe.execute()

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2)
        await self.redis.aclose()


def _refusal(tenant: Tenant, info: list[str], wall: float) -> APIError:
    """The 429 of a refusal `_ADMIT` returned: the same messages and headers as the local limiter's."""
    what, lim, name = info[0], tenant.limits, tenant.name
    if what in ("daily_budget", "monthly_budget"):
        which = what.split("_")[0]
        budget = getattr(lim, f"{which}_budget_usd")
        return budget_refusal(tenant, which, float(budget), float(info[1]), wall)
    if what == "concurrency":
        return APIError(429, f"Too many concurrent requests for tenant {name!r}: limit {lim.max_concurrent_requests}. "
                        "Retry when one finishes.", type=RATE_LIMIT, code="concurrency_limit_exceeded",
                        limit="concurrency", headers={"retry-after": "1", "x-should-retry": "true"})
    if what == "quota":
        reset_in = (utc_day(wall) + 1) * SECONDS_PER_DAY - wall
        return APIError(429, f"Tenant {name!r} exceeded its daily token quota ({lim.daily_token_quota} tokens; "
                        f"{info[1]} used, {info[2]} requested). The quota resets at 00:00 UTC.", type=QUOTA,
                        code="insufficient_quota", limit="quota",
                        headers={"retry-after": str(max(1, math.ceil(reset_in))), "x-should-retry": "false"})
    if what == "tokens_in_flight_too_large":
        return APIError(429, f"Request too large for tenant {name!r}: {info[1]} prompt and output tokens, more than "
                        f"its limit of {lim.max_tokens_in_flight} tokens in flight. Reduce the prompt or max_tokens; "
                        "retrying will not help.", type=RATE_LIMIT, code="request_too_large", limit="tokens_in_flight",
                        headers={"x-should-retry": "false"})
    if what == "tokens_in_flight":
        return APIError(429, f"Too many tokens in flight for tenant {name!r}: {info[1]} in flight, {info[2]} "
                        f"requested, limit {lim.max_tokens_in_flight}. Retry when a request finishes.",
                        type=RATE_LIMIT, code="tokens_in_flight_limit_exceeded", limit="tokens_in_flight",
                        headers={"retry-after": "1", "x-should-retry": "true"})
    bucket, _, too_large = what.partition("_too_large")
    label, limit, kind = {
        "rpm": ("requests per minute (RPM)", lim.requests_per_minute, "requests"),
        "input_tpm": ("input tokens per minute (ITPM)", lim.input_tokens_per_minute, "tokens"),
        "output_tpm": ("output tokens per minute (OTPM)", lim.output_tokens_per_minute, "tokens"),
    }[bucket]
    if what.endswith("_too_large"):
        return APIError(429, f"Request too large for tenant {name!r} on {label}: limit {limit}, requested {info[1]}. "
                        "Reduce the prompt or max_tokens; retrying will not help.", type=RATE_LIMIT,
                        code="request_too_large", limit=bucket, headers={"x-should-retry": "false"})
    wait = float(info[3])
    return APIError(429, f"Rate limit reached for tenant {name!r} on {label}: limit {limit}, requested {info[1]}, "
                    f"available {max(0, int(float(info[2])))}. Please try again in {wait:.2f}s.", type=RATE_LIMIT,
                    code="rate_limit_exceeded", limit=bucket,
                    headers={"retry-after": str(max(1, math.ceil(wait))), "x-should-retry": "true",
                             f"x-ratelimit-limit-{kind}": str(limit)})


class Limiter:
    """The tenants' limits of one frontend: in the shared store when one is configured and reachable,
    else this frontend's share (`TenantLimiter`), which also keeps today's tokens and the spend in a
    local `UsageLedger`."""

    def __init__(self, local: TenantLimiter, store: RedisLimitStore | None, up_gauge: Any = None,
                 fallbacks: Any = None) -> None:
        self.local, self.store = local, store
        self._up_gauge, self._fallbacks = up_gauge, fallbacks
        self.up = store is not None
        self._pinger: asyncio.Task[None] | None = None
        self._renewer: asyncio.Task[None] | None = None
        if store is not None:
            store.on_release_failed = self._release_failed
        self._set_up(self.up)

    @property
    def shared(self) -> bool:
        """True while admissions are decided in the shared store."""
        return self.store is not None and self.up

    def _set_up(self, up: bool) -> None:
        self.up = up
        if self._up_gauge is not None:
            self._up_gauge.set(1 if up else 0)

    async def start(self) -> None:
        """Connects to the store (or starts in fallback, retrying in the background) and renews leases."""
        if self.store is None:
            return
        try:
            await self.store.ping()
        except self.store.errors as err:
            self._lost(err)
        self._renewer = asyncio.get_running_loop().create_task(self._renew_loop())

    async def close(self) -> None:
        for task in (self._pinger, self._renewer):
            if task is not None:
                task.cancel()
        if self.store is not None:
            await self.store.close()
        self.local.ledger.close()

    def _lost(self, err: Exception) -> None:
        """The store became unreachable: one log line, the gauge, and a background ping until it is back."""
        if not self.up and self._pinger is not None:
            return
        assert self.store is not None
        self._set_up(False)
        log.error("limits store %s unreachable (%s: %s); each tenant's limits fall back to this frontend's share "
                  "(1/%d) until it is back", _safe_url(self.store.url), type(err).__name__, err, self.local.share)
        self._pinger = asyncio.get_running_loop().create_task(self._ping_until_back())

    async def _ping_until_back(self) -> None:
        assert self.store is not None
        while True:
            await asyncio.sleep(_PING_S)
            try:
                await self.store.ping()
            except self.store.errors:
                continue
            self._set_up(True)
            self._pinger = None
            log.warning("limits store %s reachable again; tenant limits are shared again", _safe_url(self.store.url))
            return

    async def _renew_loop(self) -> None:
        assert self.store is not None
        while True:
            await asyncio.sleep(self.store.lease_s / 3)
            if not self.up:
                continue
            try:
                await self.store.renew()
            except self.store.errors as err:
                self._lost(err)

    def _release_failed(self, grant: SharedGrant, output_used: int, cost_usd: float, err: Exception) -> None:
        """A shared grant's settlement did not reach the store: its lease expires there by itself; the
        tokens and the spend are kept in the local ledger."""
        self.local.ledger.charge(grant.tenant.name, grant.day, grant.input_tokens + output_used, cost_usd,
                                 self.local.wall())
        if isinstance(err, self.store.errors):
            self._lost(err)

    def precheck(self, tenant: Tenant) -> None:
        """The early check before tokenizing: local only (the shared check is the one round trip of `grant`)."""
        if self.shared:
            return
        try:
            self.local.precheck(tenant)
        except APIError:
            if self.store is not None and self._fallbacks is not None:
                self._fallbacks.inc()  # refused by the local share: a decision made without the store
            raise

    async def grant(self, tenant: Tenant, input_tokens: int, output_reserve: int,
                    output_estimate: int = 0) -> AnyGrant:
        """Takes the request's charges (see `TenantLimiter.grant`), in the store when it is reachable."""
        if self.store is not None and self.up:
            try:
                return await self.store.admit(tenant, input_tokens, output_reserve, output_estimate)
            except self.store.errors as err:
                self._lost(err)
        if self.store is not None and self._fallbacks is not None:
            self._fallbacks.inc()
        return self.local.grant(tenant, input_tokens, output_reserve, output_estimate)

    def update(self, tenants: list[Tenant]) -> None:
        self.local.update(tenants)  # the store reads the limits from each request's tenant

    def zero_shares(self, tenants: list[Tenant]) -> list[str]:
        return self.local.zero_shares(tenants)


def _safe_url(url: str) -> str:
    """The URL without a password, for log lines."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    auth, _, host = rest.rpartition("@")
    user = auth.split(":", 1)[0]
    return f"{scheme}://{user + ':***@' if user else '***@'}{host}"


def limits_ledger_path(response_store: str) -> str:
    """Where the local usage ledger lives: an SQLite file beside the response store's (its state
    directory), or the default state directory when the response store is PostgreSQL or in memory."""
    from pathlib import Path

    from pdserve.frontend.config import default_response_store
    from pdserve.frontend.response_store import SqliteResponseStore, open_store

    store = open_store(response_store)
    if isinstance(store, SqliteResponseStore) and store.path == ":memory:":
        return ":memory:"
    path = Path(store.path if isinstance(store, SqliteResponseStore) else default_response_store())
    return str(path.with_name(f"{path.stem}-limits{path.suffix or '.db'}"))


__all__ = ["CLOCK_FILE_ENV", "AnyGrant", "Limiter", "RedisLimitStore", "SharedGrant", "UsageLedger", "WallClock",
           "limits_ledger_path"]
