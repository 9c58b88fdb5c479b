"""`/v1/files` and `/v1/batches` (OpenAI's Batch API) over a `Frontend`, run on spare capacity.

Files are uploaded as multipart forms (`file`, `purpose: "batch"`), spooled to a temporary file by the
multipart parser (never held whole in memory; the body stream is cut off with a 413 once it passes
`--max-file-bytes`), then copied into the store (`frontend.batch_store`) in chunks, in one transaction.
A client's file name is kept as a name only (its last path component, without control characters) and
never used as a path.

A batch is a record in the store, run by whichever frontend claims it (a lease with an expiry, renewed
while it runs; `BatchStore.claim_batch`). Its runner:

1. `validating`: reads the input file and checks every line as OpenAI does (JSON object, `custom_id`
   unique, `method` POST, `url` the batch's endpoint, `body` an object, `body.model` served, allowed to
   the tenant and the same on every line); any problem fails the batch with every problem in
   `errors.data` (`code`, `message`, `param`, `line`: 1-based).
2. `in_progress`: runs each line not recorded yet as a request of the batch's tenant, admitted in-process
   through the frontend's own admission (`Frontend.admit`, `ResponsesService.admit`: keys, models, tenant
   limits, quotas) at `batch` priority (never more urgent: `effective_priority`), and records the line's
   output or error line in the store as soon as it finished (`record_line`, once per line). A line
   refused for now (503 overload or no route, a 429 that may be retried) waits and is tried again; any
   other refusal or failure is the line's error (in the error file, with its status code and the OpenAI
   error body).
3. `finalizing` -> `completed`: the output file (the ok lines) and the error file (the failed ones) are
   written as files of purpose `batch_output` with ids derived from the batch id (so a runner that dies
   while finalizing and the one that resumes write the same files).

`cancelling` (POST .../cancel, compare-and-set, from any frontend) stops the runner within
`_WATCH_S`: lines in flight are cancelled, finished ones stay, and the batch ends `cancelled` with its
output and error files; past `expires_at` (24 h) it ends `expired`. Lines that never ran (cancelled,
expired) go to the error file with code `batch_cancelled` / `batch_expired`, so every custom_id is in
exactly one of the two files, exactly once.

Spare capacity: this frontend runs at most `batch_slots()` = max(0, `--batch-max-inflight` - I) batch
lines at once, where I is the number of interactive (non-batch) requests it has in flight now: every
interactive request takes one batch slot away, the slots come back as they end. Lines already running
finish; only new ones wait. Waiting lines are re-checked every `_SLOT_POLL_S`.

A frontend killed mid-batch loses its lease after `--batch-lease` seconds; then any frontend on the same
store (the restarted one, or another) claims the batch and runs only the lines not recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

import orjson
from prometheus_client import Counter, Gauge

from pdserve.frontend.batch_store import (
    BatchRecord,
    BatchStore,
    FileRecord,
    StoreUnavailable,
    batch_store_url,
    open_batch_store,
)
from pdserve.frontend.errors import (
    NOT_FOUND,
    SERVER,
    APIError,
    invalid_type,
    invalid_value,
    missing_parameter,
)
from pdserve.frontend.job import CHAT, COMPLETION, RESPONSES
from pdserve.frontend.metrics import POOL
from pdserve.frontend.protocol import PRIORITY_CLASSES
from pdserve.frontend.tenants import Tenant

if TYPE_CHECKING:
    from pdserve.frontend.pipeline import Frontend

log = logging.getLogger(__name__)

EMBEDDINGS = "embeddings"
# /v1/embeddings runs through `Frontend.embeddings` (frontend.embeddings) where the frontend has it.
ENDPOINTS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/v1/responses": RESPONSES,
             "/v1/embeddings": EMBEDDINGS}
UNSUPPORTED_ENDPOINTS = ("/v1/moderations",)
OPENAI_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
COMPLETION_WINDOW_S = 24 * 3600.0
MAX_BATCH_LINES = 50_000
MAX_REPORTED_ERRORS = 100
MAX_FILE_LIST = 10_000
MAX_BATCH_LIST = 100
_MAX_ACTIVE_BATCHES = 4     # batches one frontend runs at once (they share its batch slots)
_CLAIM_POLL_S = 1.0
_WATCH_S = 0.5
_SLOT_POLL_S = 0.05
_RETRY_S = (0.25, 0.5, 1.0, 2.0, 4.0)
BATCH_PRIORITY = PRIORITY_CLASSES["batch"]


def batch_slots(limit: int, interactive: int) -> int:
    """The spare-capacity rule: batch lines this frontend may have in flight with `interactive`
    non-batch requests in flight."""
    return max(0, limit - max(0, interactive))


# ---------------------------------------------------------------------------------------------- errors


def _unavailable(err: StoreUnavailable) -> APIError:
    return APIError(503, f"The file and batch store is unavailable now ({err}); retry shortly.", type=SERVER,
                    code="store_unavailable", headers={"retry-after": "1"})


def _file_not_found(file_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No such File object: {file_id[:100]}", type=NOT_FOUND, param=param, code="file_not_found")


def _batch_not_found(batch_id: str) -> APIError:
    return APIError(404, f"No batch found with id '{batch_id[:100]}'.", type=NOT_FOUND, param="batch_id",
                    code="batch_not_found")


def safe_filename(name: str | None) -> str:
    """A client's file name as a name only: its last path component, no control characters, <= 255."""
    base = re.split(r"[/\\]", name or "")[-1]
    base = "".join(ch for ch in base if ch.isprintable()).strip()
    if base in ("", ".", ".."):
        base = "file"
    return base[:255]


