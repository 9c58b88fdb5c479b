"""The frontend process's one validated configuration, and the models file it reads.

Models file (YAML or TOML, chosen by the file suffix)::

    models:
      - name: tiny-llama            # the name clients send; also the pool name unless `pool` is given
        path: /models/tiny-llama    # Hugging Face directory: tokenizer, chat template, config.json
        pool: tiny-llama            # model name the nodes register under in etcd (default: name)
        aliases: [gpt-4o-mini]      # more names for the same pool
        fallback: tiny-qwen2        # served name used when this pool has no usable decode node, or
                                    # every decode node tried failed the request before a first token
        max_context: 2048           # default: the model's max_model_len
        max_output_tokens: 1024     # cap on max_tokens (default: no cap beyond the context)
        default_max_tokens: 256     # chat requests without max_tokens (default: the rest of the context)
        output_tokens_estimate: 256 # output reserved against tenant budgets when max_tokens is absent
                                    # (default: --output-estimate); reconciled with what was generated
        reasoning_parser: auto      # thinking span split off chat answers (frontend.reasoning): qwen3,
                                    # deepseek_r1, none, or auto (qwen3 when the chat template mentions
                                    # <think> and the tokenizer has <think>/</think> tokens)
        embedding: {pooling: last, normalize: true}  # /v1/embeddings (frontend.embeddings): last | mean
        speculative: ngram          # speculative decoding's drafts for this model's requests: ngram, suffix
                                    # or off (default: each decode node's --speculative)
        prices:                     # USD per million tokens (frontend.pricing); default: requests cost nothing
          input: 0.15               # prompt tokens computed
          cached_input: 0.075       # prompt tokens served from the prefix cache (usage's cached_tokens)
          output: 0.60              # completion tokens
          batch_discount: 0.5       # fraction taken off every token of a /v1/batches line, in [0, 1)
        degrade:                    # what requests give up under pressure (frontend.degrade); re-read live
          cap_max_tokens: {max_tokens: 64, kv_use_above: 0.8, queue_above: 8}
          trim_history: {default: auto}  # or the request's truncation: "auto"
          long_prompt_lane: {above_tokens: 2048, max_concurrent: 1}

Canary: entries that share a `name` are versions of one served model, each its own pool, with routing
weights (requests with a session key stick to a version; the others split exactly by weight). Weights
(and prices) are re-read from the file while the frontend runs; weight 0 sends a version no new requests::

      - {name: smol, version: v1, pool: smol-v1, path: /models/smol-v1, weight: 90}
      - {name: smol, version: v2, pool: smol-v2, path: /models/smol-v2, weight: 10}

`--model NAME=PATH` on the command line adds an entry with only a name and a path.

An entry is a `ModelEntry` (frontend.config_files: strict types, unknown fields refused). `FrontendConfig`
declares the bounds of its numbers as annotations, which pydantic checks at construction.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar

from annotated_types import Ge, Gt, Interval
from pydantic import BeforeValidator, Field, ValidationInfo

from pdserve.frontend.config_files import (
    ConfigError,
    FileEntry,
    Name,
    PositiveOrNull,
    Requirement,
    check_bounds,
    empty_as,
    entries,
    load_config_file,
)
from pdserve.frontend.degrade import NO_POLICY, DegradePolicy, parse_degrade
from pdserve.frontend.pricing import Prices
from pdserve.frontend.protocol import RequestLimits
from pdserve.frontend.reasoning import REASONING_SETTINGS
from pdserve.frontend.tls import TLSConfigError, check_pair
from pdserve.rpc import RpcSecurity, add_rpc_args, rpc_security_from_args
from pdserve.rpc.tracing import TracingConfig, add_tracing_args, tracing_config_from_args

# --- the models file ------------------------------------------------------------------------------

# A model's `speculative`: "" leaves each decode node's --speculative in force (engine.speculative's
# methods, spelled out: the frontend needs no torch).
SPECULATIVE_SETTINGS = ("", "off", "ngram", "suffix")


EMBEDDING_POOLINGS = ("last", "mean")  # engine.embedding.POOLINGS (the frontend imports no torch)


@dataclass(frozen=True)
class EmbeddingSettings:
    """How /v1/embeddings pools a model's final hidden states: the last token's (vLLM's default for a
    generative model served as an embedding model) or the mean over the input, L2-normalized or not."""

    pooling: str = "last"
    normalize: bool = True


class EmbeddingEntry(FileEntry):
    kind: ClassVar[str] = "embedding"
    pooling: Annotated[str, Requirement("embedding.pooling must be last or mean")] = "last"
    normalize: Annotated[bool, Requirement("embedding.normalize must be true or false")] = True

    def settings(self) -> EmbeddingSettings:
        if self.pooling not in EMBEDDING_POOLINGS:
            raise ConfigError(f"embedding.pooling must be one of {list(EMBEDDING_POOLINGS)}, got {self.pooling!r}")
        return EmbeddingSettings(self.pooling, self.normalize)


def _embedding_settings(value: Any) -> EmbeddingSettings:
    """A models-file entry's `embedding` mapping (null: the defaults). Raises ConfigError (a ValueError)."""
    if isinstance(value, EmbeddingSettings):
        return value
    return EmbeddingEntry.read("embedding", value or {}).settings()


