"""Per-tenant limits: token buckets for requests, input and output tokens, concurrency and a daily quota.

A request's charges are granted atomically (every limit checked before any is charged, and nothing awaits
in between, so concurrent requests on the event loop cannot interleave): the `Grant`. Its output budget is
its `max_tokens` (times the number of choices), taken up front; `Grant.release` refunds what it did not
use. A choice without `max_tokens` (the openai SDK sends none) may generate up to the context, so it
reserves an estimate instead (`output_tokens_estimate`), never more than the bucket or the day's quota
can hold, so leaving max_tokens out never makes a request too large; when it ends it is charged what it
generated, which may put the bucket into debt that later requests wait out. Limits are per process: with K frontends, run each with `limit_share=K` (see FrontendConfig), which
gives every process 1/K of each limit; a balancer that pins a tenant's key to one frontend (hash on the
Authorization header) can instead give that process the whole limit.

Soft limits (a bucket that refills) answer 429 with `Retry-After`; hard ones (the daily quota, a money
budget, or a request larger than the bucket could ever hold) answer 429 with `x-should-retry: false` so SDKs
do not retry.

Money budgets (`daily_budget_usd`, `monthly_budget_usd`) are checked at admission against what the tenant
has spent in the UTC day / month; a request's cost is charged when it ends (`Grant.release`), so requests
admitted together may overshoot a budget by what they cost. Today's tokens and the spend are kept in a
`UsageLedger` (an SQLite file), so they survive a restart. With several frontends sharing a Redis
(`frontend.limit_store`) this limiter is the fallback for when Redis cannot be reached.
"""

from __future__ import annotations

import calendar
import math
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pdserve.frontend.errors import QUOTA, RATE_LIMIT, APIError
from pdserve.frontend.tenants import Tenant, TenantLimits

SECONDS_PER_DAY = 86400.0
_LEDGER_KEEP_DAYS = 40  # older rows of the usage ledger are deleted when it opens


