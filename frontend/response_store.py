"""Where the Responses API (`/v1/responses`) keeps the responses it stored, so that `previous_response_id`,
`GET`/`DELETE /v1/responses/{id}`, `/input_items` and `background: true` with cancel outlive one request,
survive a frontend restart and are shared by the frontends of a cluster.

One interface, `ResponseStore`, two backends, picked by `open_store(url)`:

* `SqliteResponseStore` (a plain path or `sqlite:///abs/path.db`): the embedded default, a file in the
  cluster's run directory. Zero setup; WAL journal mode and a busy timeout let the frontend processes of
  one host share the file. stdlib `sqlite3` blocks, so every call runs on one worker thread per store
  that owns the connection, never on the event loop.
* `PostgresResponseStore` (`postgresql://...` / `postgres://...`): the shared store, so that every
  frontend of a multi-host cluster sees every response (a cancel sent to any frontend reaches a
  background response another one runs); the Kubernetes manifests run one. psycopg 3 async, with a
  small pool of its own; it creates its table if missing and reconnects after the server restarts.

Both keep the JSON documents as text written by orjson (PostgreSQL's JSONB would reorder keys and refuse
`\\u0000`), check the tenant on every read and write (another tenant's response is absent), treat an
expired record as absent, and make `update_status` a single compare-and-set statement: a cancel from any
frontend and the background runner finishing race safely, exactly one of them wins.

Any failure of the database surfaces as `StoreUnavailable` (the API answers 503), never as a raw
sqlite3/psycopg exception, and never shows a DSN's password.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sqlite3
import time
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import orjson

log = logging.getLogger(__name__)
T = TypeVar("T")

STATUSES = frozenset({"queued", "in_progress", "completed", "incomplete", "failed", "cancelled"})
TERMINAL_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})
# The JSON of one record (response + input items + context) may not exceed this: the API bounds its
# inputs far below it, so reaching it is a bug to report, not something to truncate silently.
MAX_RECORD_BYTES = 64 * 1024 * 1024
TABLE = "pdserve_responses"


class StoreUnavailable(Exception):
    """The store cannot be reached or failed; the API answers 503 for calls that need it."""


class _Store(Protocol):
    async def start(self) -> None: ...
    async def close(self) -> None: ...


S = TypeVar("S", bound=_Store)


class LazyStore(Generic[S]):
    """A store opened on first use, once: a frontend that never serves what it holds never connects.
    `get` raises StoreUnavailable (and closes the half-opened store) while it cannot be reached; the next
    call tries again. `on_open` runs once, after the first successful start."""

    def __init__(self, open_store: Callable[[], S], on_open: Callable[[S], None] | None = None) -> None:
        self._open, self._on_open = open_store, on_open
        self.opened: S | None = None
        self._lock: asyncio.Lock | None = None  # made in the event loop that uses it

    async def get(self) -> S:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.opened is None:
                store = self._open()
                try:
                    await store.start()
                except StoreUnavailable:
                    await store.close()
                    raise
                self.opened = store
                if self._on_open is not None:
                    self._on_open(store)
        return self.opened

    async def close(self) -> None:
        if self.opened is not None:
            await self.opened.close()


async def purge_every(every_s: float, purge: Callable[[], Awaitable[int]], what: str) -> None:
    """Runs `purge()` every `every_s` for good (a frontend's background task), logging how many records
    it deleted; a round the store is down for is skipped with a warning."""
    while True:
        await asyncio.sleep(every_s)
        try:
            if n := await purge():
                log.info("%s: %d deleted", what, n)
        except StoreUnavailable as err:
            log.warning("%s: not purged: %s", what, err)


@dataclass(eq=False)
class StoredResponse:
    """One stored Response with what it takes to list its input and to continue the conversation."""

    id: str                  # "resp_<hex>"
    tenant: str              # the tenant that created it; other tenants never see it
    created_at: float        # unix seconds
    expires_at: float        # unix seconds; an expired record is treated as absent and purged
    status: str              # "queued" | "in_progress" | "completed" | "incomplete" | "failed" | "cancelled"
    response: dict[str, Any]  # the Response object as the API returns it (JSON-serialisable)
    input_items: list[dict[str, Any]]  # this request's input items (as the API lists them at /input_items)
    context: list[dict[str, Any]]  # the whole conversation as chat messages: previous + this input + output
    previous_response_id: str | None = None


class ResponseStore(ABC):
    """Stored responses by id, visible only to the tenant that created them, until they expire."""

    @property
    @abstractmethod
    def description(self) -> str:
        """Where the store is, for logs and error messages (never a password)."""

    @abstractmethod
    async def start(self) -> None:
        """Connects and creates the schema if missing; raises StoreUnavailable."""

    @abstractmethod
    async def close(self) -> None:
        """Releases connections and threads; later calls raise StoreUnavailable."""

    @abstractmethod
    async def put(self, record: StoredResponse) -> None:
        """Inserts the record, or replaces the one with its id."""

    @abstractmethod
    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The record, or None when absent, another tenant's, or expired (then purged)."""

    @abstractmethod
    async def delete(self, tenant: str, response_id: str) -> bool:
        """Deletes the record; True when it existed (unexpired) for that tenant."""

    @abstractmethod
    async def update_status(self, tenant: str, response_id: str, status: str, response: dict[str, Any],
                            expect: Collection[str]) -> bool:
        """Compare-and-set: replaces status and response only while the current status is in `expect`
        (and the record is the tenant's and unexpired); returns whether it did."""

    @abstractmethod
    async def purge_expired(self, now: float | None = None) -> int:
        """Deletes every record expired at `now` (default: the current time); returns how many."""

    @abstractmethod
    async def ping(self) -> bool:
        """Whether the store answers a trivial query now; never raises."""


def open_store(url: str) -> ResponseStore:
    """'sqlite:///abs/path.db' or a plain path -> SqliteResponseStore; 'postgresql://...' /
    'postgres://...' -> PostgresResponseStore; anything else ValueError."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("response store URL is empty: give a path, sqlite:///abs/path.db or postgresql://...")
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", url)
    if scheme is None:
        return SqliteResponseStore(url)
    name = scheme.group(1).lower()
    if name in ("postgresql", "postgres"):
        if not url[scheme.end():].startswith("//"):
            raise ValueError(f"response store URL must be {name}://[user[:password]@]host[:port]/database")
        return PostgresResponseStore(url)
    if name == "sqlite":
        rest = url[scheme.end():]
        if not rest.startswith("///") or "?" in rest or "#" in rest:
            raise ValueError(f"response store URL {url!r}: an SQLite URL is sqlite:///absolute/path.db "
                             "(no host, no query)")
        return SqliteResponseStore(urllib.parse.unquote(rest[2:]))
    raise ValueError(f"response store URL has unknown scheme {name!r}: use a path, sqlite:///abs/path.db, "
                     "postgresql://... or postgres://...")


# ---------------------------------------------------------------------------------------------- shared


_COLUMNS = "id, tenant, created_at, expires_at, status, previous_response_id, response, input_items, context"
_UPSERT = (f"INSERT INTO {TABLE} ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
           "ON CONFLICT (id) DO UPDATE SET tenant = excluded.tenant, created_at = excluded.created_at, "
           "expires_at = excluded.expires_at, status = excluded.status, "
           "previous_response_id = excluded.previous_response_id, response = excluded.response, "
           "input_items = excluded.input_items, context = excluded.context")
_SELECT = f"SELECT {_COLUMNS} FROM {TABLE} WHERE id = ? AND tenant = ?"
_DELETE_IF_EXPIRED = f"DELETE FROM {TABLE} WHERE id = ? AND expires_at <= ?"
_DELETE = f"DELETE FROM {TABLE} WHERE id = ? AND tenant = ? AND expires_at > ?"
_PURGE = f"DELETE FROM {TABLE} WHERE expires_at <= ?"


def _dumps(value: Any, what: str) -> str:
    try:
        return orjson.dumps(value).decode()
    except TypeError as exc:  # orjson.JSONEncodeError
        raise ValueError(f"stored response {what} is not JSON-serialisable: {exc}") from None


def _check_status(status: str) -> None:
    if status not in STATUSES:
        raise ValueError(f"unknown response status {status!r}; expected one of {sorted(STATUSES)}")


def _row_params(record: StoredResponse) -> tuple[Any, ...]:
    """The record as the upsert's parameters; raises ValueError for what no backend should hold."""
    _check_status(record.status)
    if not record.id or not record.tenant:
        raise ValueError("a stored response needs an id and a tenant")
    response = _dumps(record.response, "response")
    input_items = _dumps(record.input_items, "input_items")
    context = _dumps(record.context, "context")
    size = len(response) + len(input_items) + len(context)
    if size > MAX_RECORD_BYTES:
        raise ValueError(f"stored response {record.id} is {size} bytes of JSON, over the store's limit of "
                         f"{MAX_RECORD_BYTES}")
    return (record.id, record.tenant, float(record.created_at), float(record.expires_at), record.status,
            record.previous_response_id, response, input_items, context)


def _record(row: tuple[Any, ...]) -> StoredResponse:
    rid, tenant, created_at, expires_at, status, previous, response, input_items, context = row
    return StoredResponse(id=rid, tenant=tenant, created_at=float(created_at), expires_at=float(expires_at),
                          status=status, response=orjson.loads(response), input_items=orjson.loads(input_items),
                          context=orjson.loads(context), previous_response_id=previous)


def _now(now: float | None) -> float:
    return time.time() if now is None else float(now)


# ---------------------------------------------------------------------------------------------- SQLite


_SQLITE_SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at REAL NOT NULL, "
    "expires_at REAL NOT NULL, status TEXT NOT NULL, previous_response_id TEXT, response TEXT NOT NULL, "
    "input_items TEXT NOT NULL, context TEXT NOT NULL)",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_expires_at ON {TABLE} (expires_at)",
)


