"""OpenAI response bodies and SSE events, built from what the decode nodes stream back.

Stream chunks are the hot path (one per upstream message), so each `StreamEncoder` serializes the parts
that never change within a response (id, created, model, fingerprint) once, and splices per-chunk JSON
(the text, the logprobs) between them; orjson does the escaping.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import orjson

from pdserve.frontend.models import TokenTexts
from pdserve.frontend.protocol import Kind
from pdserve.frontend.tool_calls import ToolEvent
from pdserve.rpc import pdserve_pb2 as pb

DONE = b"data: [DONE]\n\n"
# An SSE comment: sent while a stream waits, so proxies with idle timeouts keep the connection; clients
# skip comment lines.
KEEPALIVE = b": keep-alive\n\n"
# OpenAI's value for a token outside the top alternatives; also stands in for -inf, which JSON lacks.
VERY_UNLIKELY = -9999.0
_F32 = struct.Struct("<f")


def _lp(value: float) -> float:
    """A float32 logprob as the shortest decimal that maps back to the same float32 (-0.05, not
    -0.05000000074505806), clamped to VERY_UNLIKELY."""
    if not value > VERY_UNLIKELY:  # also catches NaN
        return VERY_UNLIKELY
    packed = _F32.pack(value)
    for digits in (6, 7, 8):
        short = float(f"{value:.{digits}g}")
        if _F32.pack(short) == packed:
            return short
    return value


def chat_logprobs(entries: Sequence[pb.TokenLogprob], texts: TokenTexts, top: int) -> list[dict[str, Any]]:
    """`choices[].logprobs.content` items for the chat API."""
    out: list[dict[str, Any]] = []
    for e in entries:
        tt = texts.get(e.token_id)
        alts = []
        for tid, lp in zip(e.top_token_ids[:top], e.top_logprobs[:top], strict=False):
            at = texts.get(tid)
            alts.append({"token": at.text, "logprob": _lp(lp), "bytes": at.bytes})
        out.append({"token": tt.text, "logprob": _lp(e.logprob), "bytes": tt.bytes, "top_logprobs": alts})
    return out


class LegacyLogprobs(NamedTuple):
    logprobs: dict[str, list[Any]]  # the legacy completions logprobs object
    next_offset: int  # text offset after its last token


def completion_logprobs(
    entries: Sequence[pb.TokenLogprob], texts: TokenTexts, top: int, offset: int
) -> LegacyLogprobs:
    """The legacy completions logprobs object for `entries`, with text offsets starting at `offset`."""
    tokens: list[str] = []
    token_lps: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for e in entries:
        tt = texts.get(e.token_id)
        tokens.append(tt.text)
        token_lps.append(_lp(e.logprob))
        tops.append({texts.get(t).text: _lp(lp) for t, lp in zip(e.top_token_ids[:top], e.top_logprobs[:top],
                                                                 strict=False)})
        offsets.append(offset)
        offset += len(tt.text)
    return LegacyLogprobs({"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                           "text_offset": offsets}, offset)


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               reasoning_tokens: int | None = None) -> dict[str, Any]:
    """The usage object; `reasoning_tokens` (of the completion tokens, those inside a reasoning model's
    thinking span) adds `completion_tokens_details`, left out when None (a model whose output is not split)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


class Delta(NamedTuple):
    """What one upstream message adds to its choice, rendered (`frontend.output.ChoiceOutput.take`)."""

    text: str  # content text, a completion's echo first ("" with tool-call parsing: the text is in `tools`)
    logprobs: dict[str, Any] | None  # the message's tokens' logprobs (None: not asked for, or no tokens)
    tools: list[ToolEvent] | None  # the tool-call parser's events for the text (None: no tool calls parsed)
    finish_reason: str | None  # set on the choice's last message
    reasoning: str = ""  # a reasoning model's thinking text (`frontend.reasoning`); `text` is then the content


