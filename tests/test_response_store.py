"""The stored-responses store of `/v1/responses`, both backends through the same tests: the embedded SQLite
file and a real private PostgreSQL server (testing/postgres.py; skipped where none can be had).

A "frontend restart" is a new store object on the same path/DSN, "two frontends" are two store objects
at once; "the database down" is the PostgreSQL server stopped, or the SQLite file's directory removed.
"""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.frontend.response_store import (
    PostgresResponseStore,
    ResponseStore,
    SqliteResponseStore,
    StoredResponse,
    StoreUnavailable,
    open_store,
)
from testing.postgres import PostgresServer, postgres_server  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(120)


@dataclass
class Backend:
    name: str
    url: str
    down: Callable[[], None]  # the database becomes unreachable
    up: Callable[[], None]    # and back

    def store(self) -> ResponseStore:
        return open_store(self.url)


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "sqlite":
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        yield Backend("sqlite", f"sqlite://{run_dir}/responses.db",
                      down=lambda: shutil.rmtree(run_dir), up=lambda: run_dir.mkdir(exist_ok=True))
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        try:
            yield Backend("postgres", server.dsn(server.create_database(), password="s3cret-pw"),
                          down=server.stop, up=server.start)
        finally:
            server.start()  # for the next test, whatever this one did


def run(backend: Backend, scenario: Callable[..., Awaitable[None]], stores: int = 1) -> None:
    """Runs `scenario(*stores)` on started stores of `backend`, closing them afterwards."""

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


def record(tenant: str = "alpha", status: str = "completed", ttl: float = 3600.0, **fields: object) -> StoredResponse:
    rid = "resp_" + uuid.uuid4().hex
    now = time.time()
    values: dict[str, object] = dict(
        id=rid, tenant=tenant, created_at=now, expires_at=now + ttl, status=status,
        response={"id": rid, "object": "response", "status": status, "created_at": int(now),
                  "output": [{"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": "héllo \u0000 wörld 🎉"}]}],
                  "usage": {"input_tokens": 3, "output_tokens": 2}, "zeta": 1, "alpha": [1.5, None, True]},
        input_items=[{"id": "msg_1", "type": "message", "role": "user",
                      "content": [{"type": "input_text", "text": "hi"}]}],
        context=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                 {"role": "assistant", "content": "héllo"}],
        previous_response_id="resp_" + "0" * 32,
    )
    values.update(fields)
    return StoredResponse(**values)  # type: ignore[arg-type]


def same(a: StoredResponse | None, b: StoredResponse) -> bool:
    return a is not None and vars(a) == vars(b) and list(a.response) == list(b.response)  # key order kept


def test_put_get_round_trips_every_field(backend: Backend) -> None:
    async def scenario(store: ResponseStore) -> None:
        rec = record()
        await store.put(rec)
        assert same(await store.get("alpha", rec.id), rec)
        plain = record(previous_response_id=None, status="queued", input_items=[], context=[])
        await store.put(plain)
        assert same(await store.get("alpha", plain.id), plain)
        assert await store.get("alpha", "resp_absent") is None
        replaced = record(id=rec.id, status="failed", response={"id": rec.id, "error": {"code": "x"}})
        await store.put(replaced)  # insert or replace by id
        assert same(await store.get("alpha", rec.id), replaced)

    run(backend, scenario)


def test_tenants_never_see_each_other(backend: Backend) -> None:
    async def scenario(store: ResponseStore) -> None:
        rec = record(tenant="alpha", status="in_progress")
        await store.put(rec)
        assert await store.get("beta", rec.id) is None
        assert await store.delete("beta", rec.id) is False
        assert await store.update_status("beta", rec.id, "cancelled", {"id": rec.id}, {"in_progress"}) is False
        assert same(await store.get("alpha", rec.id), rec)

    run(backend, scenario)


def test_delete(backend: Backend) -> None:
    async def scenario(store: ResponseStore) -> None:
        rec, other = record(), record()
        await store.put(rec)
        await store.put(other)
        assert await store.delete("alpha", rec.id) is True
        assert await store.get("alpha", rec.id) is None
        assert await store.delete("alpha", rec.id) is False
        assert same(await store.get("alpha", other.id), other)

    run(backend, scenario)


def test_expired_records_are_absent_and_purged(backend: Backend) -> None:
    async def scenario(store: ResponseStore) -> None:
        gone = record(ttl=-1.0)
        soon = record(ttl=0.3)
        later = [record(ttl=100.0) for _ in range(3)]
        for rec in (gone, soon, *later):
            await store.put(rec)
        assert await store.get("alpha", gone.id) is None  # and purged by the read
        assert await store.delete("alpha", gone.id) is False
        assert same(await store.get("alpha", soon.id), soon)
        await asyncio.sleep(0.4)
        assert await store.get("alpha", soon.id) is None
        assert await store.update_status("alpha", soon.id, "cancelled", {}, {"completed"}) is False
        # Purging at a future time removes what has expired by then, and counts it.
        assert await store.purge_expired(time.time() + 200) == 3
        assert await store.purge_expired() == 0
        assert all([await store.get("alpha", rec.id) is None for rec in later])

    run(backend, scenario)


