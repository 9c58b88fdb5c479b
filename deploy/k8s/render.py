"""Renders the pdserve Kubernetes manifests from a values file, without helm.

    python deploy/k8s/render.py [-f VALUES.yaml ...] [--set KEY=VALUE ...] [-o OUT.yaml]

The defaults are in values.yaml next to this file; each -f file is deep-merged over them in order, then
each --set (dotted key, value parsed as YAML: `--set prefill.replicas=4`). Templates are the jinja2 files
in templates/, rendered in file-name order into one multi-document YAML stream for `kubectl apply -f`.

Derived values (object names, the etcd member list, the frontend's tenants and models files, command
lines) are computed here rather than in the templates, so the templates stay close to plain YAML and the
checks on the values live in one place. Every rendered document is parsed back before it is printed, so a
template mistake fails here and not in `kubectl`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import yaml

from pdserve.deploy.k8s.context import ValuesError, build_context, deep_merge

__all__ = ["ValuesError", "build_context", "deep_merge", "load_values", "main", "render", "render_objects", "set_value"]

HERE = Path(__file__).resolve().parent
TEMPLATES_DIR = HERE / "templates"
DEFAULT_VALUES = HERE / "values.yaml"



# ---------------------------------------------------------------------------------------- values


def set_value(values: dict[str, Any], assignment: str) -> None:
    """Applies one `a.b.c=VALUE` override in place; VALUE is parsed as YAML (so 4 is an int)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise ValuesError(f"--set wants KEY=VALUE, got {assignment!r}")
    parts = key.split(".")
    node = values
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ValuesError(f"--set {key}: {part!r} is not a mapping")
        node = child
    node[parts[-1]] = yaml.safe_load(raw) if raw else ""


def load_values(files: Sequence[str | Path] = (), sets: Sequence[str] = ()) -> dict[str, Any]:
    """The defaults, merged with `files` in order, then `sets`."""
    values = _read_yaml(DEFAULT_VALUES)
    for f in files:
        values = deep_merge(values, _read_yaml(Path(f)))
    for s in sets:
        set_value(values, s)
    return values


def _read_yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise ValuesError(f"{path}: the top level must be a mapping")
    return data


# ---------------------------------------------------------------------------------------- checks


# ---------------------------------------------------------------------------------------- render


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        undefined=jinja2.StrictUndefined,  # a misspelt value fails the render instead of rendering empty
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    # JSON is YAML: structured values are written inline as flow collections, with quoting done right.
    env.filters["json"] = lambda value: json.dumps(value, sort_keys=False)
    return env


def render(values: dict[str, Any]) -> str:
    """The manifests for `values` as one multi-document YAML string. Raises ValuesError."""
    ctx = build_context(values)
    env = _environment()
    docs: list[str] = []
    for template in sorted(p.name for p in TEMPLATES_DIR.glob("*.yaml.j2")):
        text = env.get_template(template).render(**ctx)
        for doc in re.split(r"(?m)^---\s*$", text):
            if not doc.strip():
                continue
            try:
                obj = yaml.safe_load(doc)
            except yaml.YAMLError as err:
                raise ValuesError(f"{template} rendered invalid YAML: {err}\n{doc}") from err
            if obj is None:  # a document left empty by a disabled feature
                continue
            if not isinstance(obj, dict) or "kind" not in obj:
                raise ValuesError(f"{template} rendered a document that is not a Kubernetes object:\n{doc}")
            docs.append(f"# Source: deploy/k8s/templates/{template}\n{doc.strip()}\n")
    return "---\n" + "---\n".join(docs)


def render_objects(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The rendered manifests as parsed objects."""
    return [d for d in yaml.safe_load_all(render(values)) if d]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="render.py", description="Render the pdserve Kubernetes manifests.")
    p.add_argument("-f", "--values", action="append", default=[], metavar="FILE",
                   help="values file merged over values.yaml (repeatable, in order)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one value, e.g. prefill.replicas=4 (repeatable)")
    p.add_argument("-o", "--output", default="-", help="output file ('-': stdout)")
    args = p.parse_args(argv)
    try:
        text = render(load_values(args.values, args.set))
    except KeyError as err:
        print(f"render.py: error: missing value {err}", file=sys.stderr)
        return 2
    except (ValuesError, OSError, yaml.YAMLError, jinja2.TemplateError) as err:
        print(f"render.py: error: {err}", file=sys.stderr)
        return 2
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