class StreamEncoder:
    """SSE events of one streamed response. Immutable after construction."""

    def __init__(self, kind: Kind, response_id: str, created: int, model: str, fingerprint: str,
                 include_usage: bool) -> None:
        self.kind = kind
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        head = orjson.dumps({"id": response_id, "object": obj, "created": created, "model": model,
                             "system_fingerprint": fingerprint})
        # head ends with "}"; reopen it to append the choices.
        self._head = b"data: " + head[:-1] + b',"choices":['
        # Chat chunks carry "usage": null until the usage chunk, as OpenAI sends them; the legacy
        # completion object has no nullable usage, so its chunks leave the field out.
        self._tail = b'],"usage":null}\n\n' if include_usage and kind == "chat" else b"]}\n\n"
        self._usage_head = b"data: " + head[:-1] + b',"choices":[],"usage":'

    def _event(self, choice: bytes) -> bytes:
        return self._head + choice + self._tail

    def role(self, index: int) -> bytes:
        """The first chat chunk of a choice: it carries the role."""
        return self._event(b'{"index":%d,"delta":{"role":"assistant","content":""},"logprobs":null,'
                           b'"finish_reason":null}' % index)

    def text(self, index: int, text: str, logprobs: dict[str, Any] | None = None) -> bytes:
        """A chunk carrying generated text (and its tokens' logprobs when asked)."""
        lp = b"null" if logprobs is None else orjson.dumps(logprobs)
        if self.kind == "chat":
            return self._event(b'{"index":%d,"delta":{"content":%b},"logprobs":%b,"finish_reason":null}'
                               % (index, orjson.dumps(text), lp))
        return self._event(b'{"index":%d,"text":%b,"logprobs":%b,"finish_reason":null}'
                           % (index, orjson.dumps(text), lp))

    def reasoning(self, index: int, text: str, logprobs: dict[str, Any] | None = None) -> bytes:
        """A chat chunk carrying thinking text (`delta.reasoning_content`, as vLLM and DeepSeek send it)."""
        lp = b"null" if logprobs is None else orjson.dumps(logprobs)
        return self._event(b'{"index":%d,"delta":{"reasoning_content":%b},"logprobs":%b,"finish_reason":null}'
                           % (index, orjson.dumps(text), lp))

    def tool_event(self, index: int, event: ToolEvent) -> bytes:
        """A chat chunk of a tool call: its start (id, name, empty arguments) or a piece of its arguments."""
        if event.kind == "content":
            return self.text(index, event.text)
        if event.kind == "call":
            call = {"index": event.call, "id": event.call_id, "type": "function",
                    "function": {"name": event.name, "arguments": ""}}
        else:
            call = {"index": event.call, "function": {"arguments": event.text}}
        return self._event(b'{"index":%d,"delta":{"tool_calls":[%b]},"logprobs":null,"finish_reason":null}'
                           % (index, orjson.dumps(call)))

    def delta(self, index: int, delta: Delta) -> list[bytes]:
        """The chunks of one message of choice `index`: its thinking text, its text or tool-call events,
        its logprobs (with the thinking text when there is nothing else), and the finish_reason when it is
        the choice's last."""
        out: list[bytes] = []
        logprobs = delta.logprobs
        if delta.reasoning:
            alone = not delta.text and not delta.tools
            out.append(self.reasoning(index, delta.reasoning, logprobs if alone else None))
            if alone:
                logprobs = None
        if delta.tools is not None:
            out += [self.tool_event(index, e) for e in delta.tools]
            if logprobs is not None:
                out.append(self.text(index, "", logprobs))
        elif delta.text or logprobs is not None:
            out.append(self.text(index, delta.text, logprobs))
        if delta.finish_reason is not None:
            out.append(self.finish(index, delta.finish_reason))
        return out

    def finish(self, index: int, reason: str) -> bytes:
        """The last chunk of a choice: empty delta, its finish_reason."""
        if self.kind == "chat":
            return self._event(b'{"index":%d,"delta":{},"logprobs":null,"finish_reason":%b}'
                               % (index, orjson.dumps(reason)))
        return self._event(b'{"index":%d,"text":"","logprobs":null,"finish_reason":%b}'
                           % (index, orjson.dumps(reason)))

    def usage(self, usage: dict[str, Any]) -> bytes:
        """The final chunk of `stream_options.include_usage`: no choices, the request's usage."""
        return self._usage_head + orjson.dumps(usage) + b"}\n\n"


def error_event(error: dict[str, Any]) -> bytes:
    """An error after the response has started: it can only travel as an event of the stream."""
    return b"data: " + orjson.dumps(error) + b"\n\n"


def full_response(chat: bool, response_id: str, created: int, model: str, fingerprint: str,
                  choices: list[dict[str, Any]], usage: dict[str, Any]) -> bytes:
    """The JSON body of a non-streamed chat completion or (legacy) completion."""
    return orjson.dumps({"id": response_id, "object": "chat.completion" if chat else "text_completion",
                         "created": created, "model": model, "system_fingerprint": fingerprint,
                         "choices": choices, "usage": usage})
