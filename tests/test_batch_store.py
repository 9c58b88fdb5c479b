"""The files and batches store of `/v1/files` and `/v1/batches`, both backends through the same tests (as
tests/test_response_store.py): the embedded SQLite file and a real private PostgreSQL server.

"Two frontends" are two store objects at once; "a restart" is a new store object on the same URL.
"""

from __future__ import annotations

import asyncio
import io
import shutil
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.frontend.batch_store import (
    CHUNK_BYTES,
    BatchRecord,
    BatchStore,
    FileRecord,
    PostgresBatchStore,
    SqliteBatchStore,
    StoreUnavailable,
    batch_store_url,
    open_batch_store,
)
from testing.postgres import PostgresServer, postgres_server  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(120)


@dataclass
class Backend:
    name: str
    url: str
    down: Callable[[], None]
    up: Callable[[], None]

    def store(self) -> BatchStore:
        return open_batch_store(self.url)


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "sqlite":
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        yield Backend("sqlite", batch_store_url(f"sqlite://{run_dir}/responses.db"),
                      down=lambda: shutil.rmtree(run_dir), up=lambda: run_dir.mkdir(exist_ok=True))
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        try:
            yield Backend("postgres", server.dsn(server.create_database(), password="s3cret-pw"),
                          down=server.stop, up=server.start)
        finally:
            server.start()


def run(backend: Backend, scenario: Callable[..., Awaitable[None]], stores: int = 1) -> None:
    async def main() -> None:
        opened = [backend.store() for _ in range(stores)]
        try:
            for store in opened:
                await store.start()
            await scenario(*opened)
        finally:
            for store in opened:
                await store.close()

    asyncio.run(main())


def file_record(tenant: str = "alpha", size: int = 0, purpose: str = "batch", at: float | None = None) -> FileRecord:
    return FileRecord("file-" + uuid.uuid4().hex, tenant, purpose, "../../etc/passwd", size,
                      time.time() if at is None else at)


def batch_record(tenant: str = "alpha", status: str = "validating", at: float | None = None) -> BatchRecord:
    bid = "batch_" + uuid.uuid4().hex
    return BatchRecord(bid, tenant, time.time() if at is None else at, status,
                       {"id": bid, "object": "batch", "request_counts": {"total": 3}, "metadata": {"k": "\u0000é"}})


async def read_all(store: BatchStore, tenant: str, file_id: str) -> bytes:
    out, seq = bytearray(), 0
    while (chunk := await store.read_chunk(tenant, file_id, seq)) is not None:
        out += chunk
        seq += 1
    return bytes(out)


def test_expired_files_are_not_read_and_are_purged(backend: Backend) -> None:
    async def scenario(store: BatchStore) -> None:
        now = time.time()
        gone, kept, forever = file_record(at=now - 20), file_record(at=now - 10), file_record(at=now - 5)
        gone.expires_at, kept.expires_at = now - 1, now + 3600
        for rec in (gone, kept, forever):
            await store.put_file(rec, io.BytesIO(b"x" * 10))
        assert await store.get_file("alpha", gone.id) is None and await store.read_chunk("alpha", gone.id, 0) is None
        listed = [f.id for f in await store.list_files("alpha", None, None, 10, "asc")]
        assert listed == [kept.id, forever.id]
        got = await store.get_file("alpha", kept.id)
        assert got is not None and got.object()["expires_at"] == int(kept.expires_at)
        assert "expires_at" not in (await store.get_file("alpha", forever.id)).object()  # type: ignore[union-attr]
        assert await store.purge_expired_files() == 1 and await store.purge_expired_files() == 0
        assert not await store.delete_file("alpha", gone.id)
        assert await store.purge_expired_files(now + 7200) == 1  # `kept` in two hours; `forever` never
        assert [f.id for f in await store.list_files("alpha", None, None, 10, "asc")] == [forever.id]

    run(backend, scenario)


