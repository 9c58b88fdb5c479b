"""The Responses API's output side: one choice's deltas become a Response object and its stream events.

`ResponseOutput` takes the same `Delta`s a chat choice renders (`frontend.output.ChoiceOutput`) and
builds the output items from them as they come: a `reasoning` item for the thinking span, a `message`
item with one `output_text` part for the content, a `function_call` item per tool call. A streamed
response sends each step as its event (with a `sequence_number`); a whole one keeps only the items. The
final Response object is the same either way, so the text a client assembles from the events is the
final response's.

Events, in order: `response.created`, `response.in_progress`; per item `response.output_item.added`,
then for a message `response.content_part.added`, `response.output_text.delta`…, `.done`,
`response.content_part.done` (reasoning: `response.reasoning_text.delta`/`.done`; a call:
`response.function_call_arguments.delta`/`.done`), `response.output_item.done`; last
`response.completed`, `response.incomplete` (its reason) or `response.failed` (its error).
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from pdserve.frontend.render import Delta
from pdserve.frontend.responses import ResponsesRequest, new_item_id

TERMINAL = ("completed", "incomplete", "failed", "cancelled")


def sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def response_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A chat usage object in the Responses API's terms."""
    details = usage.get("completion_tokens_details") or {}
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"],
            # Written: the prompt tokens computed this time, whose KV the prefix cache keeps from now on.
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": usage["prompt_tokens"] - cached},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": usage["total_tokens"]}


def response_object(rid: str, created_at: float, model: str, rreq: ResponsesRequest, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None, incomplete: str | None = None,
                    dropped: int = 0) -> dict[str, Any]:
    """The Response object (the fields the request set repeated as sent)."""
    obj: dict[str, Any] = {
        "id": rid, "object": "response", "created_at": int(created_at), "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "background": rreq.background, "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": rreq.instructions, "metadata": rreq.metadata, "model": model, "output": output,
        "previous_response_id": rreq.previous_response_id, "store": rreq.store, "truncation": rreq.truncation,
        "service_tier": "default", **{k: v for k, v in rreq.echo.items() if v is not None},
    }
    if usage is not None:
        obj["usage"] = usage
    if dropped:
        obj["truncated_input_items"] = dropped  # truncation "auto" dropped this many of the oldest messages
    return obj


