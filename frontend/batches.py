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

Spare capacity (`frontend.spare_capacity`): with no interactive request here, `--batch-max-inflight`
lines run at once; beside interactive traffic, a cap learned from the interactive requests' own TTFT
and token gaps (against theirs while no batch line ran) keeps their medians within
`--batch-latency-budget`.
Lines already running finish; only new ones wait. Waiting lines are re-checked every `_SLOT_POLL_S`.

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
from pdserve.frontend.job import CHAT, COMPLETION, RESPONSES, Job
from pdserve.frontend.metrics import POOL
from pdserve.frontend.protocol import PRIORITY_CLASSES
from pdserve.frontend.response_store import LazyStore, purge_every
from pdserve.frontend.spare_capacity import SpareCapacity
from pdserve.frontend.tenants import Tenant

if TYPE_CHECKING:
    from pdserve.frontend.accounting import Latencies
    from pdserve.frontend.pipeline import Frontend

log = logging.getLogger(__name__)

EMBEDDINGS = "embeddings"
# /v1/embeddings runs through `Frontend.embeddings` (frontend.embeddings) where the frontend has it.
ENDPOINTS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/v1/responses": RESPONSES,
             "/v1/embeddings": EMBEDDINGS}
UNSUPPORTED_ENDPOINTS = ("/v1/moderations",)
OPENAI_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
COMPLETION_WINDOW_S = 24 * 3600.0
BATCH_FILE_TTL_S = 30 * 24 * 3600  # OpenAI's default for files of purpose batch (others are kept)
EXPIRES_AFTER_S = (3600, 30 * 24 * 3600)  # the seconds an expires_after policy may give
_PURGE_EVERY_S = 60.0
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
        self._store: LazyStore[BatchStore] = LazyStore(
            lambda: open_batch_store(self._url),  # once open, expired files are purged in the background
            lambda store: self.fe.spawn(purge_every(_PURGE_EVERY_S, store.purge_expired_files, "expired files")))
        self.owner = f"{frontend.config.frontend_id}-{uuid.uuid4().hex[:8]}"
        self._runs: dict[str, asyncio.Task[None]] = {}
        self._kick: asyncio.Event | None = None
        self.lines_inflight = 0  # batch lines started here and not finished (admission included)
        self.jobs_inflight = 0   # of those, admitted jobs (they count in Frontend.inflight)
        self._job_ids: set[str] = set()  # their ids
        self.spare = SpareCapacity(frontend.config.batch_max_inflight, frontend.config.batch_latency_budget)
        frontend.accounting.observers.append(self._observe)
        m, labels = frontend.metrics, (POOL, frontend.metrics.node)
        Gauge("pdserve_frontend_batch_lines_in_flight", "Batch lines this frontend is running now", ["pool", "node"],
              registry=m.registry).labels(*labels).set_function(lambda: self.lines_inflight)
        Gauge("pdserve_frontend_batch_slots", "Batch lines this frontend may run at once now: --batch-max-inflight "
              "with no interactive request here, else the learned cap", ["pool", "node"],
              registry=m.registry).labels(*labels).set_function(self.batch_slots)
        Gauge("pdserve_frontend_batch_interference_ratio", "Interactive median TTFT or token gap (the larger) beside "
              "batch lines against without, at the spare-capacity rule's last decision (0: none yet)",
              ["pool", "node"], registry=m.registry).labels(*labels).set_function(
                  lambda: self.spare.last_ratio or 0.0)
        self._lines_total = Counter("pdserve_frontend_batch_lines_total", "Batch lines run to an end, by outcome "
                                    "(ok: in the output file, failed: in the error file)", ["pool", "node", "outcome"],
                                    registry=m.registry)
        self._line_outcome = {ok: self._lines_total.labels(*labels, "ok" if ok else "failed") for ok in (True, False)}

    # --- the store ---

    async def store(self) -> BatchStore:
        try:
            return await self._store.get()
        except StoreUnavailable as err:
            raise _unavailable(err) from None

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
        await self._store.close()

    # --- files ---

    async def upload(self, tenant: Tenant, purpose: object, filename: str | None, source: IO[bytes],
                     size: int, expires_after: Any = None) -> dict[str, Any]:
        """Stores an uploaded file (`source`, `size` bytes, read from its start) as a file of `tenant`;
        it expires `expires_after` (OpenAI's policy) or BATCH_FILE_TTL_S after now."""
        if purpose is None:
            raise missing_parameter("purpose")
        if purpose != "batch":
            known = " (a purpose of OpenAI's that this server does not serve)" if purpose in OPENAI_PURPOSES else ""
            raise invalid_value("purpose", f"{str(purpose)[:40]!r}{known}: this server accepts only 'batch' (input "
                                "files of /v1/batches), not " + ", ".join(
                                    repr(p) for p in OPENAI_PURPOSES if p != "batch") + ".")
        if size > self.fe.config.max_file_bytes:
            raise too_large(self.fe.config.max_file_bytes)
        ttl = _expires_after(expires_after, "expires_after")
        now = time.time()
        record = FileRecord(_new_file_id(), tenant.name, "batch", safe_filename(filename), size, now,
                            now + (BATCH_FILE_TTL_S if ttl is None else ttl))
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

    async def _read_file(self, tenant: str, file_id: str, feed: Callable[[bytes], None]) -> bool:
        """Feeds a file's chunks in order; False when there is no such file."""
        if await self._call("get_file", tenant, file_id) is None:
            return False
        seq = 0
        while (chunk := await self._call("read_chunk", tenant, file_id, seq)) is not None:
            feed(chunk)
            seq += 1
            await asyncio.sleep(0)  # a long file does not hold up the frontend's other requests
        return True

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
        output_ttl = _expires_after(obj.get("output_expires_after"), "output_expires_after")
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
                 "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
                 "_output_ttl_s": output_ttl}
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
        return self.spare.slots(self.fe.inflight - self.jobs_inflight)

    def watch(self, job: Job) -> None:
        """`Frontend.open`: an interactive job's token gaps are the spare-capacity rule's samples."""
        if job.id not in self._job_ids:
            for c in job.choices:
                c.progress.on_gap = self.spare.observe_gap

    def _observe(self, job: Job, lat: Latencies) -> None:
        """`Accounting.observers`: an interactive job's TTFT is a sample of the spare-capacity rule."""
        if job.id not in self._job_ids and lat.status == 200:
            self.spare.observe(job.arrived, lat.ttft)

    def _may_hold_batches(self) -> bool:
        """Whether the store may hold batches: a frontend that has not served the batch API does not
        create an SQLite file just by starting; PostgreSQL, or a file that exists, is polled."""
        return self._store.opened is not None or "://" in self._url or os.path.exists(self._url)

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
        run = _Run(rec, self.fe.tenants.by_name(rec.tenant))  # the table in force (it may be reloaded)
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
        errors: list[dict[str, Any]]
        lines: list[Line] = []
        if run.tenant is None:
            errors = [_line_error("invalid_api_key", f"Tenant {rec.tenant!r} no longer exists.", None)]
        else:
            parser = InputParser(rec.batch["endpoint"], self._check_model(run.tenant), self.fe.config.max_body_bytes)
            if await self._read_file(rec.tenant, rec.batch["input_file_id"], parser.feed):
                lines, errors = parser.finish()
            else:
                errors = [_line_error("file_not_found", f"The input file {rec.batch['input_file_id']} was deleted.",
                                      None, "input_file_id")]
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
                self.spare.line_started()
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
            self.spare.line_ended()

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
                obj = await fe.embeddings.handle(tenant, raw, {}, batch=True)
            except APIError as err:
                if _retryable(err):
                    raise _Retry from None
                raise
            return "embd-" + uuid.uuid4().hex, orjson.dumps(obj)
        try:
            if kind == RESPONSES:
                rjob = await fe.responses.admit(tenant, raw, {}, None, batch=True)
                job = rjob.job
            else:
                rjob, job = None, await fe.admit(kind, tenant, raw, {}, batch=True)
        except APIError as err:
            if _retryable(err):
                raise _Retry from None
            fe.reject(kind, tenant.name, err, None)
            raise
        self.jobs_inflight += 1
        self._job_ids.add(job.id)
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
            self._job_ids.discard(job.id)

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
                ttl = rec.batch.get("_output_ttl_s")
                await self._call("put_file", FileRecord(fid, rec.tenant, "batch_output", f"{rec.id}_{which}.jsonl",
                                                        len(content), now, None if ttl is None else now + ttl), tmp)
            ids[f"{which}_file_id"] = fid
        if await self._set(run, status, expect, **ids, **fields, usage=batch_usage(ok)):
            log.info("batch %s: %s (%d ok, %d failed)", rec.id, status, len(ok), len(failed))
        elif rec.status == "cancelling" and status != "cancelled":
            await self._finish(run, lines, "cancelled", ("cancelling",), "batch_cancelled",
                               "This request was not executed: the batch was cancelled.", cancelled_at=int(time.time()))


