"""The Responses API over a `Frontend`: admission with the stored conversation, the streamed and whole
responses, background runs, and the stored responses' routes.

A request with `previous_response_id` continues the stored response's conversation: its `context` (the
chat messages so far, input and output) goes in front of the new input, so the prompt shares its prefix
with the previous turn's and the prefix cache serves it. A stored record holds the whole conversation,
so continuing never walks a chain of ids (and no chain can loop).

Every call that needs the store (storing, continuing, reading, deleting, cancelling) answers 503 while
it is unavailable; chat completions never touch it. Background responses run in a task of the frontend
that admitted them; a cancel from any frontend sets the record's status (compare-and-set), which the
running task sees within `_CANCEL_POLL_S` and stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from pdserve.frontend.errors import NOT_FOUND, SERVER, APIError, invalid_value
from pdserve.frontend.job import RESPONSES, Job, UpstreamError, usage
from pdserve.frontend.output import choice_outputs
from pdserve.frontend.response_store import (
    LazyStore,
    ResponseStore,
    StoredResponse,
    StoreUnavailable,
    open_store,
    purge_every,
)
from pdserve.frontend.responses import REASONING_EFFORTS, ResponsesRequest, parse_responses_request
from pdserve.frontend.responses_output import ResponseOutput, response_usage, sse
from pdserve.frontend.tenants import Tenant

if TYPE_CHECKING:
    from pdserve.frontend.pipeline import Frontend
    from pdserve.frontend.tracing import RequestTrace

log = logging.getLogger(__name__)

T = TypeVar("T")

_CANCEL_POLL_S = 0.5
_PURGE_EVERY_S = 60.0
_ACTIVE = ("queued", "in_progress")
MAX_LIST_LIMIT = 100


@dataclass(eq=False)
class ResponseJob:
    """An admitted /v1/responses request: the chat job it runs as and what its Response object needs."""

    job: Job
    rreq: ResponsesRequest
    created_at: float  # unix seconds

    def output(self, stream: bool) -> ResponseOutput:
        return ResponseOutput(self.job.id, self.created_at, self.job.model.name, self.rreq, stream)


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", type=NOT_FOUND, param=param,
                    code="response_not_found")


def _unavailable(err: StoreUnavailable) -> APIError:
    return APIError(503, f"The response store is unavailable, so stored responses cannot be created, read or "
                    f"continued now ({err}); chat completions are not affected. Retry shortly, or send store: false.",
                    type=SERVER, code="store_unavailable", headers={"retry-after": "1"})


def _final_status(job: Job) -> tuple[str, str | None]:
    reason = job.choices[0].progress.finish_reason
    return ("incomplete", "max_output_tokens") if reason == "length" else ("completed", None)


class ResponsesService:
    """/v1/responses for one frontend (owns the store connection and the background tasks)."""

    def __init__(self, frontend: Frontend) -> None:
        self.fe = frontend
        self._url = frontend.config.response_store
        self._store: LazyStore[ResponseStore] = LazyStore(
            lambda: open_store(self._url),  # once open, expired responses are purged in the background
            lambda store: self.fe.spawn(purge_every(_PURGE_EVERY_S, store.purge_expired, "expired responses")))
        self._running: dict[str, asyncio.Task[None]] = {}  # background responses run here, by id

    # --- the store ---

    async def store(self) -> ResponseStore:
        """The store, opened on first use (a frontend that serves no stored response never opens it).
        503 APIError while it cannot be reached."""
        try:
            return await self._store.get()
        except StoreUnavailable as err:
            raise _unavailable(err) from None

    async def _use(self, op: Callable[[ResponseStore], Awaitable[T]]) -> T:
        """`op(store)`, a 503 APIError while the store is unavailable."""
        store = await self.store()
        try:
            return await op(store)
        except StoreUnavailable as err:
            raise _unavailable(err) from None

    async def close(self) -> None:
        for task in list(self._running.values()):
            task.cancel()
        await self._store.close()

    def _record(self, rjob: ResponseJob, status: str, response: dict[str, Any],
                context: list[dict[str, Any]]) -> StoredResponse:
        job = rjob.job
        return StoredResponse(id=job.id, tenant=job.tenant.name, created_at=rjob.created_at,
                              expires_at=rjob.created_at + self.fe.config.response_ttl_s, status=status,
                              response=response, input_items=rjob.rreq.input_items, context=context,
                              previous_response_id=rjob.rreq.previous_response_id)

    async def _save(self, rjob: ResponseJob, out: ResponseOutput) -> None:
        """Stores a finished response (when asked): it can be read and continued from now on."""
        if not rjob.rreq.store:
            return
        gen = rjob.job.req
        assert gen.messages is not None
        head = 1 if rjob.rreq.instructions is not None else 0  # instructions are not carried to the next turn
        record = self._record(rjob, out.final["status"], out.final, [*gen.messages[head:], *out.context()])
        try:
            await self._use(lambda s: s.put(record))
        except APIError as err:
            log.error("response %s was served but not stored: %s", rjob.job.id, err.message)

    # --- admission ---

    async def admit(self, tenant: Tenant, body: bytes, headers: Mapping[str, str],
                    trace: RequestTrace | None, batch: bool = False) -> ResponseJob:
        """Validates a body, puts the stored conversation in front of it and admits it as a chat job.
        Raises APIError (4xx, 503 when the store is needed and unavailable)."""
        arrived = time.monotonic()
        limits = self.fe.config.request_limits
        rreq = parse_responses_request(body, limits)
        context: list[dict[str, Any]] = []
        if rreq.previous_response_id is not None:
            prev = await self._use(lambda s: s.get(tenant.name, rreq.previous_response_id))
            if prev is None:
                raise APIError(404, f"Previous response with id '{rreq.previous_response_id}' not found.",
                               type=NOT_FOUND, param="previous_response_id", code="previous_response_not_found")
            if prev.status in _ACTIVE:
                raise invalid_value("previous_response_id", f"response '{prev.id}' is still {prev.status}; "
                                    "continue it once it has finished.")
            if prev.status in ("failed", "cancelled"):
                raise invalid_value("previous_response_id", f"response '{prev.id}' was {prev.status}; it has no "
                                    "output to continue from.")
            context = prev.context
        elif rreq.store:  # refuse now rather than serve a response that cannot be stored
            store = await self.store()
            if not await store.ping():
                raise _unavailable(StoreUnavailable(f"{store.description} does not answer"))
        rreq.conversation(context, limits)
        if rreq.reasoning_effort is not None:
            self._reasoning(rreq)
        job = await self.fe.admit_request(RESPONSES, tenant, rreq.generation, headers, trace, arrived, batch)
        return ResponseJob(job, rreq, time.time())

    def _reasoning(self, rreq: ResponsesRequest) -> None:
        """reasoning.effort as the chat template's enable_thinking, for models that think."""
        model = self.fe.catalog.resolve(rreq.generation.model)
        if not getattr(model, "reasoning", None):
            raise APIError(400, f"reasoning.effort is not supported with model `{model.name}`: it is not a reasoning "
                           "model (its chat template has no thinking switch).", param="reasoning.effort",
                           code="unsupported_parameter")
        gen = rreq.generation
        kwargs = dict(getattr(gen, "template_kwargs", None) or {})
        kwargs["enable_thinking"] = REASONING_EFFORTS[rreq.reasoning_effort or "medium"]
        gen.template_kwargs = kwargs  # type: ignore[attr-defined]

    # --- running ---

    async def _generate(self, rjob: ResponseJob, out: ResponseOutput, save: bool = True) -> AsyncIterator[bytes]:
        """The response's events from its first token to its last (none when not streamed); stores it
        (`save`) before the last event goes out, so a client that reads it back at once finds it."""
        job = rjob.job
        firsts = await self.fe.open(job)
        pending = out.start()
        output = choice_outputs(job)[0]
        try:
            async for _, msg in self.fe.calls.messages(job, firsts):
                pending += out.take(output.take(msg))
                if pending:
                    yield b"".join(pending)
                    pending = []
        except UpstreamError as err:
            job.error = err.error
            log.warning("response %s failed mid-stream: %s", job.id, err.error.message)
            error = {"code": "server_error", "message": job.traced(err.error).to_dict()["error"]["message"]}
            last = out.finish("failed", None, error=error)
        else:
            status, incomplete = _final_status(job)
            last = out.finish(status, response_usage(usage(job)), incomplete=incomplete, dropped=job.dropped)
        if save:
            await self._save(rjob, out)
        yield b"".join(pending + last)

    async def events(self, rjob: ResponseJob) -> AsyncIterator[bytes]:
        """The SSE events of a streamed response."""
        async for chunk in self._generate(rjob, rjob.output(stream=True)):
            yield chunk

    async def collect(self, rjob: ResponseJob) -> bytes:
        """The Response object of a whole response. Raises APIError when a node failed it before its end."""
        out = rjob.output(stream=False)
        async for _ in self._generate(rjob, out):
            pass
        if rjob.job.error is not None:
            raise rjob.job.error
        return orjson.dumps(out.final)

    # --- background ---

    async def start_background(self, rjob: ResponseJob) -> dict[str, Any]:
        """Stores the response as queued and runs it in a task of this frontend; returns the queued object."""
        out = rjob.output(stream=False)
        queued = out.response("queued")
        await self._use(lambda s: s.put(self._record(rjob, "queued", queued, [])))
        task = asyncio.get_running_loop().create_task(self._run_background(rjob, out))
        self._running[rjob.job.id] = task
        task.add_done_callback(lambda _: self._running.pop(rjob.job.id, None))
        return queued

    async def _run_background(self, rjob: ResponseJob, out: ResponseOutput) -> None:
        job, tenant = rjob.job, rjob.job.tenant.name
        watcher = asyncio.ensure_future(self._watch_cancel(rjob, asyncio.current_task()))
        try:
            if not await self._set(rjob, "in_progress", out.response("in_progress"), ("queued",)):
                return  # cancelled before it started
            try:
                async for _ in self._generate(rjob, out, save=False):
                    pass
            except APIError as err:  # refused before its first token
                job.error = err
                out.finish("failed", None, error={"code": err.code or "server_error", "message": err.message})
            if await self._set(rjob, out.final["status"], out.final, _ACTIVE):
                await self._save(rjob, out)
        except asyncio.CancelledError:
            job.disconnected = True  # counted as a client cancel (499): the cancel route asked for it
        except Exception:
            log.exception("background response %s failed", job.id)
            out.finish("failed", None, error={"code": "server_error", "message": "The server had an error."})
            await self._set(rjob, "failed", out.final, _ACTIVE)
        finally:
            watcher.cancel()
            self.fe.end(job)
            log.debug("background response %s of %s ended", job.id, tenant)

    async def _set(self, rjob: ResponseJob, status: str, response: dict[str, Any], expect: tuple[str, ...]) -> bool:
        try:
            return bool(await self._use(lambda s: s.update_status(rjob.job.tenant.name, rjob.job.id, status, response, expect)))
        except APIError as err:
            log.error("background response %s: status %s not stored: %s", rjob.job.id, status, err.message)
            return False

    async def _watch_cancel(self, rjob: ResponseJob, task: asyncio.Task[Any] | None) -> None:
        """Cancels the run once the record says cancelled (a cancel through another frontend)."""
        while task is not None:
            await asyncio.sleep(_CANCEL_POLL_S)
            try:
                rec = await self._use(lambda s: s.get(rjob.job.tenant.name, rjob.job.id))
            except APIError:
                continue
            if rec is None or rec.status == "cancelled":
                task.cancel()
                return

    # --- stored responses ---

    async def get(self, tenant: Tenant, response_id: str) -> StoredResponse:
        rec = await self._use(lambda s: s.get(tenant.name, response_id))
        if rec is None:
            raise _not_found(response_id)
        return rec

    async def delete(self, tenant: Tenant, response_id: str) -> dict[str, Any]:
        if not await self._use(lambda s: s.delete(tenant.name, response_id)):
            raise _not_found(response_id)
        task = self._running.get(response_id)
        if task is not None:
            task.cancel()
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, tenant: Tenant, response_id: str) -> dict[str, Any]:
        rec = await self.get(tenant, response_id)
        if not rec.response.get("background"):
            raise APIError(400, f"Response '{response_id}' is not a background response; only those can be "
                           "cancelled.", param="response_id", code="invalid_value")
        if rec.status in _ACTIVE:
            cancelled = {**rec.response, "status": "cancelled"}
            if await self._use(lambda s: s.update_status(tenant.name, response_id, "cancelled", cancelled, _ACTIVE)):
                task = self._running.get(response_id)
                if task is not None:
                    task.cancel()
                return cancelled
            rec = await self.get(tenant, response_id)  # it finished meanwhile
        return rec.response

    async def input_items(self, tenant: Tenant, response_id: str, query: Mapping[str, str]) -> dict[str, Any]:
        rec = await self.get(tenant, response_id)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid_value("order", f"{order!r} is not one of 'asc', 'desc'.")
        raw_limit = query.get("limit", "20")
        if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_LIST_LIMIT:
            raise invalid_value("limit", f"{raw_limit[:20]!r} is not an integer between 1 and {MAX_LIST_LIMIT}.")
        items = rec.input_items if order == "asc" else rec.input_items[::-1]
        after = query.get("after")
        if after is not None:
            ids = [i.get("id") for i in items]
            if after not in ids:
                raise invalid_value("after", f"no input item {after[:80]!r} in response '{response_id}'.")
            items = items[ids.index(after) + 1:]
        page = items[:int(raw_limit)]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}


def failure_event(err: APIError) -> bytes:
    """The one event of a response stream that failed after keep-alives started it, before any token."""
    e = err.to_dict()["error"]
    return sse({"type": "error", "code": e["code"], "message": e["message"], "param": e["param"], "sequence_number": 0})


TERMINAL_EVENTS = (b"event: response.completed\n", b"event: response.incomplete\n", b"event: response.failed\n")

