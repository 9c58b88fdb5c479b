"""Tenants and their API keys, read from a tenants file; keys are only ever stored as SHA-256 digests.

Tenants file (YAML or TOML)::

    tenants:
      - name: acme
        keys_sha256: ["9f86d0...", ...]   # `python -m pdserve.frontend --hash-key KEY` prints a key's digest
        models: ["tiny-llama"]            # served names or aliases; "*" allows every model
        requests_per_minute: 600          # any limit may be omitted or null: unlimited
        input_tokens_per_minute: 200000
        output_tokens_per_minute: 100000
        max_concurrent_requests: 32
        max_context_tokens: 4096          # prompt + max_tokens
        max_output_tokens: 1024           # max_tokens per choice
        daily_token_quota: 5000000        # hard quota, input + output tokens per UTC day
        output_tokens_estimate: 256       # output reserved for a request without max_tokens (default: the
                                          # model's, else the frontend's --output-estimate)
        ttft_budget_ms: 2000              # refuse at once (503) what cannot get a first token in time

Keys are random bearer secrets, so an unsalted digest is enough: recovering a key from its digest is as
hard as guessing the key. Lookup is by digest, so no comparison ever runs over the secret itself.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, fields
from pathlib import Path

from pdserve.frontend.config import ConfigError, check_keys, load_config_file, optional_positive_int
from pdserve.frontend.errors import APIError
from pdserve.frontend.protocol import parse_priority

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
LOCAL_TENANT = "local"


def hash_key(key: str) -> str:
    """The digest under which a key is stored in a tenants file."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class TenantLimits:
    """Per-tenant limits; None means unlimited."""

    requests_per_minute: int | None = None
    input_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    max_context_tokens: int | None = None
    max_output_tokens: int | None = None
    daily_token_quota: int | None = None
    # Not a limit: what a request without max_tokens reserves against output_tokens_per_minute and the
    # daily quota until it ends and is charged what it generated (None: the model's or frontend's default).
    output_tokens_estimate: int | None = None
    # Not a limit either: the default TTFT budget of the tenant's requests; a request whose predicted TTFT
    # (frontend.ttft) exceeds it is refused at once with 503 + Retry-After (a request header overrides it).
    ttft_budget_ms: int | None = None
    # Prompt tokens plus reserved output tokens of the tenant's requests in flight (429 beyond).
    max_tokens_in_flight: int | None = None


@dataclass(frozen=True)
class Tenant:
    name: str
    models: frozenset[str]  # served names or aliases; contains "*" for every model
    limits: TenantLimits
    # Scheduling priority of the tenant's requests (lower first); a request may ask for a less urgent
    # one, never a more urgent one. "interactive" is 0, "batch" 10.
    priority: int = 0

    def may_use(self, *names: str) -> bool:
        """True when any of `names` (a model's served name and its aliases) is allowed."""
        return "*" in self.models or any(n in self.models for n in names)


class TenantTable:
    """Resolves API keys to tenants. Immutable after construction."""

    def __init__(self, tenants: list[Tenant], digests: dict[str, str], *, open_access: bool) -> None:
        self._by_name = {t.name: t for t in tenants}
        self._by_digest = {d: self._by_name[name] for d, name in digests.items()}
        self.open_access = open_access  # local mode: every key (or none) maps to the local tenant

    @classmethod
    def local(cls) -> TenantTable:
        """The development table: one unlimited tenant that accepts any key."""
        return cls([Tenant(LOCAL_TENANT, frozenset({"*"}), TenantLimits())], {}, open_access=True)

    @classmethod
    def from_file(cls, path: str | Path) -> TenantTable:
        data = load_config_file(path)
        check_keys(str(path), data, {"tenants"})
        entries = data.get("tenants")
        if not isinstance(entries, list) or not entries:
            raise ConfigError(f"{path}: 'tenants' must be a non-empty list")
        tenants: list[Tenant] = []
        digests: dict[str, str] = {}
        limit_names = {f.name for f in fields(TenantLimits)}
        for i, obj in enumerate(entries):
            where = f"{path}: tenants[{i}]"
            if not isinstance(obj, dict):
                raise ConfigError(f"{where}: each tenant must be a mapping")
            check_keys(where, obj, {"name", "keys_sha256", "models", "priority"} | limit_names)
            name = obj.get("name")
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{where}: name is required")
            if any(t.name == name for t in tenants):
                raise ConfigError(f"{where}: tenant name {name!r} is used twice")
            keys = obj.get("keys_sha256")
            if not isinstance(keys, list) or not keys:
                raise ConfigError(f"{where}: keys_sha256 must be a non-empty list of SHA-256 hex digests")
            for key in keys:
                digest = key.lower() if isinstance(key, str) else ""
                if not _SHA256_HEX.match(digest):
                    raise ConfigError(f"{where}: {key!r} is not a SHA-256 hex digest (store hashed keys only)")
                if digest in digests:
                    raise ConfigError(f"{where}: key digest {digest[:12]}... also belongs to {digests[digest]!r}")
                digests[digest] = name
            models = obj.get("models", ["*"])
            if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
                raise ConfigError(f"{where}: models must be a list of model names")
            limits = TenantLimits(**{k: optional_positive_int(where, obj, k) for k in limit_names})
            try:
                priority = parse_priority(obj.get("priority"), "priority")
            except APIError as err:
                raise ConfigError(f"{where}: {err.message}") from None
            tenants.append(Tenant(name, frozenset(models), limits, 0 if priority is None else priority))
        return cls(tenants, digests, open_access=False)

    @property
    def tenants(self) -> list[Tenant]:
        return list(self._by_name.values())

    def authenticate(self, api_key: str | None) -> Tenant | None:
        """The tenant owning `api_key`, or None for a missing or unknown key (never None in local mode)."""
        if self.open_access:
            return self._by_name[LOCAL_TENANT]
        if not api_key:
            return None
        return self._by_digest.get(hash_key(api_key))

    def check_models(self, served: set[str]) -> list[str]:
        """Names in tenants' allow-lists that no model serves (for a startup warning)."""
        return sorted({m for t in self._by_name.values() for m in t.models if m != "*" and m not in served})