# ---------------------------------------------------------------------------------------------- helpers


class InputParser:
    """Checks a batch input file as it is read, chunk by chunk (OpenAI's codes; `line` 1-based). Memory
    stays bounded by the lines kept: a line over `max_line_bytes` is skipped unparsed (a `line_too_large`
    error), past `MAX_BATCH_LINES` requests lines are only counted, and at most `MAX_REPORTED_ERRORS`
    problems are kept."""

    def __init__(self, endpoint: str, check_model: Callable[[str], str | None], max_line_bytes: int) -> None:
        self.endpoint, self.check_model, self.max_line_bytes = endpoint, check_model, max_line_bytes
        self.lines: list[Line] = []
        self.errors: list[dict[str, Any]] = []
        self._partial = bytearray()  # the line read so far
        self._no = 1                 # its number
        self._skipping = False       # it is over max_line_bytes: dropped up to its newline
        self._counted = 0            # lines past MAX_BATCH_LINES requests (counted, not parsed)
        self._seen: set[str] = set()
        self._model: str | None = None
        self._checked: dict[str, str | None] = {}

    def feed(self, chunk: bytes) -> None:
        pos = 0
        while pos < len(chunk):
            nl = chunk.find(b"\n", pos)
            end = len(chunk) if nl < 0 else nl
            if self._counted:
                self._counted += chunk.count(b"\n", pos)
                return
            if not self._skipping:
                if len(self._partial) + end - pos > self.max_line_bytes:
                    self._error("line_too_large", f"This line is over {self.max_line_bytes} bytes, the largest "
                                "request body this server accepts.", self._no)
                    self._partial.clear()
                    self._skipping = True
                else:
                    self._partial += chunk[pos:end]
            if nl < 0:
                return
            self._end_line()
            pos = nl + 1

    def finish(self) -> tuple[list[Line], list[dict[str, Any]]]:
        if self._partial or self._skipping:
            self._end_line()
        if self._counted:
            self._error("too_many_tasks", f"The input file has more than {MAX_BATCH_LINES} requests (about "
                        f"{MAX_BATCH_LINES + self._counted} lines); a batch has at most {MAX_BATCH_LINES}.", None)
        elif not self.lines and not self.errors:
            self._error("empty_file", "The input file has no requests.", None)
        return self.lines, self.errors

    def _end_line(self) -> None:
        raw, no = bytes(self._partial), self._no
        self._partial.clear()
        self._no += 1
        if self._skipping:
            self._skipping = False
        elif raw.strip():
            self._line(raw, no)
            if len(self.lines) > MAX_BATCH_LINES:
                self._counted = 1

    def _error(self, code: str, message: str, line: int | None, param: str | None = None) -> None:
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(_line_error(code, message, line, param))

    def _line(self, raw: bytes, no: int) -> None:
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return self._error("invalid_json_line", "This line is not parseable as valid JSON.", no)
        if not isinstance(obj, dict):
            return self._error("invalid_json_line", "This line is not a JSON object.", no)
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            return self._error("missing_required_parameter", "The request is missing a 'custom_id' string.", no,
                               "custom_id")
        if custom_id in self._seen:
            return self._error("duplicate_custom_id", f"The custom_id {custom_id[:64]!r} is used by another request "
                               "of this batch; each custom_id must be unique.", no, "custom_id")
        self._seen.add(custom_id)
        if obj.get("method") != "POST":
            return self._error("invalid_method", "The method of every request must be 'POST'.", no, "method")
        if obj.get("url") != self.endpoint:
            return self._error("invalid_url", f"The url {str(obj.get('url'))[:80]!r} does not match the batch's "
                               f"endpoint {self.endpoint!r}.", no, "url")
        body = obj.get("body")
        if not isinstance(body, dict):
            return self._error("invalid_request", "The request's 'body' must be a JSON object.", no, "body")
        name = body.get("model")
        if not isinstance(name, str) or not name:
            return self._error("missing_required_parameter", "The request body is missing a 'model' string.", no,
                               "body.model")
        if name not in self._checked:
            self._checked[name] = self.check_model(name)
        if (problem := self._checked[name]) is not None:
            return self._error("model_not_found", problem, no, "body.model")
        if self._model is None:
            self._model = name
        elif name != self._model:
            return self._error("mismatched_model", f"The model {name[:80]!r} differs from the model of the batch's "
                               f"other requests ({self._model[:80]!r}); a batch uses one model.", no, "body.model")
        self.lines.append(Line(no, custom_id, body))


