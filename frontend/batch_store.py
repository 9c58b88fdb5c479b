"""Where `/v1/files` and `/v1/batches` keep their files, batches and each batch line's result, in the same
kind of store as the stored responses (`frontend.response_store`), so that they survive a frontend
restart and are shared by the frontends of a cluster.

One interface, `BatchStore`, two backends, picked by `open_batch_store(url)` (the URL is
`batch_store_url(config.response_store)`):

* `SqliteBatchStore`: a file beside the response store's SQLite file (`responses.db` ->
  `responses-batches.db`), WAL, one worker thread owning the connection (the response store's own
  machinery: `SqliteResponseStore` with this module's schema).
* `PostgresBatchStore`: the response store's PostgreSQL database, tables of its own (the response
  store's pool and reconnect logic: `PostgresResponseStore` with this module's schema).

File contents are in the database, as chunks of `CHUNK_BYTES` (BLOB / bytea rows): every frontend that
shares the store sees every file with nothing else to set up or share (no volume, no object store), a
file and its metadata are written in one transaction (a file is whole or absent, also across a crash),
and deleting a file deletes its bytes. Chunks keep every read and write bounded in memory: an upload is
copied from its spooled temporary file chunk by chunk, a download streams chunk by chunk.

Per batch line, `record_line` inserts the line's finished output (its JSONL text) once: a line already
recorded is never recorded again (`ON CONFLICT DO NOTHING`), whoever ran it, so a batch resumed after a
crash, or run twice by two frontends after a lease expired, still has each custom_id exactly once.
`request_counts` are counted from those rows, so they are always current. One frontend runs a batch at
a time: `claim_batch` takes an active batch whose lease is free or expired (a single statement), and
the owner renews its lease while it runs.

Every read and write checks the tenant (another tenant's file or batch is absent), except the runner's
own calls (claim, renew, record, read lines), which use ids it got from a claim. Database failures are
`StoreUnavailable`, as in the response store.
"""

from __future__ import annotations

import sqlite3
import time
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from pdserve.frontend.response_store import (
    PostgresResponseStore,
    ResponseStore,
    SqliteResponseStore,
    StoreUnavailable,
    _pg,
    open_store,
)

__all__ = ["ACTIVE_STATUSES", "BATCH_STATUSES", "CHUNK_BYTES", "BatchRecord", "BatchStore", "FileRecord",
           "PostgresBatchStore", "SqliteBatchStore", "StoreUnavailable", "batch_store_url", "open_batch_store"]

CHUNK_BYTES = 1 << 20
BATCH_STATUSES = frozenset({"validating", "failed", "in_progress", "finalizing", "completed", "expired",
                            "cancelling", "cancelled"})
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")  # what a runner claims

FILES, CHUNKS, BATCHES, LINES = "pdserve_files", "pdserve_file_chunks", "pdserve_batches", "pdserve_batch_lines"


@dataclass(eq=False)
class FileRecord:
    """A file's metadata (its bytes are in chunks beside it)."""

    id: str            # "file-<hex>"
    tenant: str
    purpose: str       # "batch" (uploads) or "batch_output" (a batch's output and error files)
    filename: str      # as the client named it: a name only, never used as a path
    bytes: int
    created_at: float  # unix seconds
    expires_at: float | None = None  # unix seconds; None: kept until deleted

    def object(self) -> dict[str, Any]:
        """The OpenAI File object."""
        obj = {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": int(self.created_at),
               "filename": self.filename, "purpose": self.purpose, "status": "processed"}
        return obj if self.expires_at is None else {**obj, "expires_at": int(self.expires_at)}


@dataclass(eq=False)
class BatchRecord:
    """A batch: its OpenAI Batch object (without request_counts, counted from its lines; keys starting with
    `_` are ours, not shown) and its lease."""

    id: str            # "batch_<hex>"
    tenant: str
    created_at: float
    status: str
    batch: dict[str, Any]
    owner: str | None = None   # the frontend running it, while its lease lasts
    lease_until: float = 0.0
    completed: int = 0  # lines recorded ok / failed (filled by reads)
    failed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def object(self) -> dict[str, Any]:
        """The Batch object as the spec has it: a field not set yet is absent (not null), but metadata."""
        total = self.batch.get("request_counts", {}).get("total", 0)
        obj = {k: v for k, v in self.batch.items() if (v is not None or k == "metadata") and not k.startswith("_")}
        if obj.get("errors"):
            obj["errors"] = {**obj["errors"], "data": [{k: v for k, v in e.items() if v is not None}
                                                       for e in obj["errors"].get("data", [])]}
        return {**obj, "status": self.status,
                "request_counts": {"total": total, "completed": self.completed, "failed": self.failed}}


