"""What one HTTP generation request is while it runs: the `Job` (admitted once, ended once) and its
`Choice`s (one upstream generation each, with its `Progress`), shared by admission, upstream calls,
rendering and accounting. Every time they hold is a `time.monotonic()` reading: the one clock of the
frontend's request timings (and the nodes' own), so any two of them make an interval."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.frontend.degrade import LaneSlot
from pdserve.frontend.errors import APIError
from pdserve.frontend.limits import AnyGrant
from pdserve.frontend.models import ServedModel
from pdserve.frontend.pricing import cost_usd
from pdserve.frontend.protocol import GenerationRequest
from pdserve.frontend.render import usage_dict
from pdserve.frontend.routing import RouteDecision, RouteLease
from pdserve.frontend.tenants import Tenant, hash_key
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc.enums import finish_reason_name, serving_path_name

if TYPE_CHECKING:
    from pdserve.frontend.tracing import RequestTrace

CHAT = "chat"
COMPLETION = "completion"
RESPONSES = "responses"  # /v1/responses: a chat prompt, rendered as a Response object or its events

# The endpoint label of metrics and the request log, by job kind.
ENDPOINTS = {CHAT: "chat.completions", COMPLETION: "completions", RESPONSES: "responses"}


class UpstreamError(Exception):
    """A node failed a request after it started; carries the APIError to report."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(eq=False)
class Progress:
    """What a choice's Generate calls produced so far: counted and timed here as their messages arrive
    (`UpstreamCalls` records each, `record`, and the one that completes the choice, `finish`), and what
    its nodes reported. Accounting, tracing and the request log read it; what the choice says, rendered,
    is its `frontend.output.ChoiceOutput`."""

    tokens: int = 0  # completion tokens
    finish_reason: str | None = None  # set when the choice finished ("stop" | "length")
    serving_path: str | None = None  # what its decode node said (`serving_path`): disaggregated or local_prefill
    stop_reason: str = ""
    cached_tokens: int = 0
    cached_prefill: int = 0  # of cached_tokens: the prefill node's prefix-cache hit (remote prefill)
    cached_decode: int = 0  # the decode node's own hit
    dispatched_at: float | None = None  # when the Generate call went out (the TTFT breakdown's frontend part)
    first_at: float | None = None  # when the first token arrived
    last_at: float | None = None  # when the latest token arrived
    itls: list[float] = field(default_factory=list)
    on_gap: Callable[[float], None] | None = None  # told each ITL as it is measured (frontend.spare_capacity)
    timing: pb.Timing | None = None
    prefilled_by: str = ""  # the node that prefilled, as the decode node reports it (itself, when local)
    decoded_by: str = ""
    # Of `tokens`: those inside a reasoning model's thinking span (`frontend.output.ChoiceOutput` keeps it
    # up to date); None when the choice's output is not split.
    reasoning_tokens: int | None = None

    def record(self, msg: pb.GenerateResponse, now: float, migrated: bool) -> None:
        """A message arrived at `now`: its tokens (first token, ITLs) and the timing its node reported.
        `migrated`: the choice moved off its first decode node, whose timing it keeps."""
        n = len(msg.token_ids)
        if n:
            if self.first_at is None:
                self.first_at = now
            elif self.last_at is not None:
                self.itls.append(now - self.last_at)
                if self.on_gap is not None:
                    self.on_gap(now - self.last_at)
            self.last_at = now
            self.tokens += n
        if msg.serving_path:
            self.serving_path = serving_path_name(msg.serving_path)
        if self.timing is None and msg.HasField("timing"):
            self.timing = msg.timing
            self.prefilled_by, self.decoded_by = msg.prefill_node_id, msg.decode_node_id
        elif msg.finished and msg.HasField("timing") and not migrated:
            # The last message repeats the timing complete (the KV transfer and the first decode step end
            # after the first token); a migrated choice keeps its first node's, which its TTFT was.
            self.timing = msg.timing

    def finish(self, msg: pb.GenerateResponse) -> None:
        """The choice's last message, which completed it: how it ended and what its node counted."""
        assert self.finish_reason is None, "a choice finishes once"
        self.finish_reason = finish_reason_name(msg.finish_reason)
        self.stop_reason = msg.stop_reason
        self.cached_tokens = msg.num_cached_tokens
        self.cached_prefill = msg.num_cached_tokens_prefill
        self.cached_decode = msg.num_cached_tokens_decode
        if msg.num_completion_tokens:
            self.tokens = msg.num_completion_tokens  # a resumed node counts the tokens before it too
        if msg.prefill_node_id:
            self.prefilled_by = msg.prefill_node_id
        if msg.decode_node_id:
            self.decoded_by = msg.decode_node_id


@dataclass(eq=False)
class Choice:
    """One upstream generation, i.e. one choice of the response: what it asks for, where it runs (its
    route and lease, its call, the decode nodes tried, what the client was given), and its `progress`."""

    index: int
    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    params: pb.SamplingParams
    decision: RouteDecision
    lease: RouteLease
    call: Any = None  # the grpc.aio call while it runs
    tried: list[str] = field(default_factory=list)  # decode nodes tried, in order
    # What the client was given so far (completion token ids and characters of completion text): a
    # migrated choice resumes after them on its next decode node.
    delivered_ids: list[int] = field(default_factory=list)
    delivered_chars: int = 0
    migrations: int = 0  # times the choice moved to another decode node mid-stream
    progress: Progress = field(default_factory=Progress)


