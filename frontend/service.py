"""The frontend's request path, independent of the HTTP framework: admit, tokenize, route, stream, account.

`Frontend.prepare` does everything that can fail before a response starts (auth is done by the caller):
validation, model resolution and fallback, permissions, tokenization and context checks, routing and the
tenant's limits. `Frontend.open` starts one Generate call per choice and waits for each first message, so
a node that cannot take the request is replaced (or answered with a proper status) before any byte is
sent. `stream` / `collect` then produce the SSE events or the JSON body, and `finish` (always called
once) cancels whatever still runs upstream, refunds the unused output budget and writes metrics and the
request log.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc

from frontend.config import FrontendConfig
from frontend.errors import OVERLOADED, SERVER, APIError
from frontend.limits import Admission, TenantLimiter
from frontend.metrics import FrontendMetrics
from frontend.models import ModelCatalog, ServedModel
from frontend.protocol import (
    INT64_MAX,
    SEED_MIN,
    GenerationRequest,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from frontend.render import (
    DONE,
    StreamEncoder,
    chat_logprobs,
    completion_logprobs,
    error_event,
    full_response,
    usage_dict,
)
from frontend.request_log import RequestLog
from frontend.routing import NoRoute, RouteDecision, RouteLease, Router
from frontend.tenants import Tenant, TenantTable
from frontend.upstream import RETRYABLE, UpstreamPool, sampling_message
from protos import pdserve_pb2 as pb
from registry.view import RegistryView, ViewChange

log = logging.getLogger(__name__)

CHAT = "chat"
COMPLETION = "completion"
_DROP_CHANNEL_AFTER_S = 30.0


class UpstreamError(Exception):
    """A node failed a request after it started; carries the APIError to report."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


class ModelChoice(NamedTuple):
    model: ServedModel
    fallback_reason: str  # "" when the requested model serves


class Tokenized(NamedTuple):
    prompts: list[list[int]]  # token ids per prompt
    echo_texts: list[str]  # per prompt: the text `echo` puts in front ("" without echo)


@dataclass(eq=False)
class Choice:
    """One upstream generation, i.e. one choice of the response, and what it produced so far."""

    index: int
    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    params: pb.SamplingParams
    decision: RouteDecision
    lease: RouteLease
    call: Any = None  # the grpc.aio call while it runs
    echo_pending: bool = False  # streamed completions with echo: the prompt text still goes first
    tried: list[str] = field(default_factory=list)  # decode nodes tried, in order
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    text_offset: int = 0  # legacy completions logprobs: offset of the next token in the text
    tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str = ""
    cached_tokens: int = 0
    cached_prefill: int = 0  # of cached_tokens: the prefill node's prefix-cache hit (remote prefill)
    cached_decode: int = 0  # the decode node's own hit
    dispatched_at: float | None = None  # perf_counter when the Generate call went out (TTFT breakdown)
    first_at: float | None = None
    last_at: float | None = None
    itls: list[float] = field(default_factory=list)
    timing: pb.Timing | None = None
    prefill_node: str = ""
    decode_node: str = ""


@dataclass(eq=False)
class Job:
    """One HTTP generation request from admission to its end."""

    kind: str
    id: str
    created: int
    arrived: float  # perf_counter at arrival
    req: GenerationRequest
    tenant: Tenant
    model: ServedModel
    requested_model: str
    prompts: list[list[int]]
    echo_texts: list[str]
    choices: list[Choice]
    admission: Admission
    client_request_id: str | None = None
    session_key: str | None = None
    fallback_reason: str = ""
    prompt_log: Any = None  # what the request log shows of the prompt, when prompt logging is on
    status: int = 200
    error: APIError | None = None
    disconnected: bool = False
    ended: bool = False

    @property
    def fingerprint(self) -> str:
        fp = self.choices[0].decision.fingerprint if self.choices else ""
        return f"fp_{fp[:10]}" if fp else "fp_unknown"

    @property
    def endpoint(self) -> str:
        return "chat.completions" if self.kind == CHAT else "completions"


def client_request_id(headers: Mapping[str, str]) -> str | None:
    value = headers.get("x-request-id")
    return None if value is None else value[:128]  # a client's id goes to the log; keep its lines bounded


def _usage(job: Job) -> dict[str, Any]:
    completion = sum(c.tokens for c in job.choices)
    cached: dict[int, int] = {}
    for c in job.choices:
        cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.cached_tokens)
    return usage_dict(sum(len(p) for p in job.prompts), completion, sum(cached.values()))


