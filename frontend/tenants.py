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
        daily_budget_usd: 5.00            # money budgets (the models' prices, charged when a request ends):
        monthly_budget_usd: 100.00        # refused (429) once spent, until the UTC day / month rolls over;
                                          # 0 admits nothing; omitted or null: no budget
        output_tokens_estimate: 256       # output reserved for a request without max_tokens (default: the
                                          # model's, else the frontend's --output-estimate)
        ttft_budget_ms: 2000              # refuse at once (503) what cannot get a first token in time
        operator: false                   # true: the key also sees the whole cluster in the web console

The frontend re-reads the file when it changes (`Frontend._watch_tenants_file`): a new `TenantTable`
replaces the old one whole, or, when the file cannot be used, the old one stays.

Keys are random bearer secrets, so an unsalted digest is enough: recovering a key from its digest is as
hard as guessing the key. Lookup is by digest, so no comparison ever runs over the secret itself.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any, ClassVar

from annotated_types import Ge
from pydantic import AllowInfNan, Field, Strict, ValidationInfo, create_model, field_validator

from pdserve.frontend.config_files import (
    FileEntry,
    Name,
    PositiveOrNull,
    Requirement,
    entries,
    load_config_file,
)
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
    # Money budgets in USD (frontend.pricing.cost_usd, charged when a request ends): a tenant that has spent
    # its budget is refused until the UTC day / month rolls over. 0 admits nothing; None: no budget.
    daily_budget_usd: float | None = None
    monthly_budget_usd: float | None = None


BUDGETS = ("daily_budget_usd", "monthly_budget_usd")


@dataclass(frozen=True)
class Tenant:
    name: str
    models: frozenset[str]  # served names or aliases; contains "*" for every model
    limits: TenantLimits
    # Scheduling priority of the tenant's requests (lower first); a request may ask for a less urgent
    # one, never a more urgent one. "interactive" is 0, "batch" 10.
    priority: int = 0
    # The web console shows this tenant's keys the whole cluster and every request (else its own only).
    operator: bool = False

    def may_use(self, *names: str) -> bool:
        """True when any of `names` (a model's served name and its aliases) is allowed."""
        return "*" in self.models or any(n in self.models for n in names)


class _TenantFields(FileEntry):
    """An entry of the tenants file, checked in this order: these fields, every TenantLimits field, then
    `priority` (`TenantEntry`). Names and key digests must be unique across the file: the context of a
    file's validation holds those of the entries before ({"names": set, "digests": {digest: name}})."""

    kind: ClassVar[str] = "tenant"
    name: Annotated[Name, Requirement("name is required")]
    keys_sha256: Annotated[list[Any], Field(min_length=1),
                           Requirement("keys_sha256 must be a non-empty list of SHA-256 hex digests")]
    models: Annotated[list[Name], Requirement("models must be a list of model names")] = ["*"]
    operator: Annotated[bool, Requirement("operator must be true or false")] = False

    @field_validator("name")
    @classmethod
    def _unique_name(cls, name: str, info: ValidationInfo) -> str:
        if name in info.context["names"]:
            raise ValueError(f"tenant name {name!r} is used twice")
        info.context["names"].add(name)
        return name

    @field_validator("keys_sha256")
    @classmethod
    def _digests(cls, keys: list[Any], info: ValidationInfo) -> list[str]:
        owners: dict[str, str] = info.context["digests"]
        for key in keys:
            digest = key.lower() if isinstance(key, str) else ""
            if not _SHA256_HEX.match(digest):
                raise ValueError(f"{key!r} is not a SHA-256 hex digest (store hashed keys only)")
            if digest in owners:
                raise ValueError(f"key digest {digest[:12]}... also belongs to {owners[digest]!r}")
            owners[digest] = info.data.get("name", "")
        return keys

    @field_validator("priority", check_fields=False)
    @classmethod
    def _priority(cls, value: Any) -> int:
        try:
            priority = parse_priority(value, "priority")
        except APIError as err:
            raise ValueError(err.message) from None
        return 0 if priority is None else priority

    def tenant(self) -> Tenant:
        limits = TenantLimits(**{f.name: getattr(self, f.name) for f in fields(TenantLimits)})
        return Tenant(self.name, frozenset(self.models), limits, self.priority, self.operator)


# A budget in US dollars: a number >= 0 (0: nothing is admitted) or null (no budget); "5" or true is no number.
UsdOrNull = Annotated[Annotated[float, Strict(), Ge(0), AllowInfNan(False)] | None,
                      Requirement("{key} must be a number of US dollars >= 0 (0 admits nothing) or null, got {value!r}")]

TenantEntry = create_model("TenantEntry", __base__=_TenantFields,
                           **{f.name: (UsdOrNull if f.name in BUDGETS else PositiveOrNull, None)
                              for f in fields(TenantLimits)}, priority=(Any, 0))


class TenantTable:
    """Resolves API keys to tenants. Immutable after construction: a changed tenants file is a new table
    (`Frontend` swaps it in whole, so a request sees one table or the other)."""

    def __init__(self, tenants: list[Tenant], digests: dict[str, str], *, open_access: bool) -> None:
        self._by_name = {t.name: t for t in tenants}
        self._by_digest = {d: self._by_name[name] for d, name in digests.items()}
        self.open_access = open_access  # local mode: every key (or none) maps to the local tenant

    @classmethod
    def local(cls) -> TenantTable:
        """The development table: one unlimited tenant that accepts any key (and operates the console)."""
        return cls([Tenant(LOCAL_TENANT, frozenset({"*"}), TenantLimits(), operator=True)], {}, open_access=True)

    @classmethod
    def from_file(cls, path: str | Path) -> TenantTable:
        """The table of a tenants file. Raises ConfigError naming the entry and the field at fault."""
        items = entries(path, load_config_file(path), "tenants")
        seen: dict[str, Any] = {"names": set(), "digests": {}}
        tenants = [TenantEntry.read(f"{path}: tenants[{i}]", obj, seen).tenant() for i, obj in enumerate(items)]
        return cls(tenants, seen["digests"], open_access=False)

    @property
    def tenants(self) -> list[Tenant]:
        return list(self._by_name.values())

    def by_name(self, name: str) -> Tenant | None:
        return self._by_name.get(name)

    def changes(self, new: TenantTable) -> dict[str, list[str]]:
        """What `new` adds, removes and changes against this table (tenant names; a tenant changed when its
        models, limits, priority or keys differ)."""
        def keys(table: TenantTable, name: str) -> set[str]:
            return {d for d, t in table._by_digest.items() if t.name == name}
        old_names, new_names = set(self._by_name), set(new._by_name)
        changed = [n for n in sorted(old_names & new_names)
                   if self._by_name[n] != new._by_name[n] or keys(self, n) != keys(new, n)]
        return {"added": sorted(new_names - old_names), "removed": sorted(old_names - new_names),
                "changed": changed}

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