_PRICE = "{key} must be a finite number >= 0 (USD per million tokens), got {value!r}"
Price = Annotated[float, Field(ge=0, allow_inf_nan=False), Requirement(_PRICE)]


class PricesEntry(FileEntry):
    """A model's `prices`: USD per million tokens; a missing price is 0."""

    kind: ClassVar[str] = "prices table"
    input: Price = 0.0
    cached_input: Price = 0.0
    output: Price = 0.0
    batch_discount: Annotated[float, Field(ge=0, lt=1), Requirement(
        "batch_discount must be a number in [0, 1) (the fraction taken off batch work), got {value!r}")] = 0.0

    def prices(self) -> Prices:
        return Prices(self.input, self.cached_input, self.output, self.batch_discount)


def read_prices(value: Any, model: str) -> Prices | None:
    """A models-file entry's `prices` mapping (null: none, requests cost nothing). Raises ConfigError naming
    the model and the field."""
    if value is None or isinstance(value, Prices):
        return value
    return PricesEntry.read(f"model {model!r}: prices", value).prices()


def _prices(value: Any, info: ValidationInfo) -> Prices | None:
    return read_prices(value, str(info.data.get("name", "?")))


@dataclass(frozen=True)
class ModelSpec:
    """One served model: its names, where its tokenizer lives and which pool serves it."""

    name: str
    path: str
    pool: str = ""  # registry model name; "" means the same as `name`
    aliases: tuple[str, ...] = ()
    fallback: str | None = None
    max_context: int | None = None
    max_output_tokens: int | None = None
    default_max_tokens: int | None = None
    output_tokens_estimate: int | None = None
    version: str = ""  # canary: which version of `name` this entry is ("" when it has one version)
    weight: float = 1.0  # canary: share of new requests among the versions of `name` (0: none)
    reasoning_parser: str = "auto"  # frontend.reasoning.REASONING_SETTINGS
    embedding: EmbeddingSettings = EmbeddingSettings()  # /v1/embeddings pooling
    speculative: str = ""  # SPECULATIVE_SETTINGS; "": the decode nodes' --speculative
    prices: Prices | None = None  # USD per million tokens (None: its requests cost nothing)
    degrade: DegradePolicy = NO_POLICY  # frontend.degrade: what its requests give up under pressure

    def __post_init__(self) -> None:
        if self.speculative not in SPECULATIVE_SETTINGS:
            raise ConfigError(f"model {self.name!r}: speculative must be one of {list(SPECULATIVE_SETTINGS[1:])}, "
                              f"got {self.speculative!r}")
        if self.reasoning_parser not in REASONING_SETTINGS:
            raise ConfigError(f"model {self.name!r}: reasoning_parser must be one of {list(REASONING_SETTINGS)}, "
                              f"got {self.reasoning_parser!r}")
        if not self.name or "/" in self.pool:
            raise ConfigError(f"model {self.name!r}: name must be non-empty and pool must contain no '/'")
        if not (0.0 <= self.weight < float("inf")):
            raise ConfigError(f"model {self.name!r}: weight must be a finite number >= 0, got {self.weight!r}")
        if not self.pool:
            object.__setattr__(self, "pool", self.name)
        if not Path(self.path).is_dir():
            raise ConfigError(f"model {self.name!r}: path {self.path!r} is not a directory")
        if self.fallback == self.name:
            raise ConfigError(f"model {self.name!r}: a model cannot be its own fallback")