def _finish_error(c: Choice, msg: pb.GenerateResponse) -> APIError:
    if msg.finish_reason == "abort":
        return APIError(502, f"decode node {c.decode_node or c.decision.decode_id} aborted the request",
                        type=SERVER, code="upstream_aborted")
    return APIError(502, f"generation failed on decode node {c.decode_node or c.decision.decode_id}: "
                    f"{msg.error or msg.finish_reason}", type=SERVER, code="upstream_error")


def _rpc_error(err: grpc.aio.AioRpcError, node: str, started: bool) -> APIError:
    code = err.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, "The request timed out on the serving node.", type=SERVER, code="timeout")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, f"The serving node rejected the request: {err.details()}", code="invalid_request")
    if not started and code in RETRYABLE:
        return APIError(503, f"No serving node could take the request (last: {node}: {err.details()}).",
                        type=OVERLOADED, code="upstream_unavailable", headers={"retry-after": "1"})
    return APIError(502, f"The serving node {node} failed: {code.name}: {err.details()}", type=SERVER,
                    code="upstream_error")


class Frontend:
    """All state of one frontend process: models, tenants, limits, registry view, router, channels."""

    def __init__(self, config: FrontendConfig) -> None:
        self.config = config
        self.catalog = ModelCatalog(config.models)
        self.tenants = TenantTable.from_file(config.tenants_file) if config.tenants_file else TenantTable.local()
        self.limiter = TenantLimiter(share=config.limit_share)
        self.metrics = FrontendMetrics(config.frontend_id)
        self.request_log = RequestLog(config.request_log)
        self.view = RegistryView(config.etcd_endpoints, config.cluster)
        self.router = Router(
            lambda role, pool: self.view.members(role=role, model=pool),
            load_factor=config.load_factor,
            affinity_blocks=config.affinity_blocks,
            decode_max_queue=config.decode_max_queue,
        )
        self.upstream = UpstreamPool()
        self.inflight = 0
        self._addresses: dict[str, str] = {}
        self._background: set[asyncio.Task[None]] = set()
        unknown = self.tenants.check_models(self.catalog.served_names)
        if unknown:
            log.warning("tenants file allows models that are not served: %s", unknown)

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the registry watch; waits up to registry_sync_timeout_s for the first snapshot."""
        self.view.subscribe(self._on_view_change)
        await self.view.start(sync_timeout_s=None)
        deadline = time.monotonic() + self.config.registry_sync_timeout_s
        while self.view.last_sync is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.view.last_sync is None:
            log.error("no registry snapshot from etcd %s within %.0fs; serving 503 until it arrives",
                      ",".join(self.config.etcd_endpoints), self.config.registry_sync_timeout_s)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self.view.close()
        await self.upstream.close()
        self.request_log.close()

    def _on_view_change(self, change: ViewChange) -> None:
        if change.member is not None and change.member.role == "decode":
            self._addresses[change.node_id] = change.member.record.grpc_address
        elif change.kind == "left" and change.node_id in self._addresses:
            address = self._addresses.pop(change.node_id)
            task = asyncio.get_running_loop().create_task(self._drop_later(address))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _drop_later(self, address: str) -> None:
        # Late: requests still streaming from a node that just left may finish; and a node that comes
        # back at the same address keeps its channel.
        await asyncio.sleep(_DROP_CHANNEL_AFTER_S)
        if address not in self._addresses.values():
            await self.upstream.drop(address)

    # --- auth and readiness ----------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of a request's Authorization header; 401 APIError when it has none."""
        key = None
        if authorization:
            scheme, _, value = authorization.partition(" ")
            key = value.strip() if scheme.lower() == "bearer" else None
        tenant = self.tenants.authenticate(key)
        if tenant is None:
            if not authorization:
                message = ("You didn't provide an API key. You need to provide your API key in an Authorization "
                           "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
            else:
                message = "Incorrect API key provided."
            raise APIError(401, message, param=None, code="invalid_api_key")
        return tenant

    def readiness(self) -> dict[str, Any]:
        models = {}
        for m in self.catalog.models:
            st = self.router.status(m.pool)
            models[m.name] = {"pool": m.pool, "prefill": len(st.prefill), "decode": len(st.decode),
                              "ready": st.ready}
        return {"ready": any(v["ready"] for v in models.values()), "registry_connected": self.view.connected,
                "models": models}

    def list_models(self, tenant: Tenant) -> list[dict[str, Any]]:
        out = []
        for m in self.catalog.models:
            names = self.catalog.names_of(m)
            if tenant.may_use(*names):
                out += [{"id": name, "object": "model", "created": m.created, "owned_by": "pdserve"} for name in names]
        return out

    # --- admission -------------------------------------------------------------------------------

    def prepare(self, kind: str, tenant: Tenant, body: bytes, headers: Mapping[str, str]) -> Job:
        """Validates, tokenizes, routes and admits a request. Raises APIError (4xx/503). On success the
        returned Job holds an admission and route leases, which `finish` releases."""
        arrived = time.perf_counter()
        if self.inflight >= self.config.max_inflight:
            raise APIError(503, "This frontend is at its in-flight request limit; retry shortly.",
                           type=OVERLOADED, code="overloaded", headers={"retry-after": "1"})
        obj = parse_json_body(body)
        req = parse_chat_request(obj) if kind == CHAT else parse_completion_request(obj)
        model = self.catalog.resolve(req.model)
        if not tenant.may_use(*self.catalog.names_of(model)):
            raise APIError(403, f"Tenant {tenant.name!r} may not use model `{req.model}`.", type="permission_error",
                           param="model", code="model_not_allowed")
        try:
            self.limiter.precheck(tenant)
        except APIError as err:
            self._count_rejection(tenant, err)
            raise
        model, fallback_reason = self._pick_model(tenant, model)
        prompts, echo_texts = self._tokenize(req, model)
        per_prompt_max = [self._max_tokens(req, tenant, model, len(p)) for p in prompts]

        session_key = headers.get(self.config.session_header) if self.config.session_header else None
        if not session_key and self.config.user_affinity:
            session_key = req.user
        decisions: list[tuple[int, RouteDecision]] = []
        try:
            for pi, ids in enumerate(prompts):
                for _ in range(req.n):
                    decisions.append((pi, self.router.route(model.pool, ids, per_prompt_max[pi], session_key)))
        except NoRoute as err:
            raise APIError(503, f"Model `{model.name}` cannot take requests now: {err}", type=OVERLOADED,
                           code="overloaded" if err.overloaded else "no_route",
                           headers={"retry-after": "1"}) from None
        reserve = sum(per_prompt_max[pi] for pi, _ in decisions)
        try:
            admission = self.limiter.admit(tenant, sum(len(p) for p in prompts), reserve)
        except APIError as err:
            self._count_rejection(tenant, err)
            raise

        prefix = "chatcmpl-" if kind == CHAT else "cmpl-"
        job_id = prefix + uuid.uuid4().hex
        choices = []
        for i, (pi, decision) in enumerate(decisions):
            k = i % req.n
            seed = req.sampling.seed
            if seed is not None and k:
                seed = (seed + k - SEED_MIN) % (INT64_MAX - SEED_MIN + 1) + SEED_MIN  # distinct, wrapped
            choices.append(Choice(
                index=i, prompt_index=pi, request_id=f"{job_id}-{i}", prompt_ids=prompts[pi],
                max_tokens=per_prompt_max[pi], params=sampling_message(req.sampling, per_prompt_max[pi], seed),
                decision=decision, lease=self.router.lease(decision), echo_pending=req.echo,
            ))
        self.inflight += 1
        self.metrics.inflight_now.inc()
        job = Job(kind=kind, id=job_id, created=int(time.time()), arrived=arrived, req=req, tenant=tenant,
                  model=model, requested_model=req.model, prompts=prompts, echo_texts=echo_texts, choices=choices,
                  admission=admission, client_request_id=client_request_id(headers), session_key=session_key,
                  fallback_reason=fallback_reason)
        if self.config.log_prompts:
            job.prompt_log = req.messages if kind == CHAT else req.prompts
        lbl = self.metrics.labels(model.name)
        for c in choices:
            self.metrics.routes.labels(*lbl, "prefill", c.decision.prefill_rule).inc()
            self.metrics.routes.labels(*lbl, "decode", c.decision.decode_rule).inc()
        return job

    def _count_rejection(self, tenant: Tenant, err: APIError) -> None:
        self.metrics.rejections.labels("frontend", self.config.frontend_id, tenant.name, err.limit or err.code or "").inc()

    def _pick_model(self, tenant: Tenant, model: ServedModel) -> ModelChoice:
        """The requested model, or its fallback when the requested pool has no usable decode node."""
        status = self.router.status(model.pool)
        if status.usable_decode or model.spec.fallback is None:
            return ModelChoice(model, "")
        fallback = self.catalog.get(model.spec.fallback)
        if fallback is None or not tenant.may_use(*self.catalog.names_of(fallback)):
            return ModelChoice(model, "")
        if not self.router.status(fallback.pool).usable_decode:
            return ModelChoice(model, "")
        why = "overloaded" if status.decode else "has no decode node"
        return ModelChoice(fallback, f"pool {model.pool!r} {why}; served by fallback {fallback.name!r}")

    def _tokenize(self, req: GenerationRequest, model: ServedModel) -> Tokenized:
        if req.kind == CHAT:
            assert req.messages is not None
            return Tokenized([model.encode_chat(req.messages)], [""])
        prompts: list[list[int]] = []
        echoes: list[str] = []
        assert req.prompts is not None
        single = len(req.prompts) == 1
        for i, p in enumerate(req.prompts):
            if isinstance(p, str):
                ids = model.encode(p)
                echoes.append(p if req.echo else "")
            else:
                model.check_token_ids(p, "prompt" if single else f"prompt[{i}]")
                ids = list(p)
                echoes.append(model.tokenizer.decode(ids) if req.echo else "")
            if not ids:
                raise APIError(400, "The prompt is empty after tokenization.", param="prompt", code="empty_prompt")
            prompts.append(ids)
        return Tokenized(prompts, echoes)

    def _max_tokens(self, req: GenerationRequest, tenant: Tenant, model: ServedModel, prompt_len: int) -> int:
        """The output budget of one choice; 400 APIError when the request cannot fit the context."""
        limit = model.max_context
        if tenant.limits.max_context_tokens is not None:
            limit = min(limit, tenant.limits.max_context_tokens)
        caps = [c for c in (model.spec.max_output_tokens, tenant.limits.max_output_tokens) if c is not None]
        cap = min(caps) if caps else None
        what = "messages" if req.kind == CHAT else "prompt"
        if prompt_len >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your {what} "
                           f"resulted in {prompt_len} tokens. Please reduce the length of the {what}.",
                           param="messages" if req.kind == CHAT else "prompt", code="context_length_exceeded")
        wanted = req.sampling.max_tokens
        param = req.max_tokens_param
        if wanted is None:
            budget = limit - prompt_len
            if model.spec.default_max_tokens is not None:
                budget = min(budget, model.spec.default_max_tokens)
            return budget if cap is None else min(budget, cap)
        if cap is not None and wanted > cap:
            raise APIError(400, f"{param} is too large: {wanted}. This model supports at most {cap} completion "
                           "tokens per choice for this tenant.", param=param, code="invalid_value")
        if prompt_len + wanted > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{prompt_len + wanted} tokens ({prompt_len} in the {what}, {wanted} in the completion). "
                           f"Please reduce the length of the {what} or completion.", param=param,
                           code="context_length_exceeded")
        return wanted

    # --- upstream --------------------------------------------------------------------------------

    async def open(self, job: Job) -> list[pb.GenerateResponse]:
        """Starts every choice's Generate call and returns each one's first message. Raises APIError."""
        if len(job.choices) == 1:
            return [await self._start(job, job.choices[0])]
        tasks = [asyncio.ensure_future(self._start(job, c)) for c in job.choices]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            raise

    async def _start(self, job: Job, c: Choice) -> pb.GenerateResponse:
        while True:
            d = c.decision
            c.tried.append(d.decode_id)
            request = pb.GenerateRequest(request_id=c.request_id, prompt_token_ids=c.prompt_ids,
                                         params=c.params, prefill_node_id=d.prefill_id, return_text=True)
            c.dispatched_at = time.perf_counter()
            c.call = self.upstream.stub(d.decode_address).Generate(request, timeout=self.config.request_timeout_s)
            try:
                msg = await c.call.read()
            except grpc.aio.AioRpcError as err:
                if err.code() in RETRYABLE:
                    self.router.mark_unavailable(d.decode_id)
                if err.code() in RETRYABLE and len(c.tried) < self.config.upstream_attempts:
                    try:
                        fresh = self.router.route(job.model.pool, c.prompt_ids, c.max_tokens, job.session_key,
                                                  exclude=frozenset(c.tried))
                    except NoRoute:
                        raise _rpc_error(err, d.decode_id, started=False) from None
                    log.warning("request %s: decode node %s unavailable (%s); retrying on %s", c.request_id,
                                d.decode_id, err.details(), fresh.decode_id)
                    c.lease.release()
                    c.decision, c.lease = fresh, self.router.lease(fresh)
                    continue
                raise _rpc_error(err, d.decode_id, started=False) from None
            if msg is grpc.aio.EOF:
                raise APIError(502, f"decode node {d.decode_id} ended the stream without a response", type=SERVER,
                               code="upstream_error")
            if msg.finished and msg.finish_reason not in ("stop", "length"):
                raise _finish_error(c, msg)
            return msg

    @staticmethod
    async def _next(c: Choice) -> pb.GenerateResponse:
        """The choice's next upstream message; UpstreamError when the node fails or ends the stream early."""
        try:
            msg = await c.call.read()
        except grpc.aio.AioRpcError as err:
            raise UpstreamError(_rpc_error(err, c.decision.decode_id, started=True)) from None
        if msg is grpc.aio.EOF:
            raise UpstreamError(APIError(502, f"decode node {c.decision.decode_id} ended the stream early",
                                         type=SERVER, code="upstream_error"))
        return msg

    async def _messages(self, job: Job, firsts: list[pb.GenerateResponse]
                        ) -> AsyncIterator[tuple[Choice, pb.GenerateResponse]]:
        """Every upstream message of the job as it arrives, tagged with its choice."""
        if len(job.choices) == 1:  # the common case, without the queue
            c, msg = job.choices[0], firsts[0]
            while True:
                yield c, msg
                if msg.finished:
                    return
                msg = await self._next(c)
        queue: asyncio.Queue[tuple[Choice, pb.GenerateResponse | UpstreamError]] = asyncio.Queue()

        async def pump(c: Choice, msg: pb.GenerateResponse) -> None:
            while True:
                queue.put_nowait((c, msg))
                if msg.finished:
                    return
                try:
                    msg = await self._next(c)
                except UpstreamError as err:
                    queue.put_nowait((c, err))
                    return

        tasks = [asyncio.ensure_future(pump(c, f)) for c, f in zip(job.choices, firsts, strict=True)]
        remaining = len(tasks)
        try:
            while remaining:
                c, item = await queue.get()
                if isinstance(item, UpstreamError):
                    raise item
                if item.finished:
                    remaining -= 1
                yield c, item
        finally:
            for t in tasks:
                t.cancel()

    @staticmethod
    def _progress(c: Choice, msg: pb.GenerateResponse, now: float) -> None:
        n = len(msg.token_ids)
        if n:
            if c.first_at is None:
                c.first_at = now
                c.lease.prefill_done()
            elif c.last_at is not None:
                c.itls.append(now - c.last_at)
            c.last_at = now
            c.tokens += n
        if c.timing is None and msg.HasField("timing"):
            c.timing = msg.timing
            c.prefill_node, c.decode_node = msg.prefill_node_id, msg.decode_node_id
        if msg.finished:
            if msg.finish_reason not in ("stop", "length"):
                raise UpstreamError(_finish_error(c, msg))
            c.finish_reason = msg.finish_reason
            c.stop_reason = msg.stop_reason
            c.cached_tokens = msg.num_cached_tokens
            c.cached_prefill = msg.num_cached_tokens_prefill
            c.cached_decode = msg.num_cached_tokens_decode
            if msg.num_completion_tokens:
                c.tokens = msg.num_completion_tokens
            if msg.prefill_node_id:
                c.prefill_node = msg.prefill_node_id
            if msg.decode_node_id:
                c.decode_node = msg.decode_node_id

    async def stream(self, job: Job, firsts: list[pb.GenerateResponse]) -> AsyncIterator[bytes]:
        """The SSE events of a streamed job; the first item also carries the chat role chunks."""
        req = job.req
        enc = StreamEncoder(job.kind, job.id, job.created, job.model.name, job.fingerprint, req.include_usage)
        texts = job.model.texts
        top = req.sampling.logprobs
        chat = job.kind == CHAT
        pending: list[bytes] = [enc.role(c.index) for c in job.choices] if chat else []
        try:
            async for c, msg in self._messages(job, firsts):
                self._progress(c, msg, time.perf_counter())
                text = msg.text
                if c.echo_pending:
                    text = job.echo_texts[c.prompt_index] + text
                    c.echo_pending = False
                lp = None
                if top is not None and msg.logprobs:
                    if chat:
                        lp = {"content": chat_logprobs(msg.logprobs, texts, top), "refusal": None}
                    else:
                        lp, c.text_offset = completion_logprobs(msg.logprobs, texts, top, c.text_offset)
                if text or lp is not None:
                    pending.append(enc.text(c.index, text, lp))
                if msg.finished:
                    pending.append(enc.finish(c.index, msg.finish_reason))
                if pending:
                    yield b"".join(pending) if len(pending) > 1 else pending[0]
                    pending = []
        except UpstreamError as err:
            job.error = err.error
            log.warning("request %s failed mid-stream: %s", job.id, err.error.message)
            yield error_event(err.error.to_dict()) + DONE
            return
        if req.include_usage:
            yield enc.usage(_usage(job)) + DONE
        else:
            yield DONE

    async def collect(self, job: Job, firsts: list[pb.GenerateResponse]) -> bytes:
        """The JSON body of a non-streamed job. Raises APIError when a node fails it."""
        try:
            async for c, msg in self._messages(job, firsts):
                self._progress(c, msg, time.perf_counter())
                if msg.text:
                    c.text.append(msg.text)
                if msg.logprobs:
                    c.logprobs.extend(msg.logprobs)
        except UpstreamError as err:
            raise err.error from None
        req = job.req
        top = req.sampling.logprobs
        texts = job.model.texts
        choices: list[dict[str, Any]] = []
        for c in job.choices:
            text = "".join(c.text)
            assert c.finish_reason is not None
            if job.kind == CHAT:
                lp = None if top is None else {"content": chat_logprobs(c.logprobs, texts, top), "refusal": None}
                choices.append({"index": c.index, "message": {"role": "assistant", "content": text, "refusal": None},
                                "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                lp = None if top is None else completion_logprobs(c.logprobs, texts, top, 0).logprobs
                if req.echo:
                    text = job.echo_texts[c.prompt_index] + text
                choices.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
        return full_response(job.kind == CHAT, job.id, job.created, job.model.name, job.fingerprint, choices,
                             _usage(job))

    # --- the end ---------------------------------------------------------------------------------

    def reject(self, kind: str, tenant: str | None, err: APIError, client_id: str | None) -> None:
        """Accounts a request refused before it started (metrics and a request log line)."""
        endpoint = "chat.completions" if kind == CHAT else "completions"
        self.metrics.requests.labels("frontend", self.config.frontend_id, "", endpoint, str(err.status),
                                     "rejected").inc()
        self.request_log.write({"ts": time.time(), "request_id": None, "client_request_id": client_id,
                                "tenant": tenant, "endpoint": endpoint, "status": err.status,
                                "error": err.message, "error_code": err.code})

    def finish(self, job: Job) -> None:
        """Ends a job exactly once: cancels calls still running upstream, releases leases and the tenant's
        admission (refunding unused output budget), records metrics and writes the request log line."""
        if job.ended:
            return
        job.ended = True
        for c in job.choices:
            if c.call is not None and c.finish_reason is None:
                c.call.cancel()
            c.lease.release()
        completion = sum(c.tokens for c in job.choices)
        job.admission.release(completion)
        self.inflight -= 1
        self.metrics.inflight_now.dec()
        now = time.perf_counter()
        e2e = now - job.arrived
        m, name = self.metrics, job.model.name
        lbl = m.labels(name)
        if job.disconnected:
            status, finish = 499, "client_disconnect"
            m.disconnects.labels(*lbl).inc()
        elif job.error is not None:
            status, finish = job.error.status, "error"
        else:
            status, finish = job.status, ",".join(sorted({c.finish_reason or "none" for c in job.choices}))
        m.requests.labels(*lbl, job.endpoint, str(status), finish).inc()
        prompt_tokens = sum(len(p) for p in job.prompts)
        m.tokens.labels(*lbl, job.tenant.name, "prompt").inc(prompt_tokens)
        m.tokens.labels(*lbl, job.tenant.name, "completion").inc(completion)
        firsts = [c.first_at for c in job.choices if c.first_at is not None]
        ttft = (min(firsts) - job.arrived) if firsts else None
        itls = [v for c in job.choices for v in c.itls]
        tpots = [(c.last_at - c.first_at) / (c.tokens - 1) for c in job.choices
                 if c.first_at is not None and c.last_at is not None and c.tokens > 1]
        tpot = sum(tpots) / len(tpots) if tpots else None
        timings = [c.timing for c in job.choices if c.timing is not None]
        queue = max((t.prefill_queue_s + t.decode_admission_s for t in timings), default=None)
        m.observe_latencies(name, ttft, itls, tpot, e2e, queue)
        breakdown = _ttft_breakdown(job)
        if breakdown:
            m.observe_ttft_breakdown(name, breakdown)
        if not job.disconnected:
            # Admitted and finished: a 5xx misses every target; otherwise judge the measured latencies.
            ok = status < 500 and job.error is None
            ttft_ok = ok and ttft is not None and ttft <= self.config.ttft_slo_s
            tpot_ok = ok and (tpot is None or tpot <= self.config.tpot_slo_s)
            m.observe_slo(name, "ttft", ttft_ok)
            if tpot is not None or not ok:
                m.observe_slo(name, "tpot", tpot_ok)
            m.observe_slo(name, "both", ttft_ok and tpot_ok)
            if ttft_ok and tpot_ok:
                m.goodput_tokens.labels(*lbl).inc(completion)
        itls_sorted = sorted(itls)
        record: dict[str, Any] = {
            "ts": time.time(),
            "request_id": job.id,
            "client_request_id": job.client_request_id,
            "tenant": job.tenant.name,
            "endpoint": job.endpoint,
            "model": name,
            "requested_model": job.requested_model,
            "fallback": job.fallback_reason or None,
            "status": status,
            "finish_reasons": [c.finish_reason for c in job.choices],
            "error": None if job.error is None else job.error.message,
            "stream": job.req.stream,
            "n": job.req.n,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "cached_tokens": [c.cached_tokens for c in job.choices],
            "ttft_ms": None if ttft is None else round(ttft * 1e3, 3),
            "ttft_breakdown_ms": {k: round(v * 1e3, 3) for k, v in breakdown.items()} or None,
            "e2e_ms": round(e2e * 1e3, 3),
            "tpot_ms": None if tpot is None else round(tpot * 1e3, 3),
            "itl_p50_ms": round(itls_sorted[len(itls_sorted) // 2] * 1e3, 3) if itls_sorted else None,
            "itl_max_ms": round(itls_sorted[-1] * 1e3, 3) if itls_sorted else None,
            "session_key": job.session_key is not None,
            "routes": [_route_record(c) for c in job.choices],
        }
        if job.prompt_log is not None:
            record["prompt"] = job.prompt_log
        self.request_log.write(record)


def _ttft_breakdown(job: Job) -> dict[str, float]:
    """Stages of the first choice to produce a token: the frontend's own part (arrival to dispatch) and
    the node-reported parts. Empty when no token came."""
    firsts = [c for c in job.choices if c.first_at is not None]
    if not firsts:
        return {}
    c = min(firsts, key=lambda ch: ch.first_at or 0.0)
    out = {"frontend": max(0.0, (c.dispatched_at or job.arrived) - job.arrived)}
    if c.timing is not None:
        t = c.timing
        out |= {"prefill_queue": t.prefill_queue_s, "prefill": t.prefill_s, "transfer": t.transfer_s,
                "decode_admission": t.decode_admission_s, "first_decode_step": t.first_decode_step_s}
    return out


def _route_record(c: Choice) -> dict[str, Any]:
    d = c.decision
    out: dict[str, Any] = {
        "choice": c.index,
        "request_id": c.request_id,
        "decode_node": d.decode_id,
        "decode_reason": d.decode_reason,
        "prefill_node": d.prefill_id or None,
        "prefill_reason": d.prefill_reason,
        "prefix_key": d.prefix_key or None,
        "tried": c.tried,
        "served_by": {"prefill": c.prefill_node or None, "decode": c.decode_node or None},
        "tokens": c.tokens,
        "cached_tokens": c.cached_tokens,
        "cached_tokens_prefill": c.cached_prefill,
        "cached_tokens_decode": c.cached_decode,
    }
    if c.timing is not None:
        t = c.timing
        out["timing_ms"] = {
            "prefill_queue": round(t.prefill_queue_s * 1e3, 3),
            "prefill": round(t.prefill_s * 1e3, 3),
            "transfer": round(t.transfer_s * 1e3, 3),
            "first_decode_step": round(t.first_decode_step_s * 1e3, 3),
            "decode_admission": round(t.decode_admission_s * 1e3, 3),
        }
    return out