def test_a_store_made_before_files_expired_gets_the_column(tmp_path: Path) -> None:
    """An SQLite batch store from before expiry (no expires_at column) is upgraded when opened."""
    path = tmp_path / "old-batches.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE pdserve_files (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, "
                 "filename TEXT NOT NULL, bytes INTEGER NOT NULL, created_at REAL NOT NULL)")
    conn.execute("INSERT INTO pdserve_files VALUES ('file-old', 'alpha', 'batch', 'a.jsonl', 0, 1.0)")
    conn.commit()
    conn.close()

    async def main() -> None:
        store = open_batch_store(str(path))
        await store.start()
        try:
            old = await store.get_file("alpha", "file-old")
            assert old is not None and old.expires_at is None
        finally:
            await store.close()

    asyncio.run(main())


def test_batch_store_url_is_beside_the_response_store(tmp_path: Path) -> None:
    assert batch_store_url(str(tmp_path / "responses.db")) == str(tmp_path / "responses-batches.db")
    assert batch_store_url(f"sqlite://{tmp_path}/r.db") == str(tmp_path / "r-batches.db")
    assert batch_store_url("postgresql://u@h/db") == "postgresql://u@h/db"
    assert isinstance(open_batch_store("postgresql://u@h/db"), PostgresBatchStore)
    assert isinstance(open_batch_store(str(tmp_path / "x.db")), SqliteBatchStore)
    with pytest.raises(ValueError):
        batch_store_url("ftp://nowhere")


