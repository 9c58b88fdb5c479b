"""The configuration files the frontend reads (YAML or TOML, chosen by the suffix): loading, and their
entries as pydantic models (`FileEntry`) whose errors are ConfigErrors naming the file, the entry and the
field. Strict types and unknown fields refused, so that a misspelt limit fails loudly instead of silently
not applying; each field's `Requirement` is the message its error gets."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Annotated, Any, ClassVar, TypeVar, get_type_hints

import yaml
from annotated_types import Ge, GroupedMetadata, Gt, Le, Lt
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model


class ConfigError(ValueError):
    """A configuration file or flag that cannot be used; the message names the file and the field."""


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Parses a YAML (.yaml/.yml) or TOML (.toml) file into a mapping. Raises ConfigError."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{p}: cannot read: {err}") from err
    try:
        if p.suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif p.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            raise ConfigError(f"{p}: unknown format; use a .yaml, .yml or .toml file")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"{p}: cannot parse: {err}") from err
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping")
    return data


@dataclass(frozen=True)
class Requirement:
    """What a file field must be: its error's message, whatever pydantic found wrong ("{key}": the
    field, "{value}": what the file had). Validators raise ValueError for the rules they check."""

    message: str


class FileEntry(BaseModel):
    """One mapping of a configuration file; `kind` names it in "each <kind> must be a mapping"."""

    model_config = ConfigDict(strict=True, extra="forbid")
    kind: ClassVar[str] = "entry"

    @classmethod
    def read(cls: type[Entry], where: str, obj: Any, context: dict[str, Any] | None = None) -> Entry:
        """`obj` validated. Raises ConfigError naming `where` and the first field at fault."""
        try:
            return cls.model_validate(obj, context=context)
        except ValidationError as exc:
            raise ConfigError(f"{where}: {cls._message(exc.errors(include_url=False))}") from None

    @classmethod
    def _message(cls, errors: list[Any]) -> str:
        unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
        if unknown:
            return f"unknown field(s) {unknown}; allowed: {sorted(cls.model_fields)}"
        error = errors[0]
        if not error["loc"]:
            return f"each {cls.kind} must be a mapping"
        if error["type"] == "value_error":
            return str(error["ctx"]["error"])
        key = str(error["loc"][0])
        requirement = next(m for m in cls.model_fields[key].metadata if isinstance(m, Requirement))
        return requirement.message.format(key=key, value=error["input"])


Entry = TypeVar("Entry", bound=FileEntry)


def empty_as(empty: Any) -> BeforeValidator:
    """Any false value (null, "", [], 0) reads as `empty`."""
    return BeforeValidator(lambda value: value or empty)


PositiveOrNull = Annotated[Annotated[int, Gt(0)] | None, Requirement("{key} must be a positive integer or null, got {value!r}")]
Name = Annotated[str, Field(min_length=1)]


def entries(path: str | Path, data: dict[str, Any], key: str) -> list[Any]:
    """The non-empty list a file holds under `key`, its only top-level field. Raises ConfigError."""
    unknown = sorted(set(data) - {key})
    if unknown:
        raise ConfigError(f"{path}: unknown field(s) {unknown}; allowed: {[key]}")
    items = data.get(key)
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{path}: '{key}' must be a non-empty list")
    return items


# --- bounds declared on a dataclass's fields: Annotated[int, Ge(1)] ------------------------------


@cache
def _bounds_model(cls: type) -> type[BaseModel]:
    """A pydantic model of the fields of `cls` declared Annotated[number, bound] (strict: 5.0 is no int)."""
    hints = get_type_hints(cls, include_extras=True)
    bounded = {name: (hint, ...) for name, hint in hints.items() if getattr(hint, "__metadata__", ())}
    return create_model(f"{cls.__name__}Bounds", __config__=ConfigDict(strict=True), **bounded)


def _bound_text(metadata: list[Any]) -> str:
    """">= 1", "> 0", "in [0, 65535]", "in (0, 1]": a field's annotated_types bounds."""
    lo = hi = ""
    for bound in (b for m in metadata for b in (m if isinstance(m, GroupedMetadata) else [m])):
        if isinstance(bound, Ge | Gt):
            lo = f"[{bound.ge}" if isinstance(bound, Ge) else f"({bound.gt}"
        elif isinstance(bound, Le | Lt):
            hi = f"{bound.le}]" if isinstance(bound, Le) else f"{bound.lt})"
    if not hi:
        return (">= " if lo[0] == "[" else "> ") + lo[1:]
    return f"in {lo}, {hi}"


def check_bounds(obj: Any) -> None:
    """Raises ConfigError("<class>: <field> must be >= 1, got 0") for the first field of the dataclass
    `obj` outside the bounds its annotation declares."""
    model = _bounds_model(type(obj))
    try:
        model.model_validate({name: getattr(obj, name) for name in model.model_fields})
    except ValidationError as exc:
        name = str(exc.errors(include_url=False)[0]["loc"][0])
        raise ConfigError(f"{type(obj).__name__}: {name} must be {_bound_text(model.model_fields[name].metadata)}, "
                          f"got {getattr(obj, name)}") from None