class BatchStore(ABC):
    """Files, batches and batch lines, visible only to the tenant that created them."""

    @property
    @abstractmethod
    def description(self) -> str: ...

    @abstractmethod
    async def start(self) -> None:
        """Connects and creates the schema if missing; raises StoreUnavailable."""

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    async def ping(self) -> bool: ...

    # files
    @abstractmethod
    async def put_file(self, record: FileRecord, source: IO[bytes]) -> None:
        """Stores the file: its record and `source`'s bytes (read from its current position, in chunks),
        in one transaction; replaces a file with the same id."""

    @abstractmethod
    async def get_file(self, tenant: str, file_id: str) -> FileRecord | None:
        """The file, None when there is none or it has expired (as for every read below)."""

    @abstractmethod
    async def list_files(self, tenant: str, purpose: str | None, after: str | None, limit: int,
                         order: str) -> list[FileRecord]:
        """Up to `limit` files by (created_at, id) in `order` ("asc"/"desc"), after the file `after`."""

    @abstractmethod
    async def read_chunk(self, tenant: str, file_id: str, seq: int) -> bytes | None:
        """The file's chunk `seq` (0, 1, ...), None past its end."""

    @abstractmethod
    async def delete_file(self, tenant: str, file_id: str) -> bool: ...

    @abstractmethod
    async def purge_expired_files(self, now: float | None = None) -> int:
        """Deletes the files (and their chunks) past their `expires_at`; returns how many."""

    # batches
    @abstractmethod
    async def put_batch(self, record: BatchRecord) -> None: ...

    @abstractmethod
    async def get_batch(self, tenant: str, batch_id: str) -> BatchRecord | None: ...

    @abstractmethod
    async def list_batches(self, tenant: str, after: str | None, limit: int) -> list[BatchRecord]:
        """Up to `limit` batches, newest first, after the batch `after`."""

    @abstractmethod
    async def update_batch(self, tenant: str, batch_id: str, status: str, batch: dict[str, Any],
                           expect: Collection[str]) -> bool:
        """Compare-and-set: sets status and object while the status is in `expect`; whether it did."""

    # the runner
    @abstractmethod
    async def claim_batch(self, owner: str, lease_s: float) -> BatchRecord | None:
        """Takes the oldest active batch that no live lease holds, for `lease_s` (never one `owner` holds:
        it runs those already)."""

    @abstractmethod
    async def renew_lease(self, batch_id: str, owner: str, lease_s: float) -> bool:
        """Extends `owner`'s lease; False when another frontend holds it now."""

    @abstractmethod
    async def release_batch(self, batch_id: str, owner: str) -> None: ...

    @abstractmethod
    async def record_line(self, batch_id: str, line: int, custom_id: str, ok: bool, text: str) -> bool:
        """Records a finished line (its output or error JSONL text) unless it is recorded already;
        whether this call recorded it."""

    @abstractmethod
    async def done_lines(self, batch_id: str) -> set[int]:
        """The line numbers recorded so far."""

    @abstractmethod
    async def line_texts(self, batch_id: str, ok: bool) -> list[str]:
        """The recorded lines' texts, ok (output) or not (errors), in line order."""


def batch_store_url(response_store: str) -> str:
    """The batch store beside a response store: the same PostgreSQL database, or a sibling SQLite file."""
    store = open_store(response_store)  # validates the URL; nothing is opened
    if isinstance(store, PostgresResponseStore):
        return response_store
    assert isinstance(store, SqliteResponseStore)
    if store.path == ":memory:":
        return ":memory:"
    path = Path(store.path)
    return str(path.with_name(f"{path.stem}-batches{path.suffix or '.db'}"))


def open_batch_store(url: str) -> BatchStore:
    """A path / sqlite:///path -> SqliteBatchStore; postgresql://... -> PostgresBatchStore."""
    store = open_store(url)
    if isinstance(store, PostgresResponseStore):
        return PostgresBatchStore(url)
    assert isinstance(store, SqliteResponseStore)
    return SqliteBatchStore(store.path)


# ---------------------------------------------------------------------------------------------- shared