def parse_input(data: bytes, endpoint: str, check_model: Callable[[str], str | None],
                max_line_bytes: int = 4 << 20) -> tuple[list[Line], list[dict[str, Any]]]:
    """A whole batch input file's lines and its problems (`InputParser` in one go)."""
    parser = InputParser(endpoint, check_model, max_line_bytes)
    parser.feed(data)
    return parser.finish()


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


def batch_usage(ok_lines: list[str]) -> dict[str, Any]:
    """The Batch object's `usage`: the sum over its output lines of their bodies' usage (chat and
    completions: prompt/completion tokens; responses: input/output tokens; embeddings: prompt tokens)."""
    inp = out = cached = reasoning = 0
    for text in ok_lines:
        u = (orjson.loads(text).get("response") or {}).get("body", {}).get("usage") or {}
        inp += int(u.get("prompt_tokens", u.get("input_tokens", 0)) or 0)
        out += int(u.get("completion_tokens", u.get("output_tokens", 0)) or 0)
        cached += int((u.get("prompt_tokens_details") or u.get("input_tokens_details") or {}).get("cached_tokens")
                      or 0)
        reasoning += int((u.get("completion_tokens_details") or u.get("output_tokens_details") or {})
                         .get("reasoning_tokens") or 0)
    return {"input_tokens": inp, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": inp + out}


def _expires_after(value: Any, param: str) -> int | None:
    """OpenAI's expiration policy (`{"anchor": "created_at", "seconds": N}`, N in EXPIRES_AFTER_S; from a
    form, both strings) as seconds after the file is made; None when not given."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid_type(param, "an object with 'anchor' and 'seconds'", value)
    if value.get("anchor") != "created_at":
        raise invalid_value(f"{param}.anchor", f"{str(value.get('anchor'))[:40]!r}; the supported anchor is "
                            "'created_at'.")
    raw = value.get("seconds")
    seconds = int(raw) if isinstance(raw, str) and raw.isdigit() else raw
    lo, hi = EXPIRES_AFTER_S
    if not isinstance(seconds, int) or isinstance(seconds, bool) or not lo <= seconds <= hi:
        raise invalid_value(f"{param}.seconds", f"{str(raw)[:40]!r}; it must be an integer from {lo} (1 hour) to "
                            f"{hi} (30 days).")
    return seconds


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