def _new_file_id() -> str:
    return "file-" + uuid.uuid4().hex


def _derived_file_id(batch_id: str, which: str) -> str:
    return "file-" + hashlib.sha256(f"{batch_id}:{which}".encode()).hexdigest()[:32]


def _line_error(code: str, message: str, line: int | None, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


@dataclass(eq=False)
class Line:
    """One request of a batch's input file."""

    no: int  # 1-based line number in the file
    custom_id: str
    body: dict[str, Any]


@dataclass(eq=False)
class _Run:
    """One runner's state for the batch it holds."""

    rec: BatchRecord
    tenant: Tenant | None
    cancelling: bool = False
    lost: bool = False
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def expired(self) -> bool:
        return time.time() >= float(self.rec.batch.get("expires_at") or 0)

    @property
    def stopped(self) -> bool:
        return self.cancelling or self.lost or self.expired


class _Retry(Exception):
    """A line refused for now (overload, no route, a retryable 429): tried again later."""


class BatchService:
    """/v1/files and /v1/batches for one frontend: the store connection and the batch runner."""

    def __init__(self, frontend: Frontend) -> None:
        self.fe = frontend
        self._url = batch_store_url(frontend.config.response_store)
        self._store: BatchStore | None = None
        self._opening: asyncio.Lock | None = None
        self.owner = f"{frontend.config.frontend_id}-{uuid.uuid4().hex[:8]}"
        self._runs: dict[str, asyncio.Task[None]] = {}
        self._kick: asyncio.Event | None = None
        self.lines_inflight = 0  # batch lines started here and not finished (admission included)
        self.jobs_inflight = 0   # of those, admitted jobs (they count in Frontend.inflight)
        self._tenants = {t.name: t for t in frontend.tenants.tenants}
        m, labels = frontend.metrics, (POOL, frontend.metrics.node)
        Gauge("pdserve_frontend_batch_lines_in_flight", "Batch lines this frontend is running now", ["pool", "node"],
              registry=m.registry).labels(*labels).set_function(lambda: self.lines_inflight)
        Gauge("pdserve_frontend_batch_slots", "Batch lines this frontend may run at once now: --batch-max-inflight "
              "minus its interactive requests in flight", ["pool", "node"],
              registry=m.registry).labels(*labels).set_function(self.batch_slots)
        self._lines_total = Counter("pdserve_frontend_batch_lines_total", "Batch lines run to an end, by outcome "
                                    "(ok: in the output file, failed: in the error file)", ["pool", "node", "outcome"],
                                    registry=m.registry)
        self._line_outcome = {ok: self._lines_total.labels(*labels, "ok" if ok else "failed") for ok in (True, False)}

    # --- the store ---

    async def store(self) -> BatchStore:
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._store is None:
                store = open_batch_store(self._url)
                try:
                    await store.start()
                except StoreUnavailable as err:
                    await store.close()
                    raise _unavailable(err) from None
                self._store = store
        return self._store

    async def _call(self, fn: str, *args: Any) -> Any:
        store = await self.store()
        try:
            return await getattr(store, fn)(*args)
        except StoreUnavailable as err:
            raise _unavailable(err) from None

    def start(self) -> None:
        """Starts the runner (claims batches, also those a killed frontend left), unless this frontend
        runs no batches (--batch-max-inflight 0)."""
        self._kick = asyncio.Event()
        if self.fe.config.batch_max_inflight > 0:
            self.fe.spawn(self._claim_loop())

    async def close(self) -> None:
        for task in list(self._runs.values()):
            task.cancel()
        for task in list(self._runs.values()):
            with contextlib.suppress(BaseException):
                await task
        if self._store is not None:
            await self._store.close()

    # --- files ---

    async def upload(self, tenant: Tenant, purpose: object, filename: str | None, source: IO[bytes],
                     size: int) -> dict[str, Any]:
        """Stores an uploaded file (`source`, `size` bytes, read from its start) as a file of `tenant`."""
        if purpose is None:
            raise missing_parameter("purpose")
        if purpose != "batch":
            known = " (a purpose of OpenAI's that this server does not serve)" if purpose in OPENAI_PURPOSES else ""
            raise invalid_value("purpose", f"{str(purpose)[:40]!r}{known}: this server accepts only 'batch' (input "
                                "files of /v1/batches), not " + ", ".join(
                                    repr(p) for p in OPENAI_PURPOSES if p != "batch") + ".")
        if size > self.fe.config.max_file_bytes:
            raise too_large(self.fe.config.max_file_bytes)
        record = FileRecord(_new_file_id(), tenant.name, "batch", safe_filename(filename), size, time.time())
        source.seek(0)
        await self._call("put_file", record, source)
        return record.object()

    async def get_file(self, tenant: Tenant, file_id: str) -> FileRecord:
        rec = await self._call("get_file", tenant.name, file_id)
        if rec is None:
            raise _file_not_found(file_id)
        return rec

    async def list_files(self, tenant: Tenant, query: Any) -> dict[str, Any]:
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid_value("order", f"{order[:20]!r} is not one of 'asc', 'desc'.")
        limit = _limit(query.get("limit"), 10_000, MAX_FILE_LIST)
        purpose = query.get("purpose")
        rows = await self._call("list_files", tenant.name, purpose, query.get("after"), limit + 1, order)
        return _page([r.object() for r in rows], limit)

    async def delete_file(self, tenant: Tenant, file_id: str) -> dict[str, Any]:
        if not await self._call("delete_file", tenant.name, file_id):
            raise _file_not_found(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def content(self, tenant: Tenant, file_id: str) -> tuple[FileRecord, AsyncIterator[bytes]]:
        """A file and its bytes, chunk by chunk; the first chunk is read now (so 404/503 come first)."""
        rec = await self.get_file(tenant, file_id)
        first = await self._call("read_chunk", tenant.name, file_id, 0)

        async def chunks() -> AsyncIterator[bytes]:
            seq, chunk = 0, first
            while chunk is not None:
                yield chunk
                seq += 1
                try:
                    chunk = await self._call("read_chunk", tenant.name, file_id, seq)
                except APIError:
                    log.warning("file %s: the store failed mid-download", file_id)
                    return

        return rec, chunks()

    async def _file_bytes(self, tenant: str, file_id: str) -> bytes | None:
        rec = await self._call("get_file", tenant, file_id)
        if rec is None:
            return None
        out, seq = bytearray(), 0
        while (chunk := await self._call("read_chunk", tenant, file_id, seq)) is not None:
            out += chunk
            seq += 1
        return bytes(out)

    # --- batches ---

    async def create(self, tenant: Tenant, body: bytes) -> dict[str, Any]:
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise APIError(400, "We could not parse the JSON body of your request.", code="invalid_json") from None
        if not isinstance(obj, dict):
            raise invalid_type("body", "an object", obj)
        for name in ("input_file_id", "endpoint", "completion_window"):
            if name not in obj:
                raise missing_parameter(name)
            if not isinstance(obj[name], str):
                raise invalid_type(name, "a string", obj[name])
        endpoint = obj["endpoint"]
        if endpoint not in self.endpoints():
            extra = " (not served in batches by this server)" if endpoint in UNSUPPORTED_ENDPOINTS else ""
            raise invalid_value("endpoint", f"{endpoint[:60]!r}{extra}; supported: {', '.join(self.endpoints())}.")
        if obj["completion_window"] != "24h":
            raise invalid_value("completion_window", f"{obj['completion_window'][:20]!r}; only '24h' is supported.")
        metadata = _metadata(obj.get("metadata"))
        source = await self._call("get_file", tenant.name, obj["input_file_id"])
        if source is None:
            raise _file_not_found(obj["input_file_id"], "input_file_id")
        if source.purpose != "batch":
            raise invalid_value("input_file_id", f"file '{source.id}' has purpose '{source.purpose}'; a batch's "
                                "input file has purpose 'batch'.")
        now = time.time()
        bid = "batch_" + uuid.uuid4().hex
        batch = {"id": bid, "object": "batch", "endpoint": endpoint, "model": None, "errors": None,
                 "input_file_id": source.id, "completion_window": "24h", "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": int(now), "in_progress_at": None,
                 "expires_at": int(now + COMPLETION_WINDOW_S), "finalizing_at": None, "completed_at": None,
                 "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata}
        record = BatchRecord(bid, tenant.name, now, "validating", batch)
        await self._call("put_batch", record)
        if self._kick is not None:
            self._kick.set()
        return record.object()

    def endpoints(self) -> list[str]:
        """The endpoints a batch may run: /v1/embeddings only where the frontend serves it."""
        return [e for e, kind in ENDPOINTS.items() if kind != EMBEDDINGS or getattr(self.fe, "embeddings", None)]

    async def get(self, tenant: Tenant, batch_id: str) -> dict[str, Any]:
        rec = await self._call("get_batch", tenant.name, batch_id)
        if rec is None:
            raise _batch_not_found(batch_id)
        return rec.object()

    async def list(self, tenant: Tenant, query: Any) -> dict[str, Any]:
        limit = _limit(query.get("limit"), 20, MAX_BATCH_LIST)
        rows = await self._call("list_batches", tenant.name, query.get("after"), limit + 1)
        return _page([r.object() for r in rows], limit)

    async def cancel(self, tenant: Tenant, batch_id: str) -> dict[str, Any]:
        rec = await self._call("get_batch", tenant.name, batch_id)
        if rec is None:
            raise _batch_not_found(batch_id)
        if rec.status in ("validating", "in_progress"):
            batch = {**rec.batch, "cancelling_at": int(time.time())}
            if await self._call("update_batch", tenant.name, batch_id, "cancelling", batch, (rec.status,)):
                if self._kick is not None:
                    self._kick.set()
            rec = await self._call("get_batch", tenant.name, batch_id)
            assert rec is not None
        elif rec.status not in ("cancelling", "cancelled"):
            raise APIError(400, f"Batch '{batch_id}' is {rec.status}; only a validating or in_progress batch can be "
                           "cancelled.", param="batch_id", code="batch_not_cancellable")
        return rec.object()

    # --- the runner ---

    def batch_slots(self) -> int:
        interactive = self.fe.inflight - self.jobs_inflight
        return batch_slots(self.fe.config.batch_max_inflight, interactive)

    def _may_hold_batches(self) -> bool:
        """Whether the store may hold batches: a frontend that has not served the batch API does not
        create an SQLite file just by starting; PostgreSQL, or a file that exists, is polled."""
        return self._store is not None or "://" in self._url or os.path.exists(self._url)

    async def _claim_loop(self) -> None:
        assert self._kick is not None
        warned = False
        while True:
            try:
                store = await self.store() if self._may_hold_batches() else None
                while store is not None and len(self._runs) < _MAX_ACTIVE_BATCHES:
                    rec = await store.claim_batch(self.owner, self.fe.config.batch_lease_s)
                    if rec is None:
                        break
                    log.info("batch %s (%s, %s): run by %s", rec.id, rec.tenant, rec.status, self.owner)
                    task = asyncio.get_running_loop().create_task(self._run_batch(rec))
                    self._runs[rec.id] = task
                    task.add_done_callback(lambda _, bid=rec.id: self._runs.pop(bid, None))
                warned = False
            except (APIError, StoreUnavailable) as err:
                if not warned:
                    log.warning("batch runner: store unavailable, retrying: %s", getattr(err, "message", err))
                    warned = True
            except Exception:
                log.exception("batch runner: claiming failed")
            self._kick.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), _CLAIM_POLL_S)

    async def _run_batch(self, rec: BatchRecord) -> None:
        run = _Run(rec, self._tenants.get(rec.tenant))
        task = asyncio.current_task()
        watcher = asyncio.ensure_future(self._watch(run, task))
        try:
            await self._drive(run)
        except asyncio.CancelledError:
            if not run.lost:
                raise
            log.warning("batch %s: lease lost; another frontend resumes it", rec.id)
        except APIError as err:  # the store failed: the batch is claimed again once it answers
            log.warning("batch %s paused: %s", rec.id, err.message)
        except Exception:
            log.exception("batch %s failed in its runner; it is resumed after its lease", rec.id)
        finally:
            watcher.cancel()
            for t in list(run.tasks):
                t.cancel()
            if not run.lost:
                with contextlib.suppress(Exception):
                    await self._call("release_batch", rec.id, self.owner)

    async def _watch(self, run: _Run, task: asyncio.Task[Any] | None) -> None:
        """Renews the lease and watches for a cancel; cancels the run when the lease is lost."""
        lease = self.fe.config.batch_lease_s
        renewed = time.monotonic()
        while task is not None:
            await asyncio.sleep(min(_WATCH_S, lease / 4))
            try:
                if time.monotonic() - renewed >= lease / 3:
                    if not await self._call("renew_lease", run.rec.id, self.owner, lease):
                        run.lost = True
                        task.cancel()
                        return
                    renewed = time.monotonic()
                cur = await self._call("get_batch", run.rec.tenant, run.rec.id)
            except APIError:
                continue
            if cur is not None:
                run.rec.batch["expires_at"] = cur.batch.get("expires_at", run.rec.batch.get("expires_at"))
            if cur is not None and cur.status == "cancelling" and not run.cancelling:
                run.cancelling = True
                run.rec.batch = {**run.rec.batch, "cancelling_at": cur.batch.get("cancelling_at")}
                for t in list(run.tasks):
                    t.cancel()

    async def _set(self, run: _Run, status: str, expect: tuple[str, ...], **fields: Any) -> bool:
        batch = {**run.rec.batch, **fields, "status": status}
        if await self._call("update_batch", run.rec.tenant, run.rec.id, status, batch, expect):
            run.rec.batch, run.rec.status = batch, status
            return True
        cur = await self._call("get_batch", run.rec.tenant, run.rec.id)
        if cur is not None:
            run.rec.status = cur.status
            if cur.status == "cancelling":
                run.cancelling = True
                run.rec.batch = {**run.rec.batch, "cancelling_at": cur.batch.get("cancelling_at")}
        return False

    async def _drive(self, run: _Run) -> None:
        rec = run.rec
        lines = await self._validate(run)
        if lines is None:
            return
        if rec.status == "validating":
            await self._set(run, "in_progress", ("validating",), in_progress_at=int(time.time()),
                            request_counts={"total": len(lines), "completed": 0, "failed": 0},
                            model=lines[0].body.get("model") if lines else None)
        if rec.status == "in_progress":
            await self._run_lines(run, lines)
            if run.cancelling:
                rec.status = "cancelling"
            elif run.expired:
                await self._finish(run, lines, "expired", ("in_progress",), "batch_expired",
                                   "This request could not be executed before the completion window expired.",
                                   expired_at=int(time.time()))
                return
            elif not await self._set(run, "finalizing", ("in_progress",), finalizing_at=int(time.time())):
                if rec.status != "cancelling":
                    return
        if rec.status == "finalizing":
            await self._finish(run, lines, "completed", ("finalizing",), None, None, completed_at=int(time.time()))
        elif rec.status == "cancelling":
            await self._finish(run, lines, "cancelled", ("cancelling",), "batch_cancelled",
                               "This request was not executed: the batch was cancelled.",
                               cancelled_at=int(time.time()))

    async def _validate(self, run: _Run) -> list[Line] | None:
        """The input file's lines; fails the batch (returns None) when the file is invalid."""
        rec = run.rec
        data = await self._file_bytes(rec.tenant, rec.batch["input_file_id"])
        errors: list[dict[str, Any]]
        if run.tenant is None:
            errors = [_line_error("invalid_api_key", f"Tenant {rec.tenant!r} no longer exists.", None)]
            lines: list[Line] = []
        elif data is None:
            errors = [_line_error("file_not_found", f"The input file {rec.batch['input_file_id']} was deleted.", None,
                                  "input_file_id")]
            lines = []
        else:
            lines, errors = parse_input(data, rec.batch["endpoint"], self._check_model(run.tenant))
        if not errors:
            return lines
        if rec.status in ("validating", "in_progress"):
            await self._set(run, "failed", (rec.status,), failed_at=int(time.time()),
                            errors={"object": "list", "data": errors[:MAX_REPORTED_ERRORS]})
        if rec.status == "cancelling":
            await self._set(run, "cancelled", ("cancelling",), cancelled_at=int(time.time()))
        return None

    def _check_model(self, tenant: Tenant) -> Callable[[str], str | None]:
        catalog = self.fe.catalog

        def check(name: str) -> str | None:
            try:
                model = catalog.resolve(name)
            except APIError as err:
                return err.message
            if not tenant.may_use(*catalog.names_of(model)):
                return f"The model `{name}` does not exist or you do not have access to it."
            return None

        return check

    async def _run_lines(self, run: _Run, lines: list[Line]) -> None:
        """Runs every line not recorded yet until all are, or the batch is cancelled or expired."""
        while not run.stopped:
            try:
                done = await self._call("done_lines", run.rec.id)
            except APIError:
                await asyncio.sleep(1.0)
                continue
            pending = [ln for ln in lines if ln.no not in done]
            if not pending:
                return
            for ln in pending:
                while not run.stopped and self.lines_inflight >= self.batch_slots():
                    await asyncio.sleep(_SLOT_POLL_S)
                if run.stopped:
                    break
                self.lines_inflight += 1
                t = asyncio.get_running_loop().create_task(self._line(run, ln))
                run.tasks.add(t)
                t.add_done_callback(run.tasks.discard)
            if run.tasks:
                await asyncio.gather(*list(run.tasks), return_exceptions=True)

    async def _line(self, run: _Run, line: Line) -> None:
        try:
            try:
                ok, text = await self._execute(run, line)
            except Exception:  # a bug of ours: the line's error, rather than a line run again and again
                log.exception("batch %s line %d failed", run.rec.id, line.no)
                err = APIError(500, "The server had an error while processing your request.", type=SERVER)
                ok, text = False, _result(line, 500, None, err.to_dict())
            for delay in (*_RETRY_S, None):
                try:
                    if await self._call("record_line", run.rec.id, line.no, line.custom_id, ok, text):
                        self._line_outcome[ok].inc()
                    return
                except APIError:
                    if delay is None:
                        log.error("batch %s line %d: result not recorded; it runs again", run.rec.id, line.no)
                        return
                    await asyncio.sleep(delay)
        finally:
            self.lines_inflight -= 1

    async def _execute(self, run: _Run, line: Line) -> tuple[bool, str]:
        """Runs one line; (ok, its output or error line)."""
        assert run.tenant is not None
        kind = ENDPOINTS[run.rec.batch["endpoint"]]
        body = dict(line.body)
        problem = _line_problem(kind, body)
        if problem is not None:
            return False, _result(line, problem.status, None, problem.to_dict())
        prio = body.get("priority")
        if kind != EMBEDDINGS and not (isinstance(prio, int) and not isinstance(prio, bool) and prio >= BATCH_PRIORITY):
            body["priority"] = BATCH_PRIORITY
        raw = orjson.dumps(body)
        attempt = 0
        while True:
            try:
                request_id, out = await self._request(kind, run.tenant, raw)
                return True, _result(line, 200, request_id, orjson.loads(out))
            except _Retry:
                if run.stopped:
                    raise asyncio.CancelledError from None
                await asyncio.sleep(_RETRY_S[min(attempt, len(_RETRY_S) - 1)])
                attempt += 1
            except APIError as err:
                return False, _result(line, err.status, None, err.to_dict())

    async def _request(self, kind: str, tenant: Tenant, raw: bytes) -> tuple[str, bytes]:
        """Admits and runs one request in-process; raises _Retry when it was refused for now, APIError
        when it was refused or failed."""
        fe = self.fe
        if kind == EMBEDDINGS:  # no job: the service admits, runs and accounts it itself
            try:
                obj = await fe.embeddings.handle(tenant, raw, {})
            except APIError as err:
                if _retryable(err):
                    raise _Retry from None
                raise
            return "embd-" + uuid.uuid4().hex, orjson.dumps(obj)
        try:
            if kind == RESPONSES:
                rjob = await fe.responses.admit(tenant, raw, {}, None)
                job = rjob.job
            else:
                rjob, job = None, await fe.admit(kind, tenant, raw, {})
        except APIError as err:
            if _retryable(err):
                raise _Retry from None
            fe.reject(kind, tenant.name, err, None)
            raise
        self.jobs_inflight += 1
        try:
            if rjob is not None:
                return job.id, await fe.responses.collect(rjob)
            firsts = await fe.open(job)
            return job.id, await fe.collect(job, firsts)
        except APIError as err:
            job.error = err
            raise
        except asyncio.CancelledError:
            job.disconnected = True
            raise
        except Exception:
            log.exception("batch request %s failed", job.id)
            err = APIError(500, "The server had an error while processing your request.", type=SERVER)
            job.error = err
            raise err from None
        finally:
            fe.end(job)
            self.jobs_inflight -= 1

    async def _finish(self, run: _Run, lines: list[Line], status: str, expect: tuple[str, ...],
                      not_run_code: str | None, not_run_message: str | None, **fields: Any) -> None:
        """Writes the output and error files, then sets the final status."""
        rec = run.rec
        ok = await self._call("line_texts", rec.id, True)
        failed = await self._call("line_texts", rec.id, False)
        if not_run_code is not None:
            done = await self._call("done_lines", rec.id)
            failed += [_result(ln, None, None, None, {"code": not_run_code, "message": not_run_message})
                       for ln in lines if ln.no not in done]
        now = time.time()
        ids: dict[str, Any] = {"output_file_id": None, "error_file_id": None}
        for which, texts in (("output", ok), ("error", failed)):
            if not texts:
                continue
            fid = _derived_file_id(rec.id, which)
            content = ("\n".join(texts) + "\n").encode()
            with tempfile.SpooledTemporaryFile(max_size=8 << 20) as tmp:
                tmp.write(content)
                tmp.seek(0)
                await self._call("put_file", FileRecord(fid, rec.tenant, "batch_output", f"{rec.id}_{which}.jsonl",
                                                        len(content), now), tmp)
            ids[f"{which}_file_id"] = fid
        if await self._set(run, status, expect, **ids, **fields):
            log.info("batch %s: %s (%d ok, %d failed)", rec.id, status, len(ok), len(failed))
        elif rec.status == "cancelling" and status != "cancelled":
            await self._finish(run, lines, "cancelled", ("cancelling",), "batch_cancelled",
                               "This request was not executed: the batch was cancelled.", cancelled_at=int(time.time()))


# ---------------------------------------------------------------------------------------------- helpers


def parse_input(data: bytes, endpoint: str, check_model: Callable[[str], str | None]) -> tuple[list[Line], list[dict[str, Any]]]:
    """A batch input file's lines and its problems (OpenAI's codes; `line` 1-based)."""
    lines: list[Line] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    model: str | None = None
    checked: dict[str, str | None] = {}
    for no, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            errors.append(_line_error("invalid_json_line", "This line is not parseable as valid JSON.", no))
            continue
        if not isinstance(obj, dict):
            errors.append(_line_error("invalid_json_line", "This line is not a JSON object.", no))
            continue
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            errors.append(_line_error("missing_required_parameter", "The request is missing a 'custom_id' string.",
                                      no, "custom_id"))
            continue
        if custom_id in seen:
            errors.append(_line_error("duplicate_custom_id", f"The custom_id {custom_id[:64]!r} is used by another "
                                      "request of this batch; each custom_id must be unique.", no, "custom_id"))
            continue
        seen.add(custom_id)
        if obj.get("method") != "POST":
            errors.append(_line_error("invalid_method", "The method of every request must be 'POST'.", no, "method"))
            continue
        if obj.get("url") != endpoint:
            errors.append(_line_error("invalid_url", f"The url {str(obj.get('url'))[:80]!r} does not match the batch's "
                                      f"endpoint {endpoint!r}.", no, "url"))
            continue
        body = obj.get("body")
        if not isinstance(body, dict):
            errors.append(_line_error("invalid_request", "The request's 'body' must be a JSON object.", no, "body"))
            continue
        name = body.get("model")
        if not isinstance(name, str) or not name:
            errors.append(_line_error("missing_required_parameter", "The request body is missing a 'model' string.",
                                      no, "body.model"))
            continue
        if name not in checked:
            checked[name] = check_model(name)
        if checked[name] is not None:
            errors.append(_line_error("model_not_found", str(checked[name]), no, "body.model"))
            continue
        if model is None:
            model = name
        elif name != model:
            errors.append(_line_error("mismatched_model", f"The model {name[:80]!r} differs from the model of the "
                                      f"batch's other requests ({model[:80]!r}); a batch uses one model.", no,
                                      "body.model"))
            continue
        lines.append(Line(no, custom_id, body))
    if not lines and not errors:
        errors.append(_line_error("empty_file", "The input file has no requests.", None))
    if len(lines) > MAX_BATCH_LINES:
        errors.append(_line_error("too_many_tasks", f"The input file has {len(lines)} requests; a batch has at most "
                                  f"{MAX_BATCH_LINES}.", None))
    return lines, errors


def _line_problem(kind: str, body: dict[str, Any]) -> APIError | None:
    if body.get("stream"):
        return invalid_value("stream", "streaming is not supported in a batch request.")
    if kind == RESPONSES and body.get("background"):
        return invalid_value("background", "background responses are not supported in a batch request.")
    return None


def _retryable(err: APIError) -> bool:
    if err.status == 503:  # overloaded, no route, a store the request needs is down: all pass
        return True
    return err.status == 429 and err.headers.get("x-should-retry") != "false"


def _result(line: Line, status: int | None, request_id: str | None, body: Any,
            error: dict[str, Any] | None = None) -> str:
    response = None if status is None else {"status_code": status, "request_id": request_id, "body": body}
    return orjson.dumps({"id": "batch_req_" + uuid.uuid4().hex, "custom_id": line.custom_id, "response": response,
                         "error": error}).decode()


def too_large(limit: int) -> APIError:
    return APIError(413, f"The file exceeds the upload limit of {limit} bytes.", param="file", code="file_too_large")


def _limit(raw: str | None, default: int, most: int) -> int:
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise invalid_value("limit", f"{raw[:20]!r} is not an integer between 1 and {most}.")
    return int(raw)


def _page(data: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    page = data[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(data) > limit}


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_type("metadata", "an object", value)
    if len(value) > 16:
        raise invalid_value("metadata", f"{len(value)} keys; at most 16.")
    for k, v in value.items():
        if len(k) > 64:
            raise invalid_value("metadata", f"key {k[:20]!r}... is longer than 64 characters.")
        if not isinstance(v, str):
            raise invalid_type(f"metadata.{k[:64]}", "a string", v)
        if len(v) > 512:
            raise invalid_value(f"metadata.{k[:64]}", "longer than 512 characters.")
    return dict(value)