def test_purge_counts_what_it_removed(backend: Backend) -> None:
    async def scenario(store: ResponseStore) -> None:
        expired = [record(ttl=-5.0) for _ in range(4)]
        live = record(ttl=100.0)
        for rec in (*expired, live):
            await store.put(rec)
        assert await store.purge_expired() == 4
        assert same(await store.get("alpha", live.id), live)

    run(backend, scenario)


def test_update_status_is_a_compare_and_set(backend: Backend) -> None:
    async def scenario(store: ResponseStore) -> None:
        rec = record(status="queued")
        await store.put(rec)
        running = {**rec.response, "status": "in_progress"}
        assert await store.update_status("alpha", rec.id, "in_progress", running, {"queued"}) is True
        assert await store.update_status("alpha", rec.id, "in_progress", running, {"queued"}) is False
        assert await store.update_status("alpha", rec.id, "completed", {}, ()) is False
        done = {**rec.response, "status": "completed", "output_text": "done"}
        assert await store.update_status("alpha", rec.id, "completed", done, {"queued", "in_progress"}) is True
        got = await store.get("alpha", rec.id)
        assert got is not None and got.status == "completed" and got.response == done
        assert got.context == rec.context and got.input_items == rec.input_items  # untouched
        with pytest.raises(ValueError, match="unknown response status"):
            await store.update_status("alpha", rec.id, "finished", done, {"completed"})

    run(backend, scenario)


def test_a_cancel_racing_a_completion_has_one_winner(backend: Backend) -> None:
    """Two frontends: one cancels, the other's background runner finishes; exactly one of them wins, and
    the stored status is the winner's."""

    async def scenario(a: ResponseStore, b: ResponseStore) -> None:
        recs = [record(status="in_progress") for _ in range(15)]
        for rec in recs:
            await a.put(rec)
        for i, rec in enumerate(recs):
            cancel = a.update_status("alpha", rec.id, "cancelled", {"status": "cancelled"}, {"queued", "in_progress"})
            finish = b.update_status("alpha", rec.id, "completed", {"status": "completed"}, {"in_progress"})
            won = await asyncio.gather(*((cancel, finish) if i % 2 else (finish, cancel)))
            if not i % 2:
                won.reverse()
            assert sorted(won) == [False, True], won
            got = await b.get("alpha", rec.id)
            assert got is not None and got.status == ("cancelled" if won[0] else "completed")
            assert got.response == {"status": got.status}
        # Many racers on one store object: still exactly one.
        rec = record(status="in_progress")
        await a.put(rec)
        results = await asyncio.gather(*(store.update_status("alpha", rec.id, "cancelled", {"n": n}, {"in_progress"})
                                         for n, store in enumerate([a, b] * 4)))
        assert results.count(True) == 1

    run(backend, scenario, stores=2)


def test_records_survive_a_frontend_restart(backend: Backend) -> None:
    rec = record()

    async def first(store: ResponseStore) -> None:
        await store.put(rec)

    async def second(store: ResponseStore) -> None:
        assert same(await store.get("alpha", rec.id), rec)

    run(backend, first)
    run(backend, second)


def test_two_frontends_see_each_others_writes(backend: Backend) -> None:
    async def scenario(a: ResponseStore, b: ResponseStore) -> None:
        ra, rb = record(), record(tenant="beta")
        await a.put(ra)
        await b.put(rb)
        assert same(await b.get("alpha", ra.id), ra)
        assert same(await a.get("beta", rb.id), rb)
        assert await b.update_status("alpha", ra.id, "cancelled", {"status": "cancelled"}, {"completed"})
        got = await a.get("alpha", ra.id)
        assert got is not None and got.status == "cancelled"
        assert await a.delete("beta", rb.id) is True
        assert await b.get("beta", rb.id) is None

    run(backend, scenario, stores=2)


def test_database_down_is_store_unavailable_then_recovers(backend: Backend) -> None:
    async def scenario(store: ResponseStore) -> None:
        before = record()
        await store.put(before)
        assert await store.ping() is True
        backend.down()
        try:
            for call in (store.get("alpha", before.id), store.put(record()), store.delete("alpha", before.id),
                         store.update_status("alpha", before.id, "cancelled", {}, {"completed"}),
                         store.purge_expired()):
                with pytest.raises(StoreUnavailable) as err:
                    await call
                message = str(err.value)
                assert ("SQLite" if backend.name == "sqlite" else "PostgreSQL") in message
                assert "s3cret-pw" not in message and "s3cret-pw" not in repr(err.value.__cause__)
            assert await store.ping() is False
        finally:
            backend.up()
        # The same store object works again (SQLite: a new file in the recreated directory).
        after = record()
        await store.put(after)
        assert same(await store.get("alpha", after.id), after)
        assert await store.ping() is True
        if backend.name == "postgres":
            assert same(await store.get("alpha", before.id), before)  # the server kept its data

    run(backend, scenario)