def test_files_round_trip_in_chunks_per_tenant(backend: Backend) -> None:
    data = bytes(range(256)) * ((2 * CHUNK_BYTES + 1000) // 256)

    async def scenario(store: BatchStore) -> None:
        rec = file_record(size=len(data))
        await store.put_file(rec, io.BytesIO(data))
        got = await store.get_file("alpha", rec.id)
        assert got is not None and got.filename == "../../etc/passwd" and got.bytes == len(data)
        assert got.object()["object"] == "file" and got.object()["purpose"] == "batch"
        assert await read_all(store, "alpha", rec.id) == data
        assert await store.get_file("beta", rec.id) is None
        assert await store.read_chunk("beta", rec.id, 0) is None
        assert not await store.delete_file("beta", rec.id)
        assert await store.delete_file("alpha", rec.id)
        assert await store.get_file("alpha", rec.id) is None and await store.read_chunk("alpha", rec.id, 0) is None
        assert not await store.delete_file("alpha", rec.id)
        empty = file_record()
        await store.put_file(empty, io.BytesIO(b""))
        assert await read_all(store, "alpha", empty.id) == b""
        await store.put_file(empty, io.BytesIO(b"replaced"))  # same id: replaced whole
        assert await read_all(store, "alpha", empty.id) == b"replaced"

    run(backend, scenario)


def test_list_files_pages_by_purpose_and_order(backend: Backend) -> None:
    async def scenario(store: BatchStore) -> None:
        t0 = time.time()
        recs = [file_record(tenant="lister", at=t0 + i, purpose="batch" if i % 2 == 0 else "batch_output")
                for i in range(5)]
        for r in recs:
            await store.put_file(r, io.BytesIO(b"x"))
        await store.put_file(file_record(tenant="other"), io.BytesIO(b"y"))
        ids = [r.id for r in recs]
        assert [f.id for f in await store.list_files("lister", None, None, 10, "desc")] == ids[::-1]
        assert [f.id for f in await store.list_files("lister", None, None, 2, "asc")] == ids[:2]
        assert [f.id for f in await store.list_files("lister", None, ids[1], 2, "asc")] == ids[2:4]
        assert [f.id for f in await store.list_files("lister", None, ids[3], 10, "desc")] == ids[:3][::-1]
        assert [f.id for f in await store.list_files("lister", "batch", None, 10, "asc")] == ids[0::2]
        assert await store.list_files("lister", None, "file-unknown", 10, "asc") == []

    run(backend, scenario)


def test_batches_cas_counts_and_tenants(backend: Backend) -> None:
    async def scenario(store: BatchStore) -> None:
        rec = batch_record()
        await store.put_batch(rec)
        got = await store.get_batch("alpha", rec.id)
        assert got is not None and got.status == "validating" and got.batch["metadata"] == {"k": "\u0000é"}
        assert got.object()["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
        assert await store.get_batch("beta", rec.id) is None
        assert not await store.update_batch("beta", rec.id, "cancelling", got.batch, ("validating",))
        assert await store.update_batch("alpha", rec.id, "in_progress", got.batch, ("validating",))
        assert not await store.update_batch("alpha", rec.id, "failed", got.batch, ("validating",))
        assert await store.record_line(rec.id, 1, "a", True, '{"custom_id":"a"}')
        assert not await store.record_line(rec.id, 1, "a", True, '{"custom_id":"a","again":1}')  # once only
        assert await store.record_line(rec.id, 3, "c", False, '{"custom_id":"c"}')
        assert await store.record_line(rec.id, 0, "z", True, '{"custom_id":"z"}')
        got = await store.get_batch("alpha", rec.id)
        assert got is not None and got.object()["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
        assert await store.done_lines(rec.id) == {0, 1, 3}
        assert await store.line_texts(rec.id, True) == ['{"custom_id":"z"}', '{"custom_id":"a"}']
        assert await store.line_texts(rec.id, False) == ['{"custom_id":"c"}']
        with pytest.raises(ValueError):
            await store.update_batch("alpha", rec.id, "nonsense", {}, ("in_progress",))

    run(backend, scenario)


def test_list_batches_newest_first(backend: Backend) -> None:
    async def scenario(store: BatchStore) -> None:
        t0 = time.time()
        recs = [batch_record(tenant="lister", at=t0 + i) for i in range(4)]
        for r in recs:
            await store.put_batch(r)
        ids = [r.id for r in recs][::-1]
        assert [b.id for b in await store.list_batches("lister", None, 10)] == ids
        assert [b.id for b in await store.list_batches("lister", ids[1], 10)] == ids[2:]
        assert await store.list_batches("nobody", None, 10) == []

    run(backend, scenario)


def test_one_frontend_holds_a_batch_until_its_lease_expires(backend: Backend) -> None:
    async def scenario(a: BatchStore, b: BatchStore) -> None:
        done = batch_record(status="completed", at=0.0)
        await a.put_batch(done)
        rec = batch_record(at=1.0)
        await a.put_batch(rec)
        got = await a.claim_batch("fe-a", 0.6)
        assert got is not None and got.id == rec.id and got.owner == "fe-a"
        assert await b.claim_batch("fe-b", 30) is None  # held (and the completed one is not active)
        assert await a.renew_lease(rec.id, "fe-a", 0.6)
        assert not await b.renew_lease(rec.id, "fe-b", 30)
        await asyncio.sleep(0.8)  # fe-a "crashed": its lease lapses
        took = await b.claim_batch("fe-b", 30)
        assert took is not None and took.id == rec.id and took.owner == "fe-b"
        assert not await a.renew_lease(rec.id, "fe-a", 30)  # fe-a lost it
        assert await a.claim_batch("fe-a", 30) is None
        await b.release_batch(rec.id, "fe-b")
        again = await a.claim_batch("fe-a", 30)
        assert again is not None and again.id == rec.id

    run(backend, scenario, stores=2)


def test_two_claimers_racing_get_distinct_batches(backend: Backend) -> None:
    async def scenario(a: BatchStore, b: BatchStore) -> None:
        recs = [batch_record(tenant="race", at=float(i)) for i in range(6)]
        for r in recs:
            await a.put_batch(r)
        claims = await asyncio.gather(*(s.claim_batch(f"fe-{i}", 30) for i, s in enumerate([a, b] * 3)))
        ids = [c.id for c in claims if c is not None]
        assert len(ids) == len(set(ids))

    run(backend, scenario, stores=2)


def test_database_down_is_store_unavailable(backend: Backend) -> None:
    async def scenario(store: BatchStore) -> None:
        rec = file_record()
        await store.put_file(rec, io.BytesIO(b"abc"))
        backend.down()
        try:
            with pytest.raises(StoreUnavailable) as err:
                await store.get_file("alpha", rec.id)
            assert "s3cret-pw" not in str(err.value) and "batch store" in str(err.value)
            assert not await store.ping()
        finally:
            backend.up()
        if backend.name == "postgres":  # the data survives the server's restart
            for _ in range(50):
                if await store.ping():
                    break
                await asyncio.sleep(0.1)
            assert await read_all(store, "alpha", rec.id) == b"abc"

    run(backend, scenario)