_FILE_COLS = "id, tenant, purpose, filename, bytes, created_at, expires_at"
_LIVE = "(expires_at IS NULL OR expires_at > ?)"  # a file not expired at the time bound to it
_BATCH_COLS = "id, tenant, created_at, status, batch, owner, lease_until"
_COUNTS = (f"(SELECT COUNT(*) FROM {LINES} l WHERE l.batch_id = b.id AND l.ok = 1), "
           f"(SELECT COUNT(*) FROM {LINES} l WHERE l.batch_id = b.id AND l.ok = 0)")
_BATCH_SELECT = f"SELECT {', '.join('b.' + c.strip() for c in _BATCH_COLS.split(','))}, {_COUNTS} FROM {BATCHES} b"

_SQL = {
    "get_file": f"SELECT {_FILE_COLS} FROM {FILES} WHERE id = ? AND tenant = ? AND {_LIVE}",
    "expired_files": f"SELECT id FROM {FILES} WHERE expires_at <= ?",
    "drop_file": f"DELETE FROM {FILES} WHERE id = ?",
    "delete_chunks": f"DELETE FROM {CHUNKS} WHERE file_id = ?",
    "delete_file": f"DELETE FROM {FILES} WHERE id = ? AND tenant = ?",
    "upsert_file": (f"INSERT INTO {FILES} ({_FILE_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE "
                    "SET tenant = excluded.tenant, purpose = excluded.purpose, filename = excluded.filename, "
                    "bytes = excluded.bytes, created_at = excluded.created_at, expires_at = excluded.expires_at"),
    "chunk": f"INSERT INTO {CHUNKS} (file_id, seq, data) VALUES (?, ?, ?)",
    "read_chunk": (f"SELECT c.data FROM {CHUNKS} c JOIN {FILES} f ON f.id = c.file_id "
                   "WHERE c.file_id = ? AND f.tenant = ? AND c.seq = ? "
                   "AND (f.expires_at IS NULL OR f.expires_at > ?)"),
    "put_batch": (f"INSERT INTO {BATCHES} ({_BATCH_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                  "status = excluded.status, batch = excluded.batch"),
    "get_batch": f"{_BATCH_SELECT} WHERE b.id = ? AND b.tenant = ?",
    "renew": f"UPDATE {BATCHES} SET lease_until = ? WHERE id = ? AND owner = ?",
    "release": f"UPDATE {BATCHES} SET owner = NULL, lease_until = 0 WHERE id = ? AND owner = ?",
    "record": (f"INSERT INTO {LINES} (batch_id, line, custom_id, ok, text) VALUES (?, ?, ?, ?, ?) "
               "ON CONFLICT (batch_id, line) DO NOTHING"),
    "done": f"SELECT line FROM {LINES} WHERE batch_id = ?",
    "texts": f"SELECT text FROM {LINES} WHERE batch_id = ? AND ok = ? ORDER BY line",
}


def _list_files_sql(purpose: str | None, after: bool, order: str) -> str:
    op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
    where = f"tenant = ? AND {_LIVE}" + (" AND purpose = ?" if purpose is not None else "")
    if after:
        where += (f" AND (created_at, id) {op} (SELECT created_at, id FROM {FILES} WHERE id = ? AND tenant = ?)")
    return f"SELECT {_FILE_COLS} FROM {FILES} WHERE {where} ORDER BY created_at {direction}, id {direction} LIMIT ?"


def _list_files_params(tenant: str, purpose: str | None, after: str | None, limit: int) -> tuple[Any, ...]:
    return (tenant, time.time(), *((purpose,) if purpose is not None else ()), *((after, tenant) if after else ()),
            limit)


def _list_batches_sql(after: bool) -> str:
    where = "b.tenant = ?" + (f" AND (b.created_at, b.id) < (SELECT created_at, id FROM {BATCHES} WHERE id = ? "
                               "AND tenant = ?)" if after else "")
    return f"{_BATCH_SELECT} WHERE {where} ORDER BY b.created_at DESC, b.id DESC LIMIT ?"


def _claim_sql(pg: bool) -> str:
    active = "status = ANY(?)" if pg else f"status IN ({', '.join('?' * len(ACTIVE_STATUSES))})"
    free = "(owner IS NULL OR lease_until < ?)"
    lock = " FOR UPDATE SKIP LOCKED" if pg else ""
    return (f"UPDATE {BATCHES} SET owner = ?, lease_until = ? WHERE id = (SELECT id FROM {BATCHES} WHERE {active} "
            f"AND {free} ORDER BY created_at, id LIMIT 1{lock}) AND {free} RETURNING id, tenant")


def _claim_params(pg: bool, owner: str, lease_s: float) -> tuple[Any, ...]:
    now = time.time()
    active: tuple[Any, ...] = (list(ACTIVE_STATUSES),) if pg else ACTIVE_STATUSES
    return (owner, now + lease_s, *active, now, now)


def _update_sql(expected: list[str], pg: bool) -> str:
    cond = "status = ANY(?)" if pg else f"status IN ({', '.join('?' * len(expected))})"
    return f"UPDATE {BATCHES} SET status = ?, batch = ? WHERE id = ? AND tenant = ? AND {cond}"


def _check_status(status: str) -> None:
    if status not in BATCH_STATUSES:
        raise ValueError(f"unknown batch status {status!r}; expected one of {sorted(BATCH_STATUSES)}")


def _file(row: tuple[Any, ...]) -> FileRecord:
    fid, tenant, purpose, filename, size, created_at, expires_at = row
    return FileRecord(fid, tenant, purpose, filename, int(size), float(created_at),
                      None if expires_at is None else float(expires_at))


def _batch(row: tuple[Any, ...]) -> BatchRecord:
    bid, tenant, created_at, status, batch, owner, lease_until, completed, failed = row
    return BatchRecord(bid, tenant, float(created_at), status, orjson.loads(batch), owner, float(lease_until or 0),
                       int(completed), int(failed))


def _file_params(record: FileRecord) -> tuple[Any, ...]:
    if not record.id or not record.tenant:
        raise ValueError("a stored file needs an id and a tenant")
    return (record.id, record.tenant, record.purpose, record.filename, int(record.bytes), float(record.created_at),
            None if record.expires_at is None else float(record.expires_at))


def _batch_params(record: BatchRecord) -> tuple[Any, ...]:
    _check_status(record.status)
    if not record.id or not record.tenant:
        raise ValueError("a batch needs an id and a tenant")
    return (record.id, record.tenant, float(record.created_at), record.status, orjson.dumps(record.batch).decode(),
            record.owner, float(record.lease_until))


# ---------------------------------------------------------------------------------------------- SQLite

_SQLITE_SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS {FILES} (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, "
    "filename TEXT NOT NULL, bytes INTEGER NOT NULL, created_at REAL NOT NULL, expires_at REAL)",
    f"ALTER TABLE {FILES} ADD COLUMN expires_at REAL",  # a store made before files expired (may exist)
    f"CREATE INDEX IF NOT EXISTS {FILES}_tenant ON {FILES} (tenant, created_at)",
    f"CREATE INDEX IF NOT EXISTS {FILES}_expires ON {FILES} (expires_at)",
    f"CREATE TABLE IF NOT EXISTS {CHUNKS} (file_id TEXT NOT NULL, seq INTEGER NOT NULL, data BLOB NOT NULL, "
    "PRIMARY KEY (file_id, seq))",
    f"CREATE TABLE IF NOT EXISTS {BATCHES} (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at REAL NOT NULL, "
    "status TEXT NOT NULL, batch TEXT NOT NULL, owner TEXT, lease_until REAL NOT NULL DEFAULT 0)",
    f"CREATE INDEX IF NOT EXISTS {BATCHES}_tenant ON {BATCHES} (tenant, created_at)",
    f"CREATE INDEX IF NOT EXISTS {BATCHES}_status ON {BATCHES} (status)",
    f"CREATE TABLE IF NOT EXISTS {LINES} (batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, "
    "ok INTEGER NOT NULL, text TEXT NOT NULL, PRIMARY KEY (batch_id, line))",
)


class _OnDatabase:
    """A batch store's life and health are its database connection's (`_db`: the response store's
    connection handling over the batch schema)."""

    _db: ResponseStore

    @property
    def description(self) -> str:
        return self._db.description

    async def start(self) -> None:
        await self._db.start()

    async def close(self) -> None:
        await self._db.close()

    async def ping(self) -> bool:
        return await self._db.ping()


class _SqliteDatabase(SqliteResponseStore):
    kind = "batch store"
    schema = _SQLITE_SCHEMA


def _transaction(conn: sqlite3.Connection, fn: Any) -> Any:
    conn.execute("BEGIN IMMEDIATE")
    try:
        result = fn()
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return result


class SqliteBatchStore(_OnDatabase, BatchStore):
    """The embedded store: an SQLite file (the response store's connection handling, this schema)."""

    def __init__(self, path: str) -> None:
        self._db = _SqliteDatabase(path)
        self.path = self._db.path

    async def _call(self, what: str, fn: Any) -> Any:
        return await self._db._call(what, fn)

    async def put_file(self, record: FileRecord, source: IO[bytes]) -> None:
        params = _file_params(record)

        def write(conn: sqlite3.Connection) -> None:
            def body() -> None:
                conn.execute(_SQL["delete_chunks"], (record.id,))
                conn.execute(_SQL["upsert_file"], params)
                seq = 0
                while chunk := source.read(CHUNK_BYTES):
                    conn.execute(_SQL["chunk"], (record.id, seq, chunk))
                    seq += 1
            _transaction(conn, body)

        await self._call("store a file", write)

    async def get_file(self, tenant: str, file_id: str) -> FileRecord | None:
        now = time.time()
        row = await self._call("read a file",
                               lambda c: c.execute(_SQL["get_file"], (file_id, tenant, now)).fetchone())
        return None if row is None else _file(row)

    async def list_files(self, tenant: str, purpose: str | None, after: str | None, limit: int,
                         order: str) -> list[FileRecord]:
        sql, params = _list_files_sql(purpose, bool(after), order), _list_files_params(tenant, purpose, after, limit)
        rows = await self._call("list files", lambda c: c.execute(sql, params).fetchall())
        return [_file(r) for r in rows]

    async def read_chunk(self, tenant: str, file_id: str, seq: int) -> bytes | None:
        now = time.time()
        row = await self._call("read a file",
                               lambda c: c.execute(_SQL["read_chunk"], (file_id, tenant, seq, now)).fetchone())
        return None if row is None else bytes(row[0])

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        def delete(conn: sqlite3.Connection) -> bool:
            def body() -> bool:
                if conn.execute(_SQL["delete_file"], (file_id, tenant)).rowcount == 0:
                    return False
                conn.execute(_SQL["delete_chunks"], (file_id,))
                return True
            return bool(_transaction(conn, body))

        return bool(await self._call("delete a file", delete))

    async def purge_expired_files(self, now: float | None = None) -> int:
        at = time.time() if now is None else now

        def purge(conn: sqlite3.Connection) -> int:
            def body() -> int:
                ids = [r[0] for r in conn.execute(_SQL["expired_files"], (at,)).fetchall()]
                for fid in ids:
                    conn.execute(_SQL["delete_chunks"], (fid,))
                    conn.execute(_SQL["drop_file"], (fid,))
                return len(ids)
            return int(_transaction(conn, body))

        return int(await self._call("purge expired files", purge))

    async def put_batch(self, record: BatchRecord) -> None:
        params = _batch_params(record)
        await self._call("store a batch", lambda c: c.execute(_SQL["put_batch"], params))

    async def get_batch(self, tenant: str, batch_id: str) -> BatchRecord | None:
        row = await self._call("read a batch", lambda c: c.execute(_SQL["get_batch"], (batch_id, tenant)).fetchone())
        return None if row is None else _batch(row)

    async def list_batches(self, tenant: str, after: str | None, limit: int) -> list[BatchRecord]:
        sql = _list_batches_sql(bool(after))
        params = (tenant, *((after, tenant) if after else ()), limit)
        rows = await self._call("list batches", lambda c: c.execute(sql, params).fetchall())
        return [_batch(r) for r in rows]

    async def update_batch(self, tenant: str, batch_id: str, status: str, batch: dict[str, Any],
                           expect: Collection[str]) -> bool:
        _check_status(status)
        expected = sorted(set(expect))
        if not expected:
            return False
        sql = _update_sql(expected, pg=False)
        params = (status, orjson.dumps(batch).decode(), batch_id, tenant, *expected)
        return bool(await self._call("update a batch", lambda c: c.execute(sql, params).rowcount > 0))

    async def claim_batch(self, owner: str, lease_s: float) -> BatchRecord | None:
        sql, params = _claim_sql(pg=False), _claim_params(False, owner, lease_s)

        def claim(conn: sqlite3.Connection) -> tuple[Any, ...] | None:
            row = conn.execute(sql, params).fetchone()
            return None if row is None else conn.execute(_SQL["get_batch"], (row[0], row[1])).fetchone()

        row = await self._call("claim a batch", claim)
        return None if row is None else _batch(row)

    async def renew_lease(self, batch_id: str, owner: str, lease_s: float) -> bool:
        params = (time.time() + lease_s, batch_id, owner)
        return bool(await self._call("renew a batch lease", lambda c: c.execute(_SQL["renew"], params).rowcount > 0))

    async def release_batch(self, batch_id: str, owner: str) -> None:
        await self._call("release a batch", lambda c: c.execute(_SQL["release"], (batch_id, owner)))

    async def record_line(self, batch_id: str, line: int, custom_id: str, ok: bool, text: str) -> bool:
        params = (batch_id, line, custom_id, 1 if ok else 0, text)
        return bool(await self._call("record a batch line", lambda c: c.execute(_SQL["record"], params).rowcount > 0))

    async def done_lines(self, batch_id: str) -> set[int]:
        rows = await self._call("read batch lines", lambda c: c.execute(_SQL["done"], (batch_id,)).fetchall())
        return {int(r[0]) for r in rows}

    async def line_texts(self, batch_id: str, ok: bool) -> list[str]:
        rows = await self._call("read batch lines",
                                lambda c: c.execute(_SQL["texts"], (batch_id, 1 if ok else 0)).fetchall())
        return [r[0] for r in rows]


# ------------------------------------------------------------------------------------------ PostgreSQL

_PG_SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS {FILES} (id text PRIMARY KEY, tenant text NOT NULL, purpose text NOT NULL, "
    "filename text NOT NULL, bytes bigint NOT NULL, created_at double precision NOT NULL, "
    "expires_at double precision)",
    f"ALTER TABLE {FILES} ADD COLUMN IF NOT EXISTS expires_at double precision",
    f"CREATE INDEX IF NOT EXISTS {FILES}_tenant ON {FILES} (tenant, created_at)",
    f"CREATE INDEX IF NOT EXISTS {FILES}_expires ON {FILES} (expires_at)",
    f"CREATE TABLE IF NOT EXISTS {CHUNKS} (file_id text NOT NULL, seq integer NOT NULL, data bytea NOT NULL, "
    "PRIMARY KEY (file_id, seq))",
    f"CREATE TABLE IF NOT EXISTS {BATCHES} (id text PRIMARY KEY, tenant text NOT NULL, "
    "created_at double precision NOT NULL, status text NOT NULL, batch text NOT NULL, owner text, "
    "lease_until double precision NOT NULL DEFAULT 0)",
    f"CREATE INDEX IF NOT EXISTS {BATCHES}_tenant ON {BATCHES} (tenant, created_at)",
    f"CREATE INDEX IF NOT EXISTS {BATCHES}_status ON {BATCHES} (status)",
    f"CREATE TABLE IF NOT EXISTS {LINES} (batch_id text NOT NULL, line integer NOT NULL, custom_id text NOT NULL, "
    "ok integer NOT NULL, text text NOT NULL, PRIMARY KEY (batch_id, line))",
)


class _PostgresDatabase(PostgresResponseStore):
    kind = "batch store"
    schema = _PG_SCHEMA
    schema_lock = 0x7064_6261_7463  # "pdbatc"


class PostgresBatchStore(_OnDatabase, BatchStore):
    """The shared store: tables in the response store's PostgreSQL database (its pool, this schema)."""

    def __init__(self, dsn: str) -> None:
        self._db = _PostgresDatabase(dsn)

    async def _fetch(self, what: str, sql: str, params: tuple[Any, ...], how: str = "one") -> Any:
        async def op(conn: Any) -> Any:
            cur = await conn.execute(_pg(sql), params)
            if how == "one":
                return await cur.fetchone()
            if how == "all":
                return await cur.fetchall()
            return cur.rowcount

        return await self._db._run(what, op)

    async def put_file(self, record: FileRecord, source: IO[bytes]) -> None:
        params = _file_params(record)
        start = source.tell()

        async def op(conn: Any) -> None:
            source.seek(start)  # the call may be retried on a fresh connection
            async with conn.transaction():
                await conn.execute(_pg(_SQL["delete_chunks"]), (record.id,))
                await conn.execute(_pg(_SQL["upsert_file"]), params)
                seq = 0
                while chunk := source.read(CHUNK_BYTES):
                    await conn.execute(_pg(_SQL["chunk"]), (record.id, seq, chunk))
                    seq += 1

        await self._db._run("store a file", op)

    async def get_file(self, tenant: str, file_id: str) -> FileRecord | None:
        row = await self._fetch("read a file", _SQL["get_file"], (file_id, tenant, time.time()))
        return None if row is None else _file(row)

    async def list_files(self, tenant: str, purpose: str | None, after: str | None, limit: int,
                         order: str) -> list[FileRecord]:
        rows = await self._fetch("list files", _list_files_sql(purpose, bool(after), order),
                                 _list_files_params(tenant, purpose, after, limit), "all")
        return [_file(r) for r in rows]

    async def read_chunk(self, tenant: str, file_id: str, seq: int) -> bytes | None:
        row = await self._fetch("read a file", _SQL["read_chunk"], (file_id, tenant, seq, time.time()))
        return None if row is None else bytes(row[0])

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        async def op(conn: Any) -> bool:
            async with conn.transaction():
                if (await conn.execute(_pg(_SQL["delete_file"]), (file_id, tenant))).rowcount == 0:
                    return False
                await conn.execute(_pg(_SQL["delete_chunks"]), (file_id,))
                return True

        return bool(await self._db._run("delete a file", op))

    async def purge_expired_files(self, now: float | None = None) -> int:
        at = time.time() if now is None else now

        async def op(conn: Any) -> int:
            async with conn.transaction():
                cur = await conn.execute(_pg(_SQL["expired_files"]), (at,))
                ids = [r[0] for r in await cur.fetchall()]
                for fid in ids:
                    await conn.execute(_pg(_SQL["delete_chunks"]), (fid,))
                    await conn.execute(_pg(_SQL["drop_file"]), (fid,))
                return len(ids)

        return int(await self._db._run("purge expired files", op))

    async def put_batch(self, record: BatchRecord) -> None:
        await self._fetch("store a batch", _SQL["put_batch"], _batch_params(record), "count")

    async def get_batch(self, tenant: str, batch_id: str) -> BatchRecord | None:
        row = await self._fetch("read a batch", _SQL["get_batch"], (batch_id, tenant))
        return None if row is None else _batch(row)

    async def list_batches(self, tenant: str, after: str | None, limit: int) -> list[BatchRecord]:
        rows = await self._fetch("list batches", _list_batches_sql(bool(after)),
                                 (tenant, *((after, tenant) if after else ()), limit), "all")
        return [_batch(r) for r in rows]

    async def update_batch(self, tenant: str, batch_id: str, status: str, batch: dict[str, Any],
                           expect: Collection[str]) -> bool:
        _check_status(status)
        expected = sorted(set(expect))
        if not expected:
            return False
        params = (status, orjson.dumps(batch).decode(), batch_id, tenant, expected)
        return int(await self._fetch("update a batch", _update_sql(expected, pg=True), params, "count")) > 0

    async def claim_batch(self, owner: str, lease_s: float) -> BatchRecord | None:
        sql, params = _claim_sql(pg=True), _claim_params(True, owner, lease_s)

        async def op(conn: Any) -> tuple[Any, ...] | None:
            row = await (await conn.execute(_pg(sql), params)).fetchone()
            if row is None:
                return None
            return await (await conn.execute(_pg(_SQL["get_batch"]), (row[0], row[1]))).fetchone()

        row = await self._db._run("claim a batch", op)
        return None if row is None else _batch(row)

    async def renew_lease(self, batch_id: str, owner: str, lease_s: float) -> bool:
        return int(await self._fetch("renew a batch lease", _SQL["renew"], (time.time() + lease_s, batch_id, owner),
                                     "count")) > 0

    async def release_batch(self, batch_id: str, owner: str) -> None:
        await self._fetch("release a batch", _SQL["release"], (batch_id, owner), "count")

    async def record_line(self, batch_id: str, line: int, custom_id: str, ok: bool, text: str) -> bool:
        return int(await self._fetch("record a batch line", _SQL["record"],
                                     (batch_id, line, custom_id, 1 if ok else 0, text), "count")) > 0

    async def done_lines(self, batch_id: str) -> set[int]:
        return {int(r[0]) for r in await self._fetch("read batch lines", _SQL["done"], (batch_id,), "all")}

    async def line_texts(self, batch_id: str, ok: bool) -> list[str]:
        return [r[0] for r in await self._fetch("read batch lines", _SQL["texts"], (batch_id, 1 if ok else 0), "all")]