class ModelEntry(FileEntry):
    """An entry of the models file: ModelSpec's fields, checked in this order."""

    kind: ClassVar[str] = "model"
    name: Annotated[Name, Requirement("{key} is required and must be a string")]
    path: Annotated[Name, Requirement("{key} is required and must be a string")]
    aliases: Annotated[list[Name], empty_as([]), Requirement("aliases must be a list of names")] = []
    fallback: Annotated[str | None, Requirement("fallback must be a model name")] = None
    pool: Annotated[str, empty_as(""), Requirement("pool must be a string")] = ""
    version: Annotated[str, empty_as(""), Requirement("version must be a string")] = ""
    weight: Annotated[float, Requirement("weight must be a number, got {value!r}")] = 1.0
    max_context: PositiveOrNull = None
    max_output_tokens: PositiveOrNull = None
    default_max_tokens: PositiveOrNull = None
    output_tokens_estimate: PositiveOrNull = None
    reasoning_parser: Annotated[str, Requirement("reasoning_parser must be a string")] = "auto"
    embedding: Annotated[EmbeddingSettings, BeforeValidator(_embedding_settings)] = EmbeddingSettings()
    speculative: Annotated[str, empty_as(""), Requirement("speculative must be a string")] = ""
    prices: Annotated[Prices | None, BeforeValidator(_prices)] = None
    degrade: Annotated[DegradePolicy, BeforeValidator(parse_degrade)] = NO_POLICY

    def spec(self) -> ModelSpec:
        return ModelSpec(**{**dict(self), "path": os.path.expanduser(self.path), "aliases": tuple(self.aliases)})


def check_versions(specs: tuple[ModelSpec, ...] | list[ModelSpec]) -> None:
    """Entries sharing a name are the versions of one model: each needs a distinct version and pool, and
    they agree on aliases and fallback. Raises ConfigError."""
    groups: dict[str, list[ModelSpec]] = {}
    for spec in specs:
        groups.setdefault(spec.name, []).append(spec)
    for name, group in groups.items():
        if len(group) == 1:
            continue
        versions = [s.version for s in group]
        if not all(versions) or len(set(versions)) != len(versions):
            raise ConfigError(f"model name {name!r} is used twice; entries sharing a name are versions of one "
                              f"model and each needs its own 'version', got {versions}")
        pools = [s.pool for s in group]
        if len(set(pools)) != len(pools):
            raise ConfigError(f"model {name!r}: each version needs its own pool, got {pools}")
        if len({(s.aliases, s.fallback) for s in group}) != 1:
            raise ConfigError(f"model {name!r}: its versions must have the same aliases and fallback")


def version_weights(specs: tuple[ModelSpec, ...] | list[ModelSpec]) -> dict[tuple[str, str], float]:
    """(name, version) -> routing weight of every entry."""
    return {(s.name, s.version): s.weight for s in specs}


