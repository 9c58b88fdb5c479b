"""Validates response bodies and stream chunks against the official OpenAI OpenAPI specification.

The spec (vendored beside this module in `openai-openapi/`, MIT, see the README there) is OpenAPI
3.1 but still carries 3.0 idioms; they are translated to JSON Schema 2020-12 once: `nullable: true`
becomes "or null", and boolean `exclusiveMinimum`/`exclusiveMaximum` become numeric bounds. `$ref`s resolve
against the whole document. The parsed spec is cached as JSON next to the other pdserve caches, keyed
by the file's size and mtime, because parsing 3 MB of YAML takes seconds.

One documented deviation: the spec makes `finish_reason` of a legacy completion choice a required
non-null string and uses that same object for stream chunks, while every OpenAI-compatible server
(OpenAI's own included) sends `finish_reason: null` on all chunks but a choice's last. Stream chunks of
/v1/completions are therefore checked against `CreateCompletionResponse` with only that one property
made nullable (`COMPLETION_CHUNK`); everything else is the spec's.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_URI = "urn:openai:openapi"
COMPLETION_CHUNK = "CreateCompletionResponse (stream chunk)"


def find_spec() -> Path:
    """The spec to validate against: $PDSERVE_OPENAPI_SPEC, else the copy vendored beside this module.
    The only place that knows where the spec lives, so moving this package moves nothing else."""
    explicit = os.environ.get("PDSERVE_OPENAPI_SPEC")
    if explicit:
        return Path(explicit)
    return Path(__file__).resolve().with_name("openai-openapi") / "openapi.yaml"


def _translate(node: Any) -> Any:
    """OpenAPI 3.0 idioms -> JSON Schema 2020-12 (recursively, on a copy)."""
    if isinstance(node, list):
        return [_translate(v) for v in node]
    if isinstance(node, datetime.date):  # YAML reads unquoted dates as dates; JSON has strings
        return node.isoformat()
    if not isinstance(node, dict):
        return node
    out = {k: _translate(v) for k, v in node.items()}
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(bound), bool):
            if out.pop(bound) and limit in out:
                out[bound] = out.pop(limit)
    if out.pop("nullable", False) is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


def _load(path: Path) -> dict[str, Any]:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cache_dir = Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")
    cache = cache_dir / f"openapi-{key}.json"
    if cache.is_file():
        return json.loads(cache.read_bytes())
    with path.open("rb") as f:
        spec = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    spec = _translate(spec)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(spec))  # stdlib json: the spec holds integers beyond 64 bits
    tmp.replace(cache)
    return spec


class OpenAPISchemas:
    """Validators for `#/components/schemas/<name>` of the spec (read-only after construction)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or find_spec()
        spec = _load(self.path)
        schemas = spec["components"]["schemas"]
        chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
        reason = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
        chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = {"anyOf": [reason, {"type": "null"}]}
        schemas[COMPLETION_CHUNK] = chunk
        self._registry: Registry = Registry().with_resource(SPEC_URI, Resource(spec, specification=DRAFT202012))
        self._validators: dict[str, Draft202012Validator] = {}
        self.names = set(schemas)
        self._spec = spec
        self._events: dict[str, str] | None = None

    def stream_event_schemas(self) -> dict[str, str]:
        """Responses stream event type -> the schema of that event (the members of ResponseStreamEvent)."""
        if self._events is None:
            schemas = self._spec["components"]["schemas"]
            self._events = {}
            for ref in schemas["ResponseStreamEvent"]["anyOf"]:
                name = ref["$ref"].rsplit("/", 1)[-1]
                enum = schemas[name].get("properties", {}).get("type", {}).get("enum") or [None]
                if enum[0] is not None:
                    self._events[enum[0]] = name
        return self._events

    def validator(self, name: str) -> Draft202012Validator:
        v = self._validators.get(name)
        if v is None:
            if name not in self.names:
                raise KeyError(f"no schema {name!r} in {self.path}")
            ref = f"{SPEC_URI}#/components/schemas/{name}"
            v = self._validators[name] = Draft202012Validator({"$ref": ref}, registry=self._registry)
        return v

    def errors(self, name: str, instance: Any) -> list[str]:
        """Every violation of schema `name` by `instance`, as readable strings (empty when valid)."""
        return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                for e in self.validator(name).iter_errors(instance)]

    def validate(self, name: str, instance: Any) -> None:
        """Raises ValidationError naming every violation when `instance` does not match schema `name`."""
        problems = self.errors(name, instance)
        if problems:
            raise ValidationError(f"{name}: " + "; ".join(problems[:10]))