def test_a_restart_between_calls_costs_no_call(postgres_server: PostgresServer) -> None:  # noqa: F811
    """Pooled connections die with the server; the first call after it is back still succeeds."""

    async def scenario(store: ResponseStore) -> None:
        rec = record()
        await asyncio.gather(*(store.put(record()) for _ in range(4)))  # several pooled connections
        await store.put(rec)
        postgres_server.stop()
        postgres_server.start()
        assert same(await store.get("alpha", rec.id), rec)
        assert await store.ping() is True

    run(Backend("postgres", postgres_server.dsn(postgres_server.create_database()), lambda: None, lambda: None),
        scenario)


def test_a_dropped_table_is_recreated(postgres_server: PostgresServer) -> None:  # noqa: F811
    import psycopg

    dsn = postgres_server.dsn(postgres_server.create_database())

    async def scenario(store: ResponseStore) -> None:
        await store.put(record())
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DROP TABLE pdserve_responses")
        rec = record()
        await store.put(rec)
        assert same(await store.get("alpha", rec.id), rec)

    run(Backend("postgres", dsn, lambda: None, lambda: None), scenario)


def test_start_fails_cleanly_without_a_database(tmp_path: Path) -> None:
    async def scenario() -> None:
        missing_dir = SqliteResponseStore(tmp_path / "file-not-dir" / "x.db")
        (tmp_path / "file-not-dir").write_text("a file where the directory should be")
        with pytest.raises(StoreUnavailable, match="SQLite"):
            await missing_dir.start()
        await missing_dir.close()
        not_a_db = tmp_path / "garbage.db"
        not_a_db.write_bytes(b"this is not an sqlite database" * 100)
        garbage = SqliteResponseStore(not_a_db)
        with pytest.raises(StoreUnavailable, match="SQLite"):
            await garbage.start()
        assert await garbage.ping() is False
        await garbage.close()
        down = PostgresResponseStore(f"postgresql://pdserve:s3cret-pw@127.0.0.1:{_closed_port()}/db",
                                     connect_timeout_s=2)
        with pytest.raises(StoreUnavailable, match="PostgreSQL") as err:
            await down.start()
        assert "s3cret-pw" not in str(err.value) and "127.0.0.1" in down.description
        assert await down.ping() is False
        await down.close()
        with pytest.raises(StoreUnavailable, match="closed"):
            await down.get("alpha", "resp_x")
        bad = PostgresResponseStore("postgresql://pdserve:s3cret-pw@127.0.0.1:notaport/db")
        with pytest.raises(StoreUnavailable) as err:
            await bad.start()
        assert "s3cret-pw" not in str(err.value) and "s3cret-pw" not in bad.description

    asyncio.run(scenario())


def test_closed_sqlite_store_refuses_calls(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = SqliteResponseStore(tmp_path / "new" / "dir" / "r.db")
        await store.start()  # creates its directory
        await store.put(record())
        await store.close()
        await store.close()
        with pytest.raises(StoreUnavailable, match="closed"):
            await store.get("alpha", "resp_x")
        assert await store.ping() is False

    asyncio.run(scenario())


def test_records_no_backend_should_hold_are_refused(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = SqliteResponseStore(tmp_path / "r.db")
        await store.start()
        with pytest.raises(ValueError, match="unknown response status"):
            await store.put(record(status="done"))
        with pytest.raises(ValueError, match="JSON-serialisable"):
            await store.put(record(response={"x": object()}))
        await store.close()

    asyncio.run(scenario())


def test_open_store_parses_urls(tmp_path: Path) -> None:
    s = open_store("sqlite:///abs/path.db")
    assert isinstance(s, SqliteResponseStore) and s.path == "/abs/path.db"
    assert isinstance(s := open_store(str(tmp_path / "r.db")), SqliteResponseStore) and s.path == str(tmp_path / "r.db")
    assert isinstance(s := open_store("run/responses.db"), SqliteResponseStore) and s.path == "run/responses.db"
    assert isinstance(s := open_store("sqlite:///a%20b/r.db"), SqliteResponseStore) and s.path == "/a b/r.db"
    for url in ("postgresql://u:pw@db:5432/pdserve", "postgres://db/pdserve", "POSTGRESQL://db/x"):
        assert isinstance(open_store(url), PostgresResponseStore), url
    assert "pw" not in open_store("postgresql://u:pw@db:5432/pdserve").description
    for url in ("", "  ", "mysql://db/x", "redis://x", "sqlite://relative.db", "sqlite:relative.db",
                "sqlite:///x.db?mode=ro", "postgresql:db", "http://x"):
        with pytest.raises(ValueError):
            open_store(url)


def _closed_port() -> int:
    from pdserve.registry.etcd_server import free_port

    return free_port()