def version_prices(specs: tuple[ModelSpec, ...] | list[ModelSpec]) -> dict[tuple[str, str], Prices | None]:
    """(name, version) -> price table of every entry."""
    return {(s.name, s.version): s.prices for s in specs}


def load_models_file(path: str | Path) -> list[ModelSpec]:
    items = entries(path, load_config_file(path), "models")
    return [ModelEntry.read(f"{path}: models[{i}]", e).spec() for i, e in enumerate(items)]


def default_response_store() -> str:
    """An SQLite file under the user's state directory ($XDG_STATE_HOME, else ~/.local/state); `pdserve up`
    passes one in the cluster's run directory instead."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "pdserve", "responses.db")


def _default_frontend_id() -> str:
    return f"frontend-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class FrontendConfig:
    """Everything one frontend process needs; validated once at construction."""

    etcd_endpoints: tuple[str, ...]
    models: tuple[ModelSpec, ...]
    cluster: str = "default"
    host: str = "127.0.0.1"
    port: Annotated[int, Interval(ge=0, le=65535)] = 8000
    tenants_file: str | None = None  # None: local mode, any key accepted
    # TLS of the OpenAI API (frontend.tls): a PEM certificate chain and its key, re-read when they change;
    # both empty: plain HTTP.
    tls_cert: str = ""
    tls_key: str = ""
    models_file: str | None = None  # where `models` came from; its version weights are re-read at run time
    frontend_id: str = field(default_factory=_default_frontend_id)
    # Per-tenant limits are enforced per process. With K frontends behind one balancer (limit_share=K)
    # frontend i of K (limit_share_index=i) enforces floor(limit / K), plus one while i < limit % K: the
    # shares sum to exactly the limit. Without an index every frontend enforces floor(limit / K), which
    # never exceeds the limit in total but loses the remainder. A zero share refuses with 429 +
    # Retry-After, so clients and balancers retry on another frontend.
    limit_share: Annotated[int, Ge(1)] = 1
    limit_share_index: int | None = None
    # The limits shared by every frontend (frontend.limit_store): a Redis URL (redis://, rediss://, unix://)
    # where each tenant's limits and spend are held as if there were one frontend; "" none. While it is
    # unreachable each frontend falls back to its share above. A frontend's holds (concurrency, tokens in
    # flight) are leased for limits_lease_s, renewed while its requests run, so a killed one's expire.
    limits_redis: str = ""
    limits_lease_s: Annotated[float, Gt(0)] = 30.0
    # Output tokens a request without max_tokens reserves against its tenant's output budget until it
    # ends (then it is charged what it generated); a model's or tenant's output_tokens_estimate wins.
    output_estimate: Annotated[int, Ge(1)] = 256
    max_body_bytes: Annotated[int, Ge(1024)] = 4 << 20
    max_header_bytes: Annotated[int, Ge(1024)] = 16384  # request line excluded: names and values of every header together
    body_timeout_s: Annotated[float, Gt(0)] = 30.0  # a body not received in full by then is answered 408
    max_messages: Annotated[int, Ge(1)] = 2048
    max_stop_strings: Annotated[int, Interval(ge=1, le=1024)] = 4
    max_stop_chars: Annotated[int, Ge(1)] = 256
    max_schema_bytes: Annotated[int, Ge(1)] = 1 << 16
    max_prompt_chars: Annotated[int, Ge(1)] = 1 << 20  # message content characters, or prompt characters + token ids
    max_inflight: Annotated[int, Ge(1)] = 2048  # requests in flight in this process before new ones get 503
    # Requests less urgent than interactive (priority > 0) get 503 once this fraction of max_inflight is
    # in flight, so batch work cannot take the capacity interactive requests need.
    batch_inflight_fraction: Annotated[float, Interval(gt=0, le=1)] = 0.75
    # A streamed response with nothing to send for this long gets an SSE comment line (0: never), so
    # proxies and load balancers with idle timeouts keep a request that waits in a queue.
    sse_keepalive_s: Annotated[float, Ge(0)] = 15.0
    # Admission's CPU work (parse, chat template, tokenize) for bodies over prepare_inline_bytes runs in
    # prepare_workers processes, with at most prepare_queue requests waiting for one (then 503).
    # One core fewer than the process may use (the event loop keeps one), 1..4.
    prepare_workers: Annotated[int, Ge(1)] = field(default_factory=lambda: max(1, min(4, len(os.sched_getaffinity(0)) - 1)))
    prepare_queue: Annotated[int, Ge(0)] = 256
    prepare_inline_bytes: Annotated[int, Ge(0)] = 16384
    # A request with a TTFT budget is refused when its predicted TTFT exceeds ttft_headroom x budget: the
    # queue settles where admission stops, so the prediction needs room for its own error.
    ttft_headroom: Annotated[float, Interval(gt=0, le=1)] = 0.7
    request_log: str | None = "-"  # "-": stderr, a path: appended JSON lines, None: off
    # Stored responses (/v1/responses): an SQLite path or sqlite:///path (one host), or postgresql://...
    # (every frontend of a cluster); opened on first use. Records expire response_ttl_s after creation.
    response_store: str = field(default_factory=lambda: default_response_store())
    response_ttl_s: Annotated[float, Gt(0)] = 30 * 24 * 3600.0
    # /v1/files and /v1/batches (frontend.batches): an upload over max_file_bytes is a 413. Batch lines run
    # on spare capacity (frontend.spare_capacity): batch_max_inflight at a time when no interactive request
    # is here, else a cap learned so the interactive TTFT/token-gap medians stay within batch_latency_budget of
    # theirs without batch lines (0 lines: this frontend runs no batches); a frontend holds a batch for
    # batch_lease_s, renewed while it runs.
    max_file_bytes: Annotated[int, Ge(1)] = 200 << 20
    batch_max_inflight: Annotated[int, Ge(0)] = 8
    batch_latency_budget: Annotated[float, Gt(0)] = 0.05
    batch_lease_s: Annotated[float, Gt(0)] = 30.0
    log_prompts: bool = False
    console: bool = True  # the web console at / and /console (frontend.console_routes)
    # Route by the exact cached prefix each node holds (its KV event stream: frontend.kv_index); off: prefix
    # affinity on consistent-hash rings only.
    kv_routing: bool = True
    # Per-tenant metrics (pdserve_frontend_tenant_*): this many tenants (the most requests) keep their own
    # `tenant` label, the rest are counted under tenant="other".
    metrics_tenant_series: Annotated[int, Ge(0)] = 20
    session_header: str = "x-session-id"  # session affinity key header ("" disables the header)
    user_affinity: bool = True  # use the request's `user` field as the session key when no header is set
    affinity_blocks: Annotated[int, Ge(1)] = 1  # leading prompt blocks hashed for prefill prefix affinity
    load_factor: Annotated[float, Gt(1)] = 1.25  # bounded-load factor of the consistent-hash rings (> 1)
    decode_max_queue: Annotated[int, Ge(1)] = 64  # a decode node with this many queued requests counts as overloaded
    upstream_attempts: Annotated[int, Ge(1)] = 2  # decode nodes tried before the first token, when one is unreachable
    # Times one choice may move to another decode node after its stream broke mid-way (node died,
    # drained or failed the request); the new node resumes after the tokens already delivered.
    max_migrations: Annotated[int, Ge(0)] = 2
    request_timeout_s: float = 600.0
    registry_sync_timeout_s: float = 10.0
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.2
    log_level: str = "info"
    rpc: RpcSecurity = field(default_factory=RpcSecurity.from_env)  # token (and CA) the calls to nodes carry
    tracing: TracingConfig = field(default_factory=TracingConfig)  # OTLP endpoint ("" = tracing off)
    request_limits: RequestLimits = field(init=False, repr=False, compare=False)  # derived from the max_* above

    @property
    def batch_inflight_limit(self) -> int:
        """In-flight requests beyond which requests with priority > 0 are refused."""
        return max(1, int(self.max_inflight * self.batch_inflight_fraction))

    def __post_init__(self) -> None:
        _require([
            (bool(self.etcd_endpoints), "at least one etcd endpoint is required (--etcd)"),
            (bool(self.models), "at least one model is required (--models FILE or --model NAME=PATH)"),
            (bool(self.cluster) and "/" not in self.cluster, f"bad cluster name {self.cluster!r}"),
        ])
        check_bounds(self)
        _require([
            (self.limit_share_index is None or 0 <= self.limit_share_index < self.limit_share,
             f"limit_share_index must be in [0, limit_share={self.limit_share}), got {self.limit_share_index}"),
            (self.request_timeout_s > 0, "request_timeout_s must be > 0"),
            (not self.limits_redis or self.limits_redis.startswith(("redis://", "rediss://", "unix://")),
             f"--limits-redis must be a redis://, rediss:// or unix:// URL, got {self.limits_redis!r}"),
            (self.ttft_slo_s > 0 and self.tpot_slo_s > 0, "SLO thresholds must be > 0"),
        ])
        object.__setattr__(self, "request_limits", RequestLimits(
            max_messages=self.max_messages, max_stop_strings=self.max_stop_strings,
            max_stop_chars=self.max_stop_chars, max_prompt_chars=self.max_prompt_chars,
            max_schema_bytes=self.max_schema_bytes))
        check_versions(self.models)
        _check_served_names(self.models)


def _require(checks: list[tuple[bool, str]]) -> None:
    for ok, message in checks:
        if not ok:
            raise ConfigError(f"FrontendConfig: {message}")


def _check_served_names(models: tuple[ModelSpec, ...]) -> None:
    """Served names (and aliases) are unique across models (versions share theirs); fallbacks are served."""
    names: dict[str, str] = {}
    for spec in models:
        if spec.name in names and names[spec.name] == spec.name and spec.version:
            continue  # another version of a model already named (check_versions vetted the group)
        for served in (spec.name, *spec.aliases):
            if served in names:
                raise ConfigError(f"FrontendConfig: model name {served!r} is used twice ({names[served]}, {spec.name})")
            names[served] = spec.name
    for spec in models:
        if spec.fallback is not None and spec.fallback not in names:
            raise ConfigError(f"FrontendConfig: model {spec.name!r}: fallback {spec.fallback!r} is not a served model")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdserve.frontend", description="pdserve OpenAI-compatible frontend and gateway"
    )
    p.add_argument("--etcd", action="append", default=[], metavar="HOST:PORT",
                   help="etcd endpoint (repeatable, or comma-separated)")
    p.add_argument("--cluster", default="default", help="cluster name the nodes register under")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--models", metavar="FILE", help="models file (YAML or TOML)")
    p.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                   help="serve model NAME with the tokenizer in PATH (repeatable)")
    p.add_argument("--tenants", metavar="FILE", help="tenants file (YAML or TOML); without it any key is accepted")
    p.add_argument("--tls-cert", default="", metavar="PEM",
                   help="serve the API over HTTPS with this certificate chain (with --tls-key; re-read on change)")
    p.add_argument("--tls-key", default="", metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--frontend-id", default=None)
    _add_admission_flags(p)
    p.add_argument("--request-log", default="-", help="'-' for stderr, a file path, or 'off'")
    p.add_argument("--log-prompts", action="store_true", help="include prompt text in the request log")
    p.add_argument("--no-console", dest="console", action="store_false",
                   help="do not serve the web console at / and /console")
    p.add_argument("--no-kv-routing", dest="kv_routing", action="store_false",
                   help="do not index the nodes' KV blocks (their event streams) nor route by the cached prefix "
                        "each holds; prefix affinity on hash rings only")
    p.add_argument("--metrics-tenant-series", type=int, default=20, metavar="N",
                   help="per-tenant metrics: the N tenants with the most requests keep their own tenant label, "
                        "the rest are counted under tenant=\"other\" (default 20)")
    p.add_argument("--response-store", default=None,
                   help="stored responses of /v1/responses: an SQLite path, sqlite:///path, or postgresql://... "
                        "shared by every frontend (default: ~/.local/state/pdserve/responses.db)")
    p.add_argument("--response-ttl", type=float, default=30 * 24 * 3600.0, dest="response_ttl_s",
                   help="seconds a stored response is kept (default 30 days)")
    p.add_argument("--max-file-bytes", type=int, default=200 << 20, help="largest /v1/files upload (then 413)")
    p.add_argument("--batch-max-inflight", type=int, default=8,
                   help="batch lines in flight when no interactive request is (0: run no batches here)")
    p.add_argument("--batch-latency-budget", type=float, default=0.05,
                   help="how much slower (a fraction) batch lines may make interactive requests' median TTFT "
                        "and token gaps; the batch cap beside interactive traffic is learned to stay within it")
    p.add_argument("--batch-lease", type=float, default=30.0, dest="batch_lease_s",
                   help="seconds a frontend holds a batch it runs without renewing (another resumes it after)")
    p.add_argument("--session-header", default="x-session-id")
    p.add_argument("--no-user-affinity", action="store_true")
    p.add_argument("--affinity-blocks", type=int, default=1)
    p.add_argument("--load-factor", type=float, default=1.25)
    p.add_argument("--decode-max-queue", type=int, default=64)
    p.add_argument("--upstream-attempts", type=int, default=2)
    p.add_argument("--max-migrations", type=int, default=2,
                   help="times a choice whose decode node fails mid-stream moves to another node (0: never)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--ttft-slo", type=float, default=2.0)
    p.add_argument("--tpot-slo", type=float, default=0.2)
    p.add_argument("--log-level", default="info")
    p.add_argument("--hash-key", metavar="KEY", help="print the sha256 of an API key for a tenants file and exit")
    add_rpc_args(p, server=False)
    add_tracing_args(p)
    return p


def _add_admission_flags(p: argparse.ArgumentParser) -> None:
    """Tenant-limit sharing, request size and time bounds, the prepare pool and overload flags."""
    p.add_argument("--limit-share", type=int, default=1,
                   help="number of frontend processes sharing each tenant's limits")
    p.add_argument("--limit-share-index", type=int, default=None,
                   help="this frontend's index in [0, --limit-share): the shares then sum to each limit exactly")
    p.add_argument("--limits-redis", default="", metavar="URL",
                   help="a Redis (redis://HOST:PORT/DB) holding every tenant's limits, quotas and spend for all the "
                        "frontends, as if there were one; while it is unreachable each falls back to its --limit-share")
    p.add_argument("--limits-lease-s", type=float, default=30.0,
                   help="a frontend's concurrency and tokens-in-flight holds in --limits-redis expire this long after "
                        "it stops renewing them (it was killed)")
    p.add_argument("--output-estimate", type=int, default=256,
                   help="output tokens reserved against tenant budgets for a request without max_tokens "
                        "(reconciled with what it generated when it ends)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--max-header-bytes", type=int, default=16384, help="431 beyond this many header bytes")
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds to receive a whole body (then 408)")
    p.add_argument("--max-messages", type=int, default=2048, help="messages per chat request")
    p.add_argument("--max-stop-strings", type=int, default=4)
    p.add_argument("--max-stop-chars", type=int, default=256, help="characters per stop string")
    p.add_argument("--max-schema-bytes", type=int, default=1 << 16,
                   help="bytes of a response_format JSON schema (serialized)")
    p.add_argument("--max-prompt-chars", type=int, default=1 << 20,
                   help="characters of a request's messages or prompts (token ids count one each)")
    p.add_argument("--max-inflight", type=int, default=2048)
    p.add_argument("--batch-inflight-fraction", type=float, default=0.75,
                   help="requests with priority > 0 get 503 once this fraction of --max-inflight is in flight")
    p.add_argument("--sse-keepalive-s", type=float, default=15.0,
                   help="send an SSE comment on a stream that has been silent this long, e.g. while its "
                   "request waits for a first token (0: never)")
    p.add_argument("--prepare-workers", type=int, default=None,
                   help="processes for parsing, chat templating and tokenization of large bodies (default: usable CPUs - 1, 1..4)")
    p.add_argument("--prepare-queue", type=int, default=256,
                   help="requests that may wait for a prepare worker before new ones get 503")
    p.add_argument("--prepare-inline-bytes", type=int, default=16384,
                   help="bodies up to this size are parsed and tokenized on the event loop (cheaper than a hand-over)")
    p.add_argument("--ttft-headroom", type=float, default=0.7,
                   help="refuse a request whose predicted TTFT exceeds this fraction of its TTFT budget")


# Flags whose FrontendConfig field has another name, and the fields named as their flags.
_RENAMED = {"tenants": "tenants_file", "models": "models_file", "body_timeout": "body_timeout_s",
            "request_timeout": "request_timeout_s", "ttft_slo": "ttft_slo_s", "tpot_slo": "tpot_slo_s"}
_SAME = ("cluster", "host", "port", "limit_share", "limit_share_index", "limits_redis", "limits_lease_s",
         "output_estimate", "max_body_bytes",
         "max_header_bytes", "max_messages", "max_stop_strings", "max_stop_chars", "max_schema_bytes",
         "max_prompt_chars", "max_inflight", "batch_inflight_fraction", "sse_keepalive_s", "prepare_queue",
         "prepare_inline_bytes", "ttft_headroom", "log_prompts", "metrics_tenant_series", "affinity_blocks", "load_factor", "decode_max_queue",
         "upstream_attempts", "max_migrations", "log_level", "console", "kv_routing", "response_ttl_s", "max_file_bytes",
         "batch_max_inflight", "batch_lease_s",
         "batch_latency_budget", "tls_cert", "tls_key")


def _models_from_args(args: argparse.Namespace) -> list[ModelSpec]:
    models: list[ModelSpec] = load_models_file(args.models) if args.models else []
    for item in args.model:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--model must be NAME=PATH, got {item!r}")
        models.append(ModelSpec(name=name, path=os.path.expanduser(path)))
    return models


def _security_from_args(args: argparse.Namespace) -> dict[str, Any]:
    try:
        rpc = rpc_security_from_args(args)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cluster token / TLS: {err}") from err
    try:
        return {"rpc": rpc, "tracing": tracing_config_from_args(args)}
    except ValueError as err:
        raise ConfigError(str(err)) from err


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    """Builds the FrontendConfig from parsed flags (reads the models file). Raises ConfigError."""
    models = _models_from_args(args)
    extra: dict[str, Any] = _security_from_args(args)
    if args.frontend_id:
        extra["frontend_id"] = args.frontend_id
    if args.prepare_workers is not None:
        extra["prepare_workers"] = args.prepare_workers
    if args.response_store:
        extra["response_store"] = args.response_store
    if args.tls_cert or args.tls_key:
        try:
            check_pair(args.tls_cert, args.tls_key)
        except TLSConfigError as err:
            raise ConfigError(str(err)) from None
    return FrontendConfig(
        etcd_endpoints=tuple(e.strip() for item in args.etcd for e in item.split(",") if e.strip()),
        models=tuple(models),
        request_log=None if args.request_log == "off" else args.request_log,
        session_header=args.session_header.lower(),
        user_affinity=not args.no_user_affinity,
        **{name: getattr(args, name) for name in _SAME},
        **{field_name: getattr(args, flag) for flag, field_name in _RENAMED.items()},
        **extra,
    )