# --- the frontend's own OpenAPI document ----------------------------------------------------------------

_OPERATIONS = (  # (path, method, operationId, request schema or None)
    ("/v1/chat/completions", "post", "createChatCompletion", "CreateChatCompletionRequest"),
    ("/v1/completions", "post", "createCompletion", "CreateCompletionRequest"),
    ("/v1/embeddings", "post", "createEmbedding", "CreateEmbeddingRequest"),
    ("/v1/models", "get", "listModels", None),
    ("/v1/models/{model}", "get", "retrieveModel", None),
    ("/v1/responses", "post", "createResponse", "CreateResponse"),
    ("/v1/responses/{response_id}", "get", "getResponse", None),
    ("/v1/responses/{response_id}", "delete", "deleteResponse", None),
    ("/v1/responses/{response_id}/cancel", "post", "cancelResponse", None),
    ("/v1/responses/{response_id}/input_items", "get", "listInputItems", None),
    ("/v1/files", "post", "createFile", "CreateFileRequest"),
    ("/v1/files", "get", "listFiles", None),
    ("/v1/files/{file_id}", "get", "retrieveFile", None),
    ("/v1/files/{file_id}", "delete", "deleteFile", None),
    ("/v1/files/{file_id}/content", "get", "downloadFile", None),
    ("/v1/batches", "post", "createBatch", "CreateBatchRequest"),
    ("/v1/batches", "get", "listBatches", None),
    ("/v1/batches/{batch_id}", "get", "retrieveBatch", None),
    ("/v1/batches/{batch_id}/cancel", "post", "cancelBatch", None),
)
_MULTIPART = {"CreateFileRequest"}  # request schemas sent as multipart/form-data; the others are JSON
_STREAMED = {"CreateChatCompletionRequest", "CreateCompletionRequest", "CreateResponse"}  # may answer SSE


def _schema_closure(schemas: dict[str, Any], roots: list[str]) -> dict[str, Any]:
    """`roots` and every component schema they reference, transitively."""
    out: dict[str, Any] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out[name] = schemas[name]
        stack: list[Any] = [schemas[name]]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                ref = node.get("$ref")
                if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
                    todo.append(ref.rsplit("/", 1)[1])
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
    return dict(sorted(out.items()))


def frontend_document(path: Path | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document the frontend serves at /openapi.json: its routes, with the request bodies
    and the error response of the official spec (what `scripts/build_frontend_openapi.py` writes to
    frontend/openapi.json)."""
    spec = _load(path or find_spec())
    schemas = spec["components"]["schemas"]
    roots = [s for *_, s in _OPERATIONS if s] + ["ErrorResponse"]
    error = {"description": "An error, in the OpenAI shape",
             "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    paths: dict[str, Any] = {}
    for route, method, op_id, request in _OPERATIONS:
        op: dict[str, Any] = {"operationId": op_id, "responses": {
            "200": {"description": "Success", "content": {"application/json": {}, **(
                {"text/event-stream": {}} if request in _STREAMED else {})}},
            "default": error}}
        if request:
            kind = "multipart/form-data" if request in _MULTIPART else "application/json"
            op["requestBody"] = {"required": True, "content": {kind: {
                "schema": {"$ref": f"#/components/schemas/{request}"}}}}
        names = re.findall(r"\{(\w+)\}", route)
        if names:
            op["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names]
        paths.setdefault(route, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdserve", "version": "1",
                 "description": "The OpenAI-compatible API of a pdserve cluster. Request and error schemas are "
                                "the official OpenAI specification's (MIT); fields of features the server "
                                "does not serve are answered 400."},
        "paths": paths,
        "components": {"schemas": _schema_closure(schemas, roots)},
    }