class ResponseOutput:
    """The output items of one response, built from its choice's deltas (changed by `take` and `finish`).

    Content that is only whitespace next to tool calls is not an item (as chat completions drops it), so
    content text is held until it says something."""

    def __init__(self, rid: str, created_at: float, model: str, rreq: ResponsesRequest, stream: bool) -> None:
        self.rid, self.created_at, self.model, self.rreq = rid, created_at, model, rreq
        self.items: list[dict[str, Any]] = []
        self._stream = stream
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the item being written
        self._calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its function_call item
        self._held = ""  # whitespace content not yet shown

    # --- events ---

    def _event(self, out: list[bytes], kind: str, **fields: Any) -> None:
        if self._stream:
            out.append(sse({"type": kind, "sequence_number": self._seq, **fields}))
            self._seq += 1

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def start(self, status: str = "in_progress") -> list[bytes]:
        """response.created and response.in_progress."""
        out: list[bytes] = []
        self._event(out, "response.created", response=self.response(status))
        self._event(out, "response.in_progress", response=self.response(status))
        return out

    def _add(self, out: list[bytes], item: dict[str, Any]) -> dict[str, Any]:
        self._close(out)
        self.items.append(item)
        self._open = item
        self._event(out, "response.output_item.added", output_index=len(self.items) - 1, item=_copy(item))
        if item["type"] == "message":
            self._event(out, "response.content_part.added", **self._where(item), content_index=0,
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        elif item["type"] == "reasoning":
            self._event(out, "response.content_part.added", **self._where(item), content_index=0,
                        part={"type": "reasoning_text", "text": ""})
            item["content"].append({"type": "reasoning_text", "text": ""})
        return item

    def _close(self, out: list[bytes]) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        where = self._where(item)
        if item["type"] == "message":
            part = item["content"][0]
            self._event(out, "response.output_text.done", **where, content_index=0, text=part["text"],
                        logprobs=part["logprobs"])
            self._event(out, "response.content_part.done", **where, content_index=0, part=dict(part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            self._event(out, "response.reasoning_text.done", **where, content_index=0, text=part["text"])
            self._event(out, "response.content_part.done", **where, content_index=0, part=dict(part))
        else:
            self._event(out, "response.function_call_arguments.done", **where, name=item["name"],
                        arguments=item["arguments"])
        item["status"] = "completed"
        self._event(out, "response.output_item.done", output_index=where["output_index"], item=_copy(item))

    # --- what a delta adds ---

    def _reasoning(self, out: list[bytes], text: str) -> None:
        item = self._open
        if item is None or item["type"] != "reasoning":
            item = self._add(out, {"type": "reasoning", "id": new_item_id("rs"), "summary": [], "content": [],
                                   "status": "in_progress"})
        item["content"][0]["text"] += text
        self._event(out, "response.reasoning_text.delta", **self._where(item), content_index=0, delta=text)

    def _text(self, out: list[bytes], text: str, logprobs: list[dict[str, Any]] | None, force: bool = False) -> None:
        item = self._open
        if item is None or item["type"] != "message":
            if not force and not (self._held + text).strip() and not logprobs:
                self._held += text
                return
            item = self._add(out, {"type": "message", "id": new_item_id("msg"), "role": "assistant",
                                   "status": "in_progress", "content": []})
        text, self._held = self._held + text, ""
        part = item["content"][0]
        part["text"] += text
        lp = logprobs or []
        part["logprobs"].extend(lp)
        if text or lp:
            self._event(out, "response.output_text.delta", **self._where(item), content_index=0, delta=text,
                        logprobs=lp)

    def take(self, delta: Delta) -> list[bytes]:
        """The events of one delta of the choice (none when not streamed)."""
        out: list[bytes] = []
        reasoning = getattr(delta, "reasoning", "")
        if reasoning:
            self._reasoning(out, reasoning)
        lp = delta.logprobs["content"] if delta.logprobs is not None else None
        if delta.tools is None:
            if delta.text or lp:
                self._text(out, delta.text, lp)
            return out
        for e in delta.tools:
            if e.kind == "content":
                self._text(out, e.text, None)
            elif e.kind == "call":
                self._held = ""
                self._calls[e.call] = self._add(out, {"type": "function_call", "id": new_item_id("fc"),
                                                      "call_id": e.call_id, "name": e.name, "arguments": "",
                                                      "status": "in_progress"})
            else:
                item = self._calls[e.call]
                item["arguments"] += e.text
                self._event(out, "response.function_call_arguments.delta", **self._where(item), delta=e.text)
        if lp:
            self._text(out, "", lp)
        return out

    def finish(self, status: str, usage: dict[str, Any] | None, error: dict[str, Any] | None = None,
               incomplete: str | None = None, dropped: int = 0) -> list[bytes]:
        """Closes the open item and ends the response: the last event (completed, incomplete or failed)."""
        assert status in TERMINAL, status
        out: list[bytes] = []
        if status != "failed" and not any(i["type"] in ("message", "function_call") for i in self.items):
            self._text(out, "", None, force=True)  # always an answer: an empty message at least
        self._close(out)
        self.final = self.response(status, usage, error, incomplete, dropped)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete",
                "failed": "response.failed", "cancelled": "response.failed"}[status]
        self._event(out, kind, response=self.final)
        return out

    def response(self, status: str, usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None,
                 incomplete: str | None = None, dropped: int = 0) -> dict[str, Any]:
        return response_object(self.rid, self.created_at, self.model, self.rreq, status, [_copy(i) for i in self.items],
                               usage, error, incomplete, dropped)

    def context(self) -> list[dict[str, Any]]:
        """The output as chat messages (what the next turn of the conversation shows the model)."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        message: dict[str, Any] = {"role": "assistant", "content": text}  # as parse_messages cleans a chat turn
        if calls:
            message["tool_calls"] = calls
        return [message]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return orjson.loads(orjson.dumps(item))
