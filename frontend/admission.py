"""Admission: everything that can refuse a generation request before its response starts (auth is the
caller's): body validation, model resolution and fallback, permissions, tokenization and context checks,
routing every choice, and the tenant's limits. The result is a `Job` holding a tenant grant and route
leases, which `frontend.accounting` releases when the job ends.

The CPU-heavy steps (`frontend.prepare`: parsing the body, chat templating, tokenization) run in
`frontend.workers` processes for a body over `prepare_inline_bytes`, so a long prompt does not stall the
event loop that streams other requests' tokens; a small body is cheaper to do inline than to hand over.
They are pure functions of the body and the model; everything that reads or changes shared state
(catalog, router, limiter) runs on the event loop.

Fallback (`Admitter._fallback`, the one rule): a model with a configured fallback is served by it when its
own pool has no usable decode node at admission, or (`Admitter.fall_back`) when every decode node tried
failed the request before anything was sent to the client.

Degradation (`frontend.degrade`, the model's `degrade` policies): under pressure a request's output is
capped, a chat over the context is trimmed of its oldest turns, and a long prompt waits in its model's
long-prompt lane; the job names what was applied (`Job.degraded`)."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from pdserve.frontend.config import FrontendConfig
from pdserve.frontend.degrade import (
    CAP_MAX_TOKENS,
    LONG_PROMPT_LANE,
    TRIM_HISTORY,
    Lanes,
    LaneSlot,
    next_drop,
    pool_pressure,
    pressure_cap,
    trim_allowed,
)
from pdserve.frontend.errors import OVERLOADED, APIError
from pdserve.frontend.job import (
    CHAT,
    COMPLETION,
    RESPONSES,
    AdmissionStamps,
    Choice,
    Job,
    client_request_id,
    key_hash,
)
from pdserve.frontend.limit_store import Limiter
from pdserve.frontend.metrics import FrontendMetrics
from pdserve.frontend.models import ModelCatalog, ServedModel
from pdserve.frontend.prepare import Tokenized, parse_request, tokenize
from pdserve.frontend.protocol import INT64_MAX, SEED_MIN, GenerationRequest, effective_priority
from pdserve.frontend.routing import NoRoute, RouteDecision, Router
from pdserve.frontend.tenants import Tenant
from pdserve.frontend.ttft import TTFTEstimator
from pdserve.frontend.upstream import sampling_message
from pdserve.frontend.workers import PrepareWorkers

T = TypeVar("T")

_ID_PREFIX = {CHAT: "chatcmpl-", COMPLETION: "cmpl-", RESPONSES: "resp_"}

TTFT_BUDGET_HEADER = "x-pdserve-ttft-budget-ms"
_MAX_TTFT_BUDGET_MS = 3_600_000.0


@dataclass(frozen=True)
class PickedModel:
    model: ServedModel
    fallback_reason: str  # "" when the requested model serves


@dataclass(frozen=True)
class OutputBudget:
    """One prompt's output: the generation cap of each of its choices and what each reserves against the
    tenant's output budget (max_tokens when sent; else an estimate, settled when the job ends)."""

    max_tokens: int
    reserve: int
    estimated: bool
    capped: bool = False  # lowered by cap_max_tokens (`frontend.degrade`)


def ttft_budget_ms(tenant: Tenant, headers: Mapping[str, str]) -> float | None:
    """The request's TTFT budget: its `x-pdserve-ttft-budget-ms` header, else the tenant's
    `ttft_budget_ms`, else None (no early rejection). 400 APIError for a malformed header."""
    raw = headers.get(TTFT_BUDGET_HEADER)
    if raw is None:
        return None if tenant.limits.ttft_budget_ms is None else float(tenant.limits.ttft_budget_ms)
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= _MAX_TTFT_BUDGET_MS:  # also refuses NaN
        raise APIError(400, f"Invalid value for header '{TTFT_BUDGET_HEADER}': {raw[:40]!r}; it must be a number "
                       f"of milliseconds in (0, {_MAX_TTFT_BUDGET_MS:g}].", param=TTFT_BUDGET_HEADER,
                       code="invalid_value")
    return value