def utc_day(wall: float) -> int:
    """The UTC day number of a wall-clock time (days since 1970-01-01)."""
    return int(wall // SECONDS_PER_DAY)


def utc_month(wall: float) -> int:
    """The UTC month of a wall-clock time as YYYYMM."""
    t = time.gmtime(wall)
    return t.tm_year * 100 + t.tm_mon


def next_month_start(wall: float) -> float:
    """The wall-clock time at which the UTC month of `wall` ends."""
    t = time.gmtime(wall)
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return float(calendar.timegm((year, month, 1, 0, 0, 0, 0, 0, 0)))


def budget_refusal(tenant: Tenant, which: str, budget: float, spent: float, wall: float,
                   share: int = 1) -> APIError:
    """429 for a tenant whose daily or monthly money budget is spent (or is 0): hard until the period
    rolls over. `share` > 1: the budget is this frontend's share of the tenant's (the limits store is down)."""
    if which == "daily":
        reset_in, resets = (utc_day(wall) + 1) * SECONDS_PER_DAY - wall, "resets at 00:00 UTC"
    else:
        reset_in, resets = next_month_start(wall) - wall, "resets on the 1st of the month at 00:00 UTC"
    of = f" (this frontend's 1/{share} share)" if share > 1 else ""
    if budget <= 0:
        message = (f"tenant {tenant.name!r} has a {which} budget of $0.00{of}: no request is admitted until the "
                   "budget is raised in the tenants file.")
    else:
        message = (f"tenant {tenant.name!r} reached its {which} budget of ${budget:.2f}{of} (${spent:.4f} spent); "
                   f"{resets}.")
    return APIError(429, message, type=QUOTA, code="insufficient_quota", limit=f"{which}_budget",
                    headers={"retry-after": _retry_after(reset_in), "x-should-retry": "false"})


class UsageLedger:
    """Tokens charged per UTC day and USD spent per UTC day and month, per tenant, in an SQLite file (or
    in memory: ":memory:"), so the daily quota and the budgets survive a restart. `slot` keeps apart the
    rows of frontends that share the file with different limit shares (each restores its own). Rows are
    cached: reads cost nothing, each charge is one upsert."""

    def __init__(self, path: str = ":memory:", slot: str = "") -> None:
        self.path, self.slot = path, slot
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=5)
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS usage (slot TEXT NOT NULL, tenant TEXT NOT NULL, period TEXT "
                         "NOT NULL, tokens INTEGER NOT NULL DEFAULT 0, usd REAL NOT NULL DEFAULT 0, "
                         "PRIMARY KEY (slot, tenant, period))")
        oldest = utc_day(time.time()) - _LEDGER_KEEP_DAYS
        self._db.execute("DELETE FROM usage WHERE period LIKE 'd:%' AND CAST(substr(period, 3) AS INTEGER) < ?",
                         (oldest,))
        self._rows: dict[tuple[str, str], tuple[int, float]] = {}

    def _row(self, tenant: str, period: str) -> tuple[int, float]:
        row = self._rows.get((tenant, period))
        if row is None:
            with self._lock:
                got = self._db.execute("SELECT tokens, usd FROM usage WHERE slot = ? AND tenant = ? AND period = ?",
                                       (self.slot, tenant, period)).fetchone()
            row = (int(got[0]), float(got[1])) if got else (0, 0.0)
            self._rows[(tenant, period)] = row
        return row

    def day_tokens(self, tenant: str, day: int) -> int:
        return self._row(tenant, f"d:{day}")[0]

    def spent(self, tenant: str, which: str, wall: float) -> float:
        """USD `tenant` spent in the UTC day (which="daily") or month ("monthly") of `wall`."""
        period = f"d:{utc_day(wall)}" if which == "daily" else f"m:{utc_month(wall)}"
        return self._row(tenant, period)[1]

    def charge(self, tenant: str, day: int, tokens: int, usd: float, wall: float) -> None:
        """Adds `tokens` to day `day` (when the request was granted) and `usd` to the day and month of `wall`
        (when it ended)."""
        adds = [(f"d:{day}", tokens, 0.0)]
        if usd > 0:
            adds += [(f"d:{utc_day(wall)}", 0, usd), (f"m:{utc_month(wall)}", 0, usd)]
        for period, n, dollars in adds:
            old = self._row(tenant, period)
            self._rows[(tenant, period)] = (old[0] + n, old[1] + dollars)
            with self._lock:
                self._db.execute("INSERT INTO usage (slot, tenant, period, tokens, usd) VALUES (?, ?, ?, ?, ?) "
                                 "ON CONFLICT (slot, tenant, period) DO UPDATE SET tokens = tokens + excluded.tokens, "
                                 "usd = usd + excluded.usd", (self.slot, tenant, period, n, dollars))

    def close(self) -> None:
        with self._lock:
            self._db.close()
_SHARED_LIMITS = ("requests_per_minute", "input_tokens_per_minute", "output_tokens_per_minute",
                  "max_concurrent_requests", "daily_token_quota", "max_tokens_in_flight")