@dataclass
class AdmissionStamps:
    """When a job's admission steps ended (its trace's admission spans)."""

    parsed: float = 0.0  # body parsed
    tokenized: float = 0.0  # model resolved and picked, prompts tokenized
    routed_from: float = 0.0  # routing started (output budgets checked)
    routed: float = 0.0  # every choice routed
    admitted: float = 0.0  # tenant limits passed: the job exists


@dataclass(eq=False)
class Job:
    """One HTTP generation request from admission to its end."""

    kind: str
    id: str
    created: int
    arrived: float  # when the request reached its route
    req: GenerationRequest
    tenant: Tenant
    model: ServedModel
    requested_model: str
    prompts: list[list[int]]
    echo_texts: list[str]
    choices: list[Choice]
    grant: AnyGrant  # what admission took from the tenant's limits
    client_request_id: str | None = None
    key_hash: str | None = None  # `key_hash` of its request
    session_key: str | None = None
    fallback_reason: str = ""
    prompt_log: Any = None  # what the request log shows of the prompt, when prompt logging is on
    status: int = 200
    error: APIError | None = None
    disconnected: bool = False
    ended: bool = False
    stamps: AdmissionStamps = field(default_factory=AdmissionStamps)
    trace: RequestTrace | None = None  # set when tracing is on
    dropped: int = 0  # leading messages admission dropped to fit the context (`GenerationRequest.droppable`)
    batch: bool = False  # a line of a /v1/batches job: its model's batch discount applies (`cost`)
    degraded: list[str] = field(default_factory=list)  # `frontend.degrade` policies applied, in order
    lane: LaneSlot | None = None  # its place in the model's long-prompt lane, released when it ends

    def traced(self, err: APIError) -> APIError:
        """`err` carrying the job's trace id (in its message and an x-trace-id header), when traced."""
        return self.trace.tag(err) if self.trace is not None else err

    @property
    def fingerprint(self) -> str:
        fp = self.choices[0].decision.fingerprint if self.choices else ""
        return f"fp_{fp[:10]}" if fp else "fp_unknown"

    @property
    def endpoint(self) -> str:
        return ENDPOINTS[self.kind]


def serving_path(c: Choice) -> str:
    """How a choice was served (the proto's ServingPath): `migrated` (moved to another decode node
    mid-stream), `retried` (started again on another decode node before its first token), both known only
    here, else what its decode node said: `disaggregated` (a prefill node prefilled it) or `local_prefill`
    (the decode node itself: a prompt under its local-prefill threshold, no prefill node, or a re-prefill
    after the prefill node failed; the node's own pdserve_decode_local_prefill_fallbacks_total tells the
    last apart). A choice that got no message counts as `local_prefill`."""
    if c.migrations:
        return "migrated"
    if len(c.tried) > 1:
        return "retried"
    return c.progress.serving_path or "local_prefill"


def first_to_token(job: Job) -> Progress | None:
    """The progress of the choice whose first token came first (None before any token): its TTFT is the
    job's."""
    started = [c.progress for c in job.choices if c.progress.first_at is not None]
    return min(started, key=lambda p: p.first_at or 0.0) if started else None


def key_hash(headers: Mapping[str, str]) -> str | None:
    """The first 16 hex digits of the SHA-256 of the request's bearer key (what the request log carries to
    tell keys apart: the tenants file holds the full digests, never the key); None without one."""
    scheme, _, value = (headers.get("authorization") or "").partition(" ")
    key = value.strip() if scheme.lower() == "bearer" else ""
    return hash_key(key)[:16] if key else None


def client_request_id(headers: Mapping[str, str]) -> str | None:
    value = headers.get("x-request-id")
    return None if value is None else value[:128]  # a client's id goes to the log; keep its lines bounded


def usage(job: Job) -> dict[str, Any]:
    """The usage object of a job's response (cached tokens counted once per prompt; reasoning tokens when
    the choices' output is split into thinking and content)."""
    completion = sum(c.progress.tokens for c in job.choices)
    cached: dict[int, int] = {}
    for c in job.choices:
        cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.progress.cached_tokens)
    split = [c.progress for c in job.choices if c.progress.reasoning_tokens is not None]
    reasoning = sum(min(p.reasoning_tokens or 0, p.tokens) for p in split) if split else None
    return usage_dict(sum(len(p) for p in job.prompts), completion, sum(cached.values()), reasoning)


def cost(job: Job) -> float:
    """USD the job is charged: `frontend.pricing.cost_usd` of its usage (prompt tokens, the cached ones as
    usage reports them, completion tokens) at its model's prices, with the batch discount for a batch
    line. What was used is charged also when the job failed or its client went away mid-way; nothing
    when no choice got as far as a token or a finish (nothing was computed for it)."""
    if not any(c.progress.first_at is not None or c.progress.finish_reason is not None for c in job.choices):
        return 0.0
    u = usage(job)
    prompt = u["prompt_tokens"]  # a resumed choice's node may count cached tokens past the prompt: bounded
    return cost_usd(job.model.prices, prompt, min(u["prompt_tokens_details"]["cached_tokens"], prompt),
                    u["completion_tokens"], job.batch)
