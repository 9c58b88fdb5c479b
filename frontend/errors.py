"""Errors as the OpenAI API reports them: `{"error": {"message", "type", "param", "code"}}` plus a status.

Every failure the frontend can detect is raised as an `APIError` and rendered by `error_body`; nothing
else reaches the client, so a client always gets the OpenAI error shape (the SDKs pick their exception
class from the status and read `message`, `type`, `param` and `code`).
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
PERMISSION = "permission_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
QUOTA = "insufficient_quota"
SERVER = "server_error"
OVERLOADED = "overloaded_error"


def _rebuild_api_error(status: int, message: str, type: str, param: str | None, code: str | None,  # noqa: A002
                       headers: dict[str, str], limit: str | None) -> APIError:
    return APIError(status, message, type=type, param=param, code=code, headers=headers, limit=limit)


class APIError(Exception):
    """A request failure with its HTTP status and OpenAI error fields (`param`, `code`: str or None)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,  # noqa: A002 - the OpenAI field is called "type"
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        limit: str | None = None,  # which tenant limit refused it (rpm/input_tpm/...), for metering only
    ) -> None:
        super().__init__(message)
        self.limit = limit
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers: dict[str, str] = dict(headers or {})
        self.trace_id: str | None = None  # set once the error belongs to a traced request

    def __reduce__(self) -> tuple[object, ...]:
        # Raised in `frontend.workers` processes and pickled back; Exception's default would call
        # APIError(message) alone.
        return (_rebuild_api_error, (self.status, self.message, self.type, self.param, self.code, self.headers,
                                     self.limit))

    def to_dict(self) -> dict[str, dict[str, str | None]]:
        message = self.message if self.trace_id is None else f"{self.message} (trace id {self.trace_id})"
        return {"error": {"message": message, "type": self.type, "param": self.param, "code": self.code}}

    def body(self) -> bytes:
        return orjson.dumps(self.to_dict())


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def invalid_type(param: str, expected: str, value: object) -> APIError:
    return APIError(
        400,
        f"Invalid type for '{param}': expected {expected}, but got {json_type_name(value)} instead.",
        param=param,
        code="invalid_type",
    )


def missing_parameter(param: str) -> APIError:
    return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")


def invalid_value(param: str, message: str) -> APIError:
    return APIError(400, f"Invalid value for '{param}': {message}", param=param, code="invalid_value")


def json_type_name(value: object) -> str:
    """How a JSON value's type is named in error messages ("a string", "an integer", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