class Admitter:
    """Turns a request body into an admitted `Job` (reads the catalog, router and limiter; takes route
    leases and a tenant grant, which the job's end releases)."""

    def __init__(self, config: FrontendConfig, catalog: ModelCatalog, limiter: Limiter, router: Router,
                 metrics: FrontendMetrics, workers: PrepareWorkers, ttft: TTFTEstimator,
                 inflight: Callable[[], int] = lambda: 0) -> None:
        self.config, self.catalog, self.limiter, self.router, self.metrics = config, catalog, limiter, router, metrics
        self.workers, self.ttft = workers, ttft
        self.lanes = Lanes()  # the models' long-prompt lanes (`frontend.degrade`)
        self.inflight = inflight  # requests this frontend has in flight or in its prepare workers

    async def admit(self, kind: str, tenant: Tenant, body: bytes, headers: Mapping[str, str],
                    batch: bool = False) -> Job:
        """Validates, tokenizes, routes and admits a request (`batch`: a line of a /v1/batches job). Raises
        APIError (4xx/503)."""
        arrived = time.monotonic()
        offload = len(body) > self.config.prepare_inline_bytes
        limits = self.config.request_limits
        req = await self.workers.parse(kind, body, limits) if offload else parse_request(kind, body, limits)
        return await self.admit_request(kind, tenant, req, headers, arrived, offload, batch)

    async def admit_request(self, kind: str, tenant: Tenant, req: GenerationRequest, headers: Mapping[str, str],
                            arrived: float, offload: bool, batch: bool = False) -> Job:
        """Admits an already validated request (`admit` after parsing; the Responses API after it resolved
        the conversation). `offload`: tokenize in a prepare worker. Raises APIError (4xx/503)."""
        budget_ms = ttft_budget_ms(tenant, headers)
        parsed = time.monotonic()
        model = self.catalog.resolve(req.model)
        if not tenant.may_use(*self.catalog.names_of(model)):
            raise APIError(403, f"Tenant {tenant.name!r} may not use model `{req.model}`.", type="permission_error",
                           param="model", code="model_not_allowed")
        self._limited(tenant, lambda: self.limiter.precheck(tenant))
        req.sampling.priority = effective_priority(req.sampling.priority, tenant.priority)
        if req.sampling.priority > 0 and self.inflight() >= self.config.batch_inflight_limit:
            raise APIError(503, "This frontend keeps its remaining in-flight capacity for interactive requests "
                           f"(priority <= 0); this request has priority {req.sampling.priority}. Retry shortly.",
                           type=OVERLOADED, code="overloaded", headers={"retry-after": "1"})
        session_key = headers.get(self.config.session_header) if self.config.session_header else None
        if not session_key and self.config.user_affinity:
            session_key = req.user
        picked = self._pick_model(tenant, model, session_key)
        model = picked.model
        tokenized = await self.workers.tokenize(req, model) if offload else tokenize(req, model)
        status = self.router.status(model.pool)
        cap = pressure_cap(model.degrade, pool_pressure(status.decode, status.prefill))
        tokenized, dropped = await self._fit(req, tenant, model, tokenized, offload, cap)
        tokenized_at = time.monotonic()
        prompts = tokenized.prompts
        budgets = [self._max_tokens(req, tenant, model, len(p), cap) for p in prompts]
        degraded = [name for name, on in ((TRIM_HISTORY, dropped > 0),
                                          (CAP_MAX_TOKENS, any(b.capped for b in budgets))) if on]
        slot = await self._lane(model, prompts)
        try:
            if slot is not None and slot.waited:
                degraded.append(LONG_PROMPT_LANE)
            job = await self._admit_routed(kind, tenant, req, model, picked, tokenized, budgets, session_key,
                                           headers, budget_ms, arrived, AdmissionStamps(parsed, tokenized_at),
                                           dropped, batch)
        except BaseException:
            if slot is not None:
                slot.release()
            raise
        job.lane, job.degraded = slot, degraded
        for name in degraded:
            self.metrics.degradations.labels(*self.metrics.labels(model), name).inc()
        return job

    async def _lane(self, model: ServedModel, prompts: list[list[int]]) -> LaneSlot | None:
        """A place in the model's long-prompt lane when its policy has one and a prompt is over it (after
        a wait while the lane is full); None otherwise. 503 APIError when too many wait already."""
        lane = model.degrade.long_prompt_lane
        if lane is None or max(len(p) for p in prompts) <= lane.above_tokens:
            return None
        return await self.lanes.acquire(model.name, lane, f"Model `{model.name}`")

    async def _admit_routed(self, kind: str, tenant: Tenant, req: GenerationRequest, model: ServedModel, picked: PickedModel,
                      tokenized: Tokenized, budgets: list[OutputBudget], session_key: str | None,
                      headers: Mapping[str, str], budget_ms: float | None, arrived: float, stamps: AdmissionStamps,
                      dropped: int, batch: bool) -> Job:
        """Routes every choice, checks the TTFT budget and takes the tenant's grant: the admitted job."""
        prompts = tokenized.prompts
        per_prompt_max = [b.max_tokens for b in budgets]
        routed_from = time.monotonic()
        decisions = self._route(req, model, prompts, per_prompt_max, session_key)
        routed = time.monotonic()
        if budget_ms is not None:
            self._limited(tenant, lambda: self._check_ttft(model, [d for _, d in decisions], budget_ms, arrived))
        firm = sum(budgets[pi].reserve for pi, _ in decisions if not budgets[pi].estimated)
        estimate = sum(budgets[pi].reserve for pi, _ in decisions if budgets[pi].estimated)
        grant = await self.limited(tenant, self.limiter.grant(tenant, sum(len(p) for p in prompts), firm, estimate))
        job_id = _ID_PREFIX[kind] + uuid.uuid4().hex
        job = Job(kind=kind, id=job_id, created=int(time.time()), arrived=arrived, req=req, tenant=tenant,
                  model=model, requested_model=req.model, prompts=prompts, echo_texts=tokenized.echo_texts,
                  choices=self._choices(job_id, req, model, prompts, per_prompt_max, decisions), grant=grant,
                  client_request_id=client_request_id(headers), key_hash=key_hash(headers), session_key=session_key,
                  fallback_reason=picked.fallback_reason,
                  stamps=AdmissionStamps(stamps.parsed, stamps.tokenized, routed_from, routed, time.monotonic()),
                  dropped=dropped, batch=batch)
        if self.config.log_prompts:
            job.prompt_log = req.messages if req.kind == CHAT else req.prompts
        self._count_routes(job)
        return job

    async def _fit(self, req: GenerationRequest, tenant: Tenant, model: ServedModel, tokenized: Tokenized,
                   offload: bool, cap: int | None) -> tuple[Tokenized, int]:
        """`tokenized`, or when the chat does not fit the context and trimming is allowed (`req.droppable`
        of the Responses API's truncation "auto"; a chat's own `truncation`, else the model's trim_history
        default: `frontend.degrade.trim_allowed`), the chat without its oldest turns (`degrade.next_drop`:
        system messages and the last user turn stay), re-rendered with the chat template after each drop
        until it fits; `req.messages` loses them too. Returns the prompt and how many messages were dropped."""
        allowed = req.droppable
        if not allowed and req.kind == CHAT and trim_allowed(model.degrade, req.truncation):
            allowed = len(req.messages or ())
        dropped = 0
        while allowed > dropped and not self._fits(req, tenant, model, len(tokenized.prompts[0]), cap):
            assert req.messages is not None
            drop = next_drop(req.messages)
            if not drop:
                break  # nothing is left to answer without what remains
            for i in reversed(drop):
                del req.messages[i]
            dropped += len(drop)
            tokenized = await self.workers.tokenize(req, model) if offload else tokenize(req, model)
        return tokenized, dropped

    def _fits(self, req: GenerationRequest, tenant: Tenant, model: ServedModel, prompt_len: int,
              cap: int | None) -> bool:
        try:
            self._max_tokens(req, tenant, model, prompt_len, cap)
        except APIError as err:
            if err.code == "context_length_exceeded":
                return False
            raise
        return True

    def _count_routes(self, job: Job) -> None:
        lbl = self.metrics.labels(job.model)
        for c in job.choices:
            self.metrics.routes.labels(*lbl, "prefill", c.decision.prefill_rule).inc()
            self.metrics.routes.labels(*lbl, "decode", c.decision.decode_rule).inc()

    def _limited(self, tenant: Tenant, check: Callable[[], T]) -> T:
        """Runs a tenant-limit check, counting a refusal in the metrics before re-raising it."""
        try:
            return check()
        except APIError as err:
            self._count_rejection(tenant, err)
            raise

    async def limited(self, tenant: Tenant, check: Awaitable[T]) -> T:
        """`_limited` for a check that awaits (the shared limits store)."""
        try:
            return await check
        except APIError as err:
            self._count_rejection(tenant, err)
            raise

    def _check_ttft(self, model: ServedModel, decisions: list[RouteDecision], budget_ms: float, arrived: float) -> None:
        """503 APIError with Retry-After when some choice's predicted TTFT (time so far plus
        `TTFTEstimator.estimate` behind its node's backlog, earlier choices of this request included)
        exceeds `ttft_headroom` times the budget."""
        elapsed = time.monotonic() - arrived
        limit_ms = budget_ms * self.config.ttft_headroom
        added: dict[str, int] = {}  # prompt tokens this request already puts on a node
        for d in decisions:
            node = d.prefill_target
            backlog = self.router.backlog(d)
            est = self.ttft.estimate(model.pool, backlog, added.get(node, 0) + d.prompt_tokens)
            added[node] = added.get(node, 0) + d.prompt_tokens
            if est is None:
                continue
            predicted_ms = (elapsed + est.seconds) * 1e3
            if predicted_ms > limit_ms:
                wait_s = math.ceil((predicted_ms - limit_ms) / 1e3)
                raise APIError(503, f"Model `{model.name}` cannot produce a first token within the {budget_ms:g} ms "
                               f"TTFT budget now: predicted {predicted_ms:.0f} ms ({est.work_tokens} prompt tokens "
                               f"to prefill at {est.tokens_per_s:.0f} tokens/s; {backlog.ours_tokens} routed by this "
                               f"frontend, {backlog.reported_queue} requests reported waiting). Retry later or "
                               "elsewhere.",
                               type=OVERLOADED, code="ttft_budget_unmet", limit="ttft",
                               headers={"retry-after": str(max(1, wait_s))})

    def _route(self, req: GenerationRequest, model: ServedModel, prompts: list[list[int]], per_prompt_max: list[int],
               session_key: str | None) -> list[tuple[int, RouteDecision]]:
        """(prompt index, route) of every choice; 503 APIError when the pool cannot take it."""
        decisions: list[tuple[int, RouteDecision]] = []
        try:
            for pi, ids in enumerate(prompts):
                for _ in range(req.n):
                    decisions.append((pi, self.router.route(model.pool, ids, per_prompt_max[pi], session_key)))
        except NoRoute as err:
            raise APIError(503, f"Model `{model.name}` cannot take requests now: {err}", type=OVERLOADED,
                           code="overloaded" if err.overloaded else "no_route",
                           headers={"retry-after": "1"}) from None
        return decisions

    def _choices(self, job_id: str, req: GenerationRequest, model: ServedModel, prompts: list[list[int]],
                 per_prompt_max: list[int], decisions: list[tuple[int, RouteDecision]]) -> list[Choice]:
        """One choice per route, each with its own sampling seed and a route lease."""
        choices = []
        for i, (pi, decision) in enumerate(decisions):
            k = i % req.n
            seed = req.sampling.seed
            if seed is not None and k:
                seed = (seed + k - SEED_MIN) % (INT64_MAX - SEED_MIN + 1) + SEED_MIN  # distinct, wrapped
            choices.append(Choice(
                index=i, prompt_index=pi, request_id=f"{job_id}-{i}", prompt_ids=prompts[pi],
                max_tokens=per_prompt_max[pi],
                params=sampling_message(req.sampling, per_prompt_max[pi], seed, model.spec.speculative),
                decision=decision, lease=self.router.lease(decision),
            ))
        return choices

    def _count_rejection(self, tenant: Tenant, err: APIError) -> None:
        self.metrics.rejections.labels("frontend", self.config.frontend_id, tenant.name, err.limit or err.code or "").inc()

    def _usable_version(self, model: ServedModel, session_key: str | None) -> ServedModel | None:
        """The version of `model` this request goes to (`ModelCatalog.rank`: by weight, sticky per session
        key), or the next one whose pool has a usable decode node; None when none has."""
        return next((v for v in self.catalog.rank(model, session_key)
                     if self.router.status(v.pool).usable_decode), None)

    def _pick_model(self, tenant: Tenant, model: ServedModel, session_key: str | None) -> PickedModel:
        """The requested model's version for this request, or the model's fallback when no version's pool
        has a usable decode node. 503 APIError when every version has weight 0."""
        usable = self._usable_version(model, session_key)
        if usable is not None:
            return PickedModel(usable, "")
        versions = [v for v in self.catalog.versions_of(model) if self.catalog.weight(v) > 0]
        if not versions:
            raise APIError(503, f"Model `{model.name}` takes no new requests: every version has routing weight 0.",
                           type=OVERLOADED, code="no_route", headers={"retry-after": "1"})
        model = versions[0]
        why = "overloaded" if self.router.status(model.pool).decode else "has no decode node"
        return self._fallback(tenant, model, f"pool {model.pool!r} {why}", session_key) or PickedModel(model, "")

    def _fallback(self, tenant: Tenant, model: ServedModel, why: str, session_key: str | None) -> PickedModel | None:
        """The one fallback rule (admission and run time): the model's configured fallback, if the tenant
        may use it and a version of it has a usable decode node; None otherwise. Fallbacks do not chain."""
        if model.spec.fallback is None:
            return None
        fallback = self.catalog.get(model.spec.fallback)
        if fallback is None or not tenant.may_use(*self.catalog.names_of(fallback)):
            return None
        usable = self._usable_version(fallback, session_key)
        if usable is None:
            return None
        return PickedModel(usable, f"{why}; served by fallback {usable.name!r}")

    async def fall_back(self, job: Job, why: str) -> bool:
        """Moves a job whose pool failed it before anything was sent to the fallback model (`_fallback`):
        re-tokenized, re-routed, new choices with new leases (the old leases are released; their calls
        must be over). Returns False, changing nothing, when there is no usable fallback, the job is
        already on one, or the fallback cannot take the request."""
        if job.fallback_reason:
            return False
        picked = self._fallback(job.tenant, job.model, f"pool {job.model.pool!r} failed the request ({why})",
                                job.session_key)
        if picked is None:
            return False
        model, req = picked.model, job.req
        try:
            # The fallback model's tokenizer, off the loop as in `prepare` (the whole prompt is re-tokenized).
            tokenized = await self.workers.tokenize(req, model)
            status = self.router.status(model.pool)  # the fallback's own pool pressure sets its cap
            cap = pressure_cap(model.degrade, pool_pressure(status.decode, status.prefill))
            budgets = [self._max_tokens(req, job.tenant, model, len(p), cap) for p in tokenized.prompts]
            per_prompt_max = [b.max_tokens for b in budgets]
            decisions = self._route(req, model, tokenized.prompts, per_prompt_max, job.session_key)
        except APIError:
            return False
        for c in job.choices:
            c.lease.release()
        job.model, job.prompts, job.echo_texts = model, tokenized.prompts, tokenized.echo_texts
        job.choices = self._choices(job.id, req, model, tokenized.prompts, per_prompt_max, decisions)
        job.fallback_reason = picked.fallback_reason
        if any(b.capped for b in budgets) and CAP_MAX_TOKENS not in job.degraded:
            job.degraded.append(CAP_MAX_TOKENS)
            self.metrics.degradations.labels(*self.metrics.labels(model), CAP_MAX_TOKENS).inc()
        self._count_routes(job)
        return True

    def _max_tokens(self, req: GenerationRequest, tenant: Tenant, model: ServedModel, prompt_len: int,
                    pressure_cap: int | None = None) -> OutputBudget:
        """The output budget of one choice, at most `pressure_cap` (cap_max_tokens in force; a request over
        it is lowered to it, after the tenant's own cap is checked); 400 APIError when the request cannot
        fit the context."""
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
            budget = budget if cap is None else min(budget, cap)
            capped = pressure_cap is not None and budget > pressure_cap
            budget = min(budget, pressure_cap) if capped and pressure_cap is not None else budget
            estimate = next(e for e in (tenant.limits.output_tokens_estimate, model.spec.output_tokens_estimate,
                                        self.config.output_estimate) if e is not None)
            return OutputBudget(budget, min(budget, estimate), estimated=True, capped=capped)
        if cap is not None and wanted > cap:
            raise APIError(400, f"{param} is too large: {wanted}. This model supports at most {cap} completion "
                           "tokens per choice for this tenant.", param=param, code="invalid_value")
        capped = pressure_cap is not None and wanted > pressure_cap
        if capped and pressure_cap is not None:
            wanted = pressure_cap
        if prompt_len + wanted > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{prompt_len + wanted} tokens ({prompt_len} in the {what}, {wanted} in the completion). "
                           f"Please reduce the length of the {what} or completion.", param=param,
                           code="context_length_exceeded")
        return OutputBudget(wanted, wanted, estimated=False, capped=capped)
