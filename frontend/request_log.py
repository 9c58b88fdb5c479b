"""The request log: one JSON object per line and per request, written when the request ends.

Fields: ts, request_id (the response id), client_request_id, tenant, endpoint, model (served),
requested_model, status, finish_reasons, prompt_tokens, completion_tokens, cached_tokens, batch (a line
of a /v1/batches job), cost_usd (what the request was charged: `frontend.job.cost`, the usage at the
models file's prices; 0.0 for a refusal), ttft_ms,
e2e_ms, tpot_ms, itl_p50_ms, itl_max_ms, waterfall_ms (the stages on one time line:
`frontend.accounting.waterfall`), stream, n, sampling (the sampling parameters the request set,
no text: `stop` is only true/absent), routes (per choice: decode/prefill node, reason, upstream timing
breakdown), error, error_code and error_type (the OpenAI error's code and type; status is its HTTP status), trace_id (the request's trace when tracing is on, else null); and
`prompt` only when prompt logging is on.
"""

from __future__ import annotations

import sys
from typing import IO, Any

import orjson


class RequestLog:
    """Appends JSON lines to stderr ("-"), a file, or nowhere (None)."""

    def __init__(self, target: str | None) -> None:
        self._own = False
        self._out: IO[bytes] | None
        if target is None:
            self._out = None
        elif target == "-":
            self._out = sys.stderr.buffer
        else:
            self._out = open(target, "ab", buffering=0)  # noqa: SIM115 - held for the process's life
            self._own = True

    def write(self, record: dict[str, Any]) -> None:
        """Writes one record as one line (a single write call, so concurrent writers do not interleave)."""
        if self._out is None:
            return
        self._out.write(orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE))
        if not self._own:
            self._out.flush()

    def close(self) -> None:
        if self._own and self._out is not None:
            self._out.close()
        self._out = None
