"""Malformed and out-of-range requests, each with the status and error code the frontend must answer, and a
runner that sends them and checks the OpenAI error shape (never a 500)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from testing.openapi import OpenAPISchemas


@dataclass(frozen=True)
class BadInput:
    name: str
    path: str  # "/v1/chat/completions" or "/v1/completions"
    body: bytes
    status: int
    code: str


def bad_inputs(model: str, max_body_bytes: int, context_tokens: int) -> list[BadInput]:
    """The cases for a frontend serving `model`, whose body limit and context length are given."""
    chat, comp = "/v1/chat/completions", "/v1/completions"
    ok: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    long_text = "word " * (2 * context_tokens)

    def j(obj: Any) -> bytes:
        return orjson.dumps(obj)

    def msgs(text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    model_json = orjson.dumps(model).decode()
    return [
        BadInput("malformed JSON", chat, b'{"model": ' + model_json.encode() + b', "messages": [', 400, "invalid_json"),
        BadInput("not an object", chat, b"[1, 2]", 400, "invalid_json"),
        BadInput("empty body", chat, b"", 400, "invalid_json"),
        BadInput("wrong type: temperature", chat, j({**ok, "temperature": "warm"}), 400, "invalid_type"),
        BadInput("wrong type: messages", chat, j({**ok, "messages": {"role": "user"}}), 400, "invalid_type"),
        BadInput("wrong type: max_tokens", chat, j({**ok, "max_tokens": "10"}), 400, "invalid_type"),
        BadInput("empty messages", chat, j({**ok, "messages": []}), 400, "invalid_value"),
        BadInput("bad role", chat, j({**ok, "messages": [{"role": "robot", "content": "x"}]}), 400, "invalid_value"),
        BadInput("negative max_tokens", chat, j({**ok, "max_tokens": -5}), 400, "invalid_value"),
        BadInput("huge max_tokens", chat, j({**ok, "max_tokens": 10**12}), 400, "context_length_exceeded"),
        BadInput("n=0", chat, j({**ok, "n": 0}), 400, "invalid_value"),
        BadInput("5 stop strings", chat, j({**ok, "stop": ["a", "b", "c", "d", "e"]}), 400, "invalid_value"),
        BadInput("prompt over the context", chat, j({**ok, "messages": msgs(long_text)}), 400,
                 "context_length_exceeded"),
        BadInput("prompt over the context (completions)", comp, j({"model": model, "prompt": long_text}), 400,
                 "context_length_exceeded"),
        BadInput("token id outside the vocabulary", comp, j({"model": model, "prompt": [1, 10**8]}), 400,
                 "invalid_value"),
        BadInput("invalid UTF-8", chat, b'{"model": ' + model_json.encode()
                 + b', "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "invalid_encoding"),
        BadInput("lone surrogate escape", chat, b'{"model": ' + model_json.encode()
                 + b', "messages": [{"role": "user", "content": "\\udc00"}]}', 400, "invalid_encoding"),
        BadInput("oversized body", chat, j({**ok, "messages": msgs("x" * (max_body_bytes + 10))}), 413,
                 "request_too_large"),
        BadInput("unknown model", chat, j({**ok, "model": "no-such-model"}), 404, "model_not_found"),
        BadInput("missing model", comp, j({"prompt": "x"}), 400, "missing_required_parameter"),
    ]


def check_bad_inputs(base_url: str, api_key: str, cases: list[BadInput], schemas: OpenAPISchemas) -> list[str]:
    """Sends every case; returns the problems (wrong status or code, not the OpenAI error shape)."""
    problems = []
    with httpx.Client(base_url=base_url, timeout=60,
                      headers={"authorization": f"Bearer {api_key}", "content-type": "application/json"}) as client:
        for case in cases:
            resp = client.post(case.path, content=case.body)
            try:
                obj = resp.json()
            except ValueError:
                problems.append(f"{case.name}: {resp.status_code}, body is not JSON: {resp.text[:200]!r}")
                continue
            if resp.status_code != case.status:
                problems.append(f"{case.name}: status {resp.status_code}, expected {case.status}: {resp.text[:300]}")
            shape = schemas.errors("ErrorResponse", obj)
            if shape:
                problems.append(f"{case.name}: not the OpenAI error shape: {shape}")
            elif obj["error"]["code"] != case.code or not obj["error"]["message"]:
                problems.append(f"{case.name}: code {obj['error']['code']!r}, expected {case.code!r}")
    return problems