@dataclass(eq=False)
class TokenBucket:
    """Holds up to `capacity` tokens, refilled continuously at `rate` per second."""

    capacity: float
    rate: float
    level: float
    stamp: float
    largest_share: float = 0.0  # the capacity of the largest share of this limit on any frontend

    @classmethod
    def per_minute(cls, limit: int, now: float, largest_share: int | None = None) -> TokenBucket:
        """A full bucket of `limit` refilled over a minute (a limit of 0 is empty for good)."""
        largest = float(limit if largest_share is None else largest_share)
        return cls(capacity=float(limit), rate=limit / 60.0, level=float(limit), stamp=now, largest_share=largest)

    def refill(self, now: float) -> None:
        """Adds what accrued since the last call."""
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` is available (after `refill`); inf when it exceeds the capacity."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate)

    def take(self, amount: float) -> None:
        """Removes `amount`; the level may go below zero (a debt later requests wait out)."""
        self.level -= amount

    def give(self, amount: float) -> None:
        """Returns unused tokens, never above capacity."""
        self.level = min(self.capacity, self.level + amount)


@dataclass(eq=False)
class TenantState:
    """The live counters of one tenant in this process."""

    limits: TenantLimits
    requests: TokenBucket | None
    input_tokens: TokenBucket | None
    output_tokens: TokenBucket | None
    concurrent: int = 0
    tokens_in_flight: int = 0  # prompt + reserved output tokens of the requests granted and not ended
    day: int = -1  # UTC day number the daily counter belongs to
    day_used: int = 0  # tokens charged today (reserved output included until refunded)


class AnyGrant(Protocol):
    """What admission took for one request (here or in the shared store, `frontend.limit_store`);
    `release` (once, when the request ends) gives it back and charges what the request cost."""

    def release(self, output_used: int, cost_usd: float = 0.0) -> None: ...


@dataclass(eq=False)
class Grant:
    """What admission took from a tenant's limits for one request; `release` gives it back once, when the
    request ends."""

    tenant: Tenant
    state: TenantState
    input_tokens: int
    output_reserved: int
    day: int
    ledger: UsageLedger | None = None
    wall: Callable[[], float] = time.time
    released: bool = field(default=False)

    def release(self, output_used: int, cost_usd: float = 0.0) -> None:
        """Frees the concurrency slot and settles the output reservation against `output_used`: the
        unused part is refunded, generation beyond an estimated reservation is charged (the bucket may
        go into debt). `cost_usd` (what the request cost) is charged to the tenant's spend."""
        if self.released:
            return
        self.released = True
        if self.ledger is not None:
            self.ledger.charge(self.tenant.name, self.day, self.input_tokens + output_used, cost_usd, self.wall())
        self.state.concurrent -= 1
        self.state.tokens_in_flight -= self.input_tokens + self.output_reserved
        unused = self.output_reserved - output_used
        bucket = self.state.output_tokens
        if bucket is not None:
            if unused >= 0:
                bucket.give(unused)
            else:
                bucket.take(-unused)
        if self.state.day == self.day:
            self.state.day_used = max(0, self.state.day_used - unused)


def _retry_after(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


class TenantLimiter:
    """Grants or refuses requests their charges per tenant (changes the tenants' counters and buckets)."""

    def __init__(self, share: int = 1, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, index: int | None = None,
                 ledger: UsageLedger | None = None) -> None:
        assert share >= 1 and (index is None or 0 <= index < share), (share, index)
        self._share = share
        self._index = index
        self._clock = clock
        self._wall = wall_clock
        self._states: dict[str, TenantState] = {}
        self.ledger = ledger or UsageLedger()

    @property
    def share(self) -> int:
        return self._share

    def wall(self) -> float:
        """The wall clock of the daily and monthly periods."""
        return self._wall()

    def _scaled(self, limit: int | None) -> int | None:
        """This process's share of `limit` (None: unlimited); the shares of indices 0..K-1 sum to it."""
        if limit is None:
            return None
        base, rest = divmod(limit, self._share)
        return base + (1 if self._index is not None and self._index < rest else 0)

    def _largest(self, limit: int) -> int:
        """The largest share of `limit` any frontend holds."""
        return math.ceil(limit / self._share) if self._index is not None else limit // self._share

    def _bucket(self, limit: int | None, now: float) -> TokenBucket | None:
        share = self._scaled(limit)
        return None if limit is None or share is None else TokenBucket.per_minute(share, now, self._largest(limit))

    def _scaled_usd(self, budget: float) -> float:
        """This process's share of a money budget."""
        return budget / self._share

    def zero_shares(self, tenants: list[Tenant]) -> list[str]:
        """`tenant.limit` names whose share in this process is zero (for a startup warning)."""
        return [f"{t.name}.{f}" for t in tenants for f in _SHARED_LIMITS
                if self._scaled(getattr(t.limits, f)) == 0]

    def state(self, tenant: Tenant) -> TenantState:
        st = self._states.get(tenant.name)
        if st is None:
            lim, now = tenant.limits, self._clock()
            st = TenantState(
                limits=lim,
                requests=self._bucket(lim.requests_per_minute, now),
                input_tokens=self._bucket(lim.input_tokens_per_minute, now),
                output_tokens=self._bucket(lim.output_tokens_per_minute, now),
            )
            self._states[tenant.name] = st
        return st

    def update(self, tenants: list[Tenant]) -> None:
        """A reloaded tenants file: tenants whose limits changed get them for their next requests (the
        per-minute buckets anew, full; what is in flight and today's count are kept). Requests already
        granted release into the state they were granted from."""
        now = self._clock()
        for t in tenants:
            st = self._states.get(t.name)
            if st is None or st.limits == t.limits:
                continue
            lim = t.limits
            st.limits = lim
            st.requests = self._bucket(lim.requests_per_minute, now)
            st.input_tokens = self._bucket(lim.input_tokens_per_minute, now)
            st.output_tokens = self._bucket(lim.output_tokens_per_minute, now)

    def precheck(self, tenant: Tenant) -> None:
        """Rejects early (before tokenizing) when the request or concurrency limit is already hit.
        Charges nothing."""
        st = self.state(tenant)
        self.check_budgets(tenant)
        self._check_concurrency(tenant, st)
        if st.requests is not None:
            st.requests.refill(self._clock())
            self._check_bucket(tenant, st.requests, 1, "requests", "requests per minute (RPM)", "rpm")

    def grant(self, tenant: Tenant, input_tokens: int, output_reserve: int, output_estimate: int = 0) -> Grant:
        """Charges one request: `input_tokens`, the firm output reservation `output_reserve` (the sum of
        the max_tokens the client sent) and `output_estimate` (what choices without max_tokens reserve,
        cut to what the output bucket and the daily quota can hold); or raises a 429 APIError."""
        st = self.state(tenant)
        now = self._clock()
        self.check_budgets(tenant)
        self._check_concurrency(tenant, st)
        if st.output_tokens is not None:
            output_estimate = min(output_estimate, max(0, int(st.output_tokens.capacity) - output_reserve))
        output_reserve += max(0, output_estimate)
        day, output_reserve = self._check_daily(tenant, st, input_tokens, output_reserve, output_estimate)
        self._check_in_flight(tenant, st, input_tokens + output_reserve)
        checks = [
            (st.requests, 1, "requests", "requests per minute (RPM)", "rpm"),
            (st.input_tokens, input_tokens, "tokens", "input tokens per minute (ITPM)", "input_tpm"),
            (st.output_tokens, output_reserve, "tokens", "output tokens per minute (OTPM)", "output_tpm"),
        ]
        for bucket, amount, kind, what, name in checks:
            if bucket is not None:
                bucket.refill(now)
                self._check_bucket(tenant, bucket, amount, kind, what, name)
        for bucket, amount, *_ in checks:
            if bucket is not None:
                bucket.take(amount)
        st.concurrent += 1
        st.tokens_in_flight += input_tokens + output_reserve
        st.day_used += input_tokens + output_reserve
        return Grant(tenant, st, input_tokens, output_reserve, day, self.ledger, self._wall)

    def check_budgets(self, tenant: Tenant) -> None:
        """429 when the tenant's daily or monthly budget (this process's share) is spent, or is 0."""
        wall = self._wall()
        for which in ("daily", "monthly"):
            budget = getattr(tenant.limits, f"{which}_budget_usd")
            if budget is None:
                continue
            share = self._scaled_usd(budget)
            spent = self.ledger.spent(tenant.name, which, wall)
            if budget <= 0 or spent >= share:
                raise budget_refusal(tenant, which, share, spent, wall, self._share)

    def _no_share(self, tenant: Tenant, what: str, name: str, amount: int = 1) -> APIError:
        """429 for a request beyond this process's share of a limit that another frontend's share could
        hold (a zero share refuses everything): soft, so a client or balancer retries elsewhere."""
        return APIError(
            429,
            f"Tenant {tenant.name!r}: {amount} is more than this frontend's share of its {what} limit (the "
            f"limit is split over {self._share} frontends). Retry: another frontend may serve the request.",
            type=RATE_LIMIT,
            code="rate_limit_exceeded",
            limit=name,
            headers={"retry-after": "1", "x-should-retry": "true"},
        )

    def _check_concurrency(self, tenant: Tenant, st: TenantState) -> None:
        cap = self._scaled(st.limits.max_concurrent_requests)
        if cap == 0:
            raise self._no_share(tenant, "concurrent requests", "concurrency")
        if cap is not None and st.concurrent >= cap:
            raise APIError(
                429,
                f"Too many concurrent requests for tenant {tenant.name!r}: limit {cap}. Retry when one finishes.",
                type=RATE_LIMIT,
                code="concurrency_limit_exceeded",
                limit="concurrency",
                headers={"retry-after": "1", "x-should-retry": "true"},
            )

    def _check_in_flight(self, tenant: Tenant, st: TenantState, amount: int) -> None:
        cap = self._scaled(st.limits.max_tokens_in_flight)
        if cap is None:
            return
        if cap < amount <= self._largest(st.limits.max_tokens_in_flight or 0):
            raise self._no_share(tenant, "tokens in flight", "tokens_in_flight", amount)
        if amount > cap:
            raise APIError(
                429,
                f"Request too large for tenant {tenant.name!r}: {amount} prompt and output tokens, more than its "
                f"limit of {cap} tokens in flight. Reduce the prompt or max_tokens; retrying will not help.",
                type=RATE_LIMIT, code="request_too_large", limit="tokens_in_flight",
                headers={"x-should-retry": "false"})
        if st.tokens_in_flight + amount > cap:
            raise APIError(
                429,
                f"Too many tokens in flight for tenant {tenant.name!r}: {st.tokens_in_flight} in flight, {amount} "
                f"requested, limit {cap}. Retry when a request finishes.",
                type=RATE_LIMIT, code="tokens_in_flight_limit_exceeded", limit="tokens_in_flight",
                headers={"retry-after": "1", "x-should-retry": "true"})

    def _check_bucket(
        self, tenant: Tenant, bucket: TokenBucket, amount: int, kind: str, what: str, name: str
    ) -> None:
        if bucket.capacity < amount <= bucket.largest_share:
            raise self._no_share(tenant, what, name, amount)
        wait = bucket.wait_s(amount)
        if wait == 0.0:
            return
        limit = int(bucket.capacity)
        if math.isinf(wait):
            raise APIError(
                429,
                f"Request too large for tenant {tenant.name!r} on {what}: limit {limit}, requested {amount}. "
                "Reduce the prompt or max_tokens; retrying will not help.",
                type=RATE_LIMIT,
                code="request_too_large",
                limit=name,
                headers={"x-should-retry": "false"},
            )
        raise APIError(
            429,
            f"Rate limit reached for tenant {tenant.name!r} on {what}: limit {limit}, requested {amount}, "
            f"available {max(0, int(bucket.level))}. Please try again in {wait:.2f}s.",
            type=RATE_LIMIT,
            code="rate_limit_exceeded",
            limit=name,
            headers={"retry-after": _retry_after(wait), "x-should-retry": "true",
                     f"x-ratelimit-limit-{kind}": str(limit)},
        )

    def _check_daily(self, tenant: Tenant, st: TenantState, input_tokens: int, output_reserve: int,
                     estimated: int) -> tuple[int, int]:
        """(the UTC day number, the output reservation cut so its `estimated` part fits the quota)."""
        wall = self._wall()
        day = utc_day(wall)
        if st.day != day:  # a new day, or the first request since the start: what the ledger kept of it
            st.day, st.day_used = day, self.ledger.day_tokens(tenant.name, day)
        quota = self._scaled(st.limits.daily_token_quota)
        if quota == 0:
            raise self._no_share(tenant, "daily token quota", "quota", input_tokens + output_reserve)
        if quota is not None:
            over = st.day_used + input_tokens + output_reserve - quota
            output_reserve -= min(max(0, over), estimated)
        amount = input_tokens + output_reserve
        if quota is not None and st.day_used + amount > quota:
            reset_in = (day + 1) * SECONDS_PER_DAY - wall
            raise APIError(
                429,
                f"Tenant {tenant.name!r} exceeded its daily token quota ({quota} tokens; {st.day_used} used, "
                f"{amount} requested). The quota resets at 00:00 UTC.",
                type=QUOTA,
                code="insufficient_quota",
                limit="quota",
                headers={"retry-after": _retry_after(reset_in), "x-should-retry": "false"},
            )
        return day, output_reserve

    def concurrent(self, tenant_name: str) -> int:
        st = self._states.get(tenant_name)
        return 0 if st is None else st.concurrent