class SqliteResponseStore(ResponseStore):
    """The embedded store: one SQLite file, shared by the frontends of one host (WAL, busy timeout).

    One worker thread owns the connection (and everything touching it runs there), so the event loop
    never blocks on the file and the calls of one store are serialised. The file is checked on every call: when it was removed (or replaced), the
    connection is reopened rather than writing on into an unlinked file nobody else sees; when its
    directory is gone, calls raise StoreUnavailable until it is back.
    """

    kind = "response store"  # what `description` calls it (frontend.batch_store reuses this class's connection)
    schema: tuple[str, ...] = _SQLITE_SCHEMA  # run on every (re)connect

    def __init__(self, path: str | os.PathLike[str], busy_timeout_s: float = 5.0) -> None:
        self.path = str(path)
        self.busy_timeout_s = busy_timeout_s
        self._memory = self.path == ":memory:"
        self._executor = ThreadPoolExecutor(max_workers=1,
                                            thread_name_prefix=self.kind.replace(" ", "-") + "-sqlite")
        self._conn: sqlite3.Connection | None = None
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the file the connection has open
        self._closed = False

    @property
    def description(self) -> str:
        return f"SQLite {self.kind} {self.path}"

    async def _call(self, what: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._closed:
            raise StoreUnavailable(f"{self.description} is closed")
        try:
            future = asyncio.get_running_loop().run_in_executor(self._executor, self._guarded, what, fn)
        except RuntimeError as exc:  # the executor was shut down under us
            raise StoreUnavailable(f"{self.description} is closed") from exc
        return await future

    def _guarded(self, what: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Runs on the worker thread: `fn` on a live connection, any database failure as StoreUnavailable."""
        if self._closed:
            raise StoreUnavailable(f"{self.description} is closed")
        try:
            return fn(self._connection())
        except (sqlite3.Error, OSError) as exc:
            self._disconnect()  # reopened on the next call: the file may be back, the error transient
            raise StoreUnavailable(
                f"{self.description} failed to {what}: {type(exc).__name__}: {exc}") from exc

    def _connection(self) -> sqlite3.Connection:
        if self._conn is not None and not self._memory:
            try:
                st = os.stat(self.path)
                current: tuple[int, int] | None = (st.st_dev, st.st_ino)
            except FileNotFoundError:
                current = None
            if current != self._identity:
                self._disconnect()
        if self._conn is None:
            if not self._memory and not os.path.isdir(os.path.dirname(os.path.abspath(self.path))):
                raise StoreUnavailable(f"{self.description}: its directory does not exist")
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None,
                                   check_same_thread=False)
            try:
                conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
                conn.execute("PRAGMA journal_mode = WAL").fetchone()
                conn.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: durable across a process crash
                for statement in self.schema:
                    try:
                        conn.execute(statement)
                    except sqlite3.OperationalError as exc:  # ADD COLUMN of a store that has it already
                        if not (statement.startswith("ALTER TABLE") and "duplicate column" in str(exc)):
                            raise
                if not self._memory:
                    st = os.stat(self.path)
                    self._identity = (st.st_dev, st.st_ino)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _disconnect(self) -> None:
        conn, self._conn, self._identity = self._conn, None, None
        if conn is not None:
            try:
                conn.close()
            except sqlite3.Error:
                pass

    async def start(self) -> None:
        def create_directory() -> None:
            if not self._memory:
                Path(self.path).resolve().parent.mkdir(parents=True, exist_ok=True)

        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, create_directory)
        except OSError as exc:
            raise StoreUnavailable(f"{self.description}: cannot create its directory: {exc}") from exc
        await self._call("open", lambda conn: None)

    async def close(self) -> None:
        if self._closed:
            return

        def shut() -> None:  # on the worker thread, after the calls already queued
            self._closed = True
            self._disconnect()

        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, shut)
        except RuntimeError:
            self._closed = True
        self._executor.shutdown(wait=False)

    async def put(self, record: StoredResponse) -> None:
        params = _row_params(record)
        await self._call("store a response", lambda conn: conn.execute(_UPSERT, params))

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        now = time.time()

        def read(conn: sqlite3.Connection) -> tuple[Any, ...] | None:
            row = conn.execute(_SELECT, (response_id, tenant)).fetchone()
            if row is not None and row[3] <= now:
                conn.execute(_DELETE_IF_EXPIRED, (response_id, now))
                return None
            return row

        row = await self._call("read a response", read)
        return None if row is None else _record(row)

    async def delete(self, tenant: str, response_id: str) -> bool:
        now = time.time()
        return await self._call("delete a response",
                                lambda conn: conn.execute(_DELETE, (response_id, tenant, now)).rowcount > 0)

    async def update_status(self, tenant: str, response_id: str, status: str, response: dict[str, Any],
                            expect: Collection[str]) -> bool:
        _check_status(status)
        expected = sorted(set(expect))
        if not expected:
            return False
        body = _dumps(response, "response")
        now = time.time()
        sql = (f"UPDATE {TABLE} SET status = ?, response = ? WHERE id = ? AND tenant = ? AND expires_at > ? "
               f"AND status IN ({', '.join('?' * len(expected))})")
        params = (status, body, response_id, tenant, now, *expected)
        return await self._call("update a response's status", lambda conn: conn.execute(sql, params).rowcount > 0)

    async def purge_expired(self, now: float | None = None) -> int:
        at = _now(now)
        return await self._call("purge expired responses", lambda conn: conn.execute(_PURGE, (at,)).rowcount)

    async def ping(self) -> bool:
        try:
            await self._call("answer a ping", lambda conn: conn.execute("SELECT 1").fetchone())
            return True
        except Exception:
            return False


# ------------------------------------------------------------------------------------------ PostgreSQL


_PG_SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} (id text PRIMARY KEY, tenant text NOT NULL, "
    "created_at double precision NOT NULL, expires_at double precision NOT NULL, status text NOT NULL, "
    "previous_response_id text, response text NOT NULL, input_items text NOT NULL, context text NOT NULL)",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_expires_at ON {TABLE} (expires_at)",
)
_PG_SCHEMA_LOCK = 0x7064_7265_7370  # advisory lock key: frontends starting together create the table once


def _pg(sql: str) -> str:
    return sql.replace("?", "%s")


class PostgresResponseStore(ResponseStore):
    """The shared store: one table in PostgreSQL that every frontend of the cluster reads and writes.

    A small pool of autocommit connections of its own (psycopg_pool is not a dependency). After the
    server restarts the pooled connections are dead: a call that fails on one drops every idle
    connection and retries once on a fresh one, so a restart costs the calls made while it was down,
    not the ones after. A dropped table is recreated on the next call.
    """

    kind = "response store"  # what `description` calls it (frontend.batch_store reuses this class's pool)
    schema: tuple[str, ...] = _PG_SCHEMA
    schema_lock = _PG_SCHEMA_LOCK

    def __init__(self, dsn: str, pool_size: int = 4, connect_timeout_s: float = 5.0,
                 timeout_s: float = 10.0) -> None:
        self._dsn = dsn
        self.pool_size = pool_size
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self._secrets, self._description = _describe_dsn(dsn, self.kind)
        self._idle: list[Any] = []  # psycopg.AsyncConnection, idle, most recently used last
        self._slots: asyncio.Semaphore | None = None
        self._closed = False

    @property
    def description(self) -> str:
        return self._description

    def _unavailable(self, what: str, exc: BaseException) -> StoreUnavailable:
        message = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line: libpq's messages span several
        for secret in self._secrets:
            message = message.replace(secret, "***")
        return StoreUnavailable(f"{self.description} failed to {what}: {message}")

    async def _connect(self) -> Any:
        import psycopg

        return await psycopg.AsyncConnection.connect(
            self._dsn, autocommit=True, connect_timeout=max(1, round(self.connect_timeout_s)),
            application_name="pdserve-frontend")

    async def _drop(self, conn: Any) -> None:
        try:
            await conn.close()
        except Exception:
            pass

    async def _run(self, what: str, op: Callable[[Any], Awaitable[T]]) -> T:
        """`op(connection)` on a pooled connection: retried once on a fresh one when a pooled connection
        turns out dead (a server restart) or the table is missing; any failure as StoreUnavailable."""
        import psycopg

        if self._closed:
            raise StoreUnavailable(f"{self.description} is closed")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.pool_size)
        async with self._slots:
            for attempt in (0, 1):
                conn: Any = None
                reused = False
                try:
                    async with asyncio.timeout(self.timeout_s):
                        if self._idle:
                            conn, reused = self._idle.pop(), True
                        else:
                            conn = await self._connect()
                        result = await op(conn)
                except psycopg.errors.UndefinedTable as exc:
                    if attempt == 0 and conn is not None and not conn.broken:
                        try:
                            async with asyncio.timeout(self.timeout_s):
                                await self._create_schema(conn)
                        except (psycopg.Error, OSError, TimeoutError) as schema_exc:
                            await self._drop(conn)
                            raise self._unavailable(what, schema_exc) from None
                        self._idle.append(conn)
                        continue
                    if conn is not None:
                        await self._drop(conn)
                    raise self._unavailable(what, exc) from None
                except (psycopg.Error, OSError, TimeoutError) as exc:
                    dead = conn is not None and (conn.broken or conn.closed)
                    if conn is not None:
                        await self._drop(conn)
                    if attempt == 0 and reused and dead:
                        stale, self._idle = self._idle, []
                        for other in stale:
                            await self._drop(other)
                        continue
                    if isinstance(exc, TimeoutError):
                        raise StoreUnavailable(f"{self.description} did not {what} within "
                                               f"{self.timeout_s:g} s") from None
                    raise self._unavailable(what, exc) from None
                except BaseException:  # cancelled: the connection's state is unknown
                    if conn is not None:
                        await self._drop(conn)
                    raise
                if self._closed:
                    await self._drop(conn)
                else:
                    self._idle.append(conn)
                return result
        raise AssertionError("unreachable")

    async def _create_schema(self, conn: Any) -> None:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (self.schema_lock,))
            for statement in self.schema:
                await conn.execute(statement)

    async def start(self) -> None:
        await self._run("create its table", self._create_schema)

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await self._drop(conn)

    async def put(self, record: StoredResponse) -> None:
        params = _row_params(record)

        async def op(conn: Any) -> None:
            await conn.execute(_pg(_UPSERT), params)

        await self._run("store a response", op)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        now = time.time()

        async def op(conn: Any) -> tuple[Any, ...] | None:
            row = await (await conn.execute(_pg(_SELECT), (response_id, tenant))).fetchone()
            if row is not None and row[3] <= now:
                await conn.execute(_pg(_DELETE_IF_EXPIRED), (response_id, now))
                return None
            return row

        row = await self._run("read a response", op)
        return None if row is None else _record(row)

    async def delete(self, tenant: str, response_id: str) -> bool:
        now = time.time()

        async def op(conn: Any) -> bool:
            return (await conn.execute(_pg(_DELETE), (response_id, tenant, now))).rowcount > 0

        return await self._run("delete a response", op)

    async def update_status(self, tenant: str, response_id: str, status: str, response: dict[str, Any],
                            expect: Collection[str]) -> bool:
        _check_status(status)
        expected = sorted(set(expect))
        if not expected:
            return False
        body = _dumps(response, "response")
        now = time.time()
        sql = (f"UPDATE {TABLE} SET status = %s, response = %s WHERE id = %s AND tenant = %s "
               "AND expires_at > %s AND status = ANY(%s)")

        async def op(conn: Any) -> bool:
            return (await conn.execute(sql, (status, body, response_id, tenant, now, expected))).rowcount > 0

        return await self._run("update a response's status", op)

    async def purge_expired(self, now: float | None = None) -> int:
        at = _now(now)

        async def op(conn: Any) -> int:
            return int((await conn.execute(_pg(_PURGE), (at,))).rowcount)

        return await self._run("purge expired responses", op)

    async def ping(self) -> bool:
        async def op(conn: Any) -> None:
            await conn.execute("SELECT 1")

        try:
            await self._run("answer a ping", op)
            return True
        except Exception:
            return False


def _describe_dsn(dsn: str, kind: str = "response store") -> tuple[list[str], str]:
    """The DSN's password (as written and URL-quoted, to scrub from messages) and a description of the
    store without it."""
    secrets: list[str] = []
    parts: dict[str, Any] = {}
    try:
        from psycopg.conninfo import conninfo_to_dict

        parts = conninfo_to_dict(dsn)
    except Exception:
        pass
    password = parts.get("password")
    if password is None and "://" in dsn:  # unparseable: fall back to the URL's own password field
        try:
            password = urllib.parse.urlsplit(dsn).password
        except ValueError:
            password = None
    if password:
        secrets = sorted({str(password), urllib.parse.quote(str(password), safe=""),
                          urllib.parse.quote(str(password))}, key=len, reverse=True)
    if not parts:
        return secrets, f"PostgreSQL {kind} (unparseable DSN)"
    user = f"{parts['user']}@" if parts.get("user") else ""
    where = f"{parts.get('host', 'localhost')}" + (f":{parts['port']}" if parts.get("port") else "")
    return secrets, f"PostgreSQL {kind} postgresql://{user}{where}/{parts.get('dbname', '')}"
