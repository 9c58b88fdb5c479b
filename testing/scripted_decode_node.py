"""A scripted decode node: a real `DecodeNode` gRPC server that streams pre-made tokens, with no model.

A benchmark and test tool, not a serving component. It measures the frontend alone (the upstream costs
next to nothing and is perfectly repeatable), and it lets tests drive the frontend's protocol paths
(stop strings, logprobs, length and stop finishes, mid-stream failures, unreachable nodes, cancellation)
against a real gRPC upstream registered in a real etcd.

What it does per Generate call: it replies with the tokens of `--reply` (tokenized with `--tokenizer`,
or one token per word without one), one token per message, `--token-interval-ms` apart after
`--first-token-ms`; it finishes with "stop" after the reply (unless ignore_eos) or "length" at
max_tokens, applies stop strings to the text (holding back text that could still become one), returns
deterministic logprobs when asked, and rotates the reply by the seed when sampling (temperature > 0), so
seeded choices differ. A call whose seed equals `--fail-seed` fails after its second token with finish
reason "error". A request whose seed equals `--handover-seed` is handed over after its first two tokens
(finish reason HAND_OVER, as a draining node does). A resumed call (`resume_token_ids`, which must be
the script's own tokens) continues the script after them. With `--reject` every Generate call is
refused with UNAVAILABLE. KV blocks are
accounted as a node would (prompt + generated tokens, in blocks) and freed when a request ends or is
cancelled, so the load records show what a disconnect frees.

`--num-nodes N` runs N decode nodes in one process (ids `<node-id>-<i>`, consecutive ports);
`--prefill-ids a,b` also registers scripted prefill records (at the first node's address) so the
frontend's prefill routing and readiness can be exercised. `--http-port` serves the same script over
an OpenAI-compatible HTTP API (`/v1/chat/completions`, `/v1/models`), as the upstream of baseline
proxies such as litellm.

    python -m testing.scripted_decode_node --etcd 127.0.0.1:2379 --model tiny-llama --grpc-port 50100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.registry import NodeCapacity, NodeLoad, NodeRecord, NodeRegistration  # noqa: E402
from pdserve.rpc import pdserve_pb2 as pb  # noqa: E402
from pdserve.rpc import pdserve_pb2_grpc as pbg  # noqa: E402
from pdserve.rpc.enums import finish_reason_value  # noqa: E402

log = logging.getLogger("scripted_decode_node")
DEFAULT_REPLY = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow."
)


@dataclass(frozen=True)
class Script:
    """The reply every request gets: token ids and the text piece each token releases."""

    token_ids: tuple[int, ...]
    pieces: tuple[str, ...]

    @classmethod
    def build(cls, reply: str, tokenizer_dir: str | None) -> Script:
        if tokenizer_dir is None:
            words = reply.split(" ")
            return cls(tuple(1000 + i for i in range(len(words))),
                       tuple(w if i == 0 else " " + w for i, w in enumerate(words)))
        import tokenizers

        tok = tokenizers.Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        ids = tok.encode(reply, add_special_tokens=False).ids
        pieces, prev = [], ""
        for i in range(len(ids)):
            text = tok.decode(ids[: i + 1])
            pieces.append(text[len(prev):])
            prev = text
        return cls(tuple(ids), tuple(pieces))


@dataclass(frozen=True)
class ScriptConfig:
    reply_tokens: int  # natural reply length before "stop"
    first_token_s: float
    token_interval_s: float
    fail_seed: int | None
    handover_seed: int | None
    reject: bool
    block_size: int
    num_kv_blocks: int


@dataclass(eq=False)
class Active:
    """One request being generated."""

    prompt_tokens: int
    generated: int = 0
    task: asyncio.Task[Any] | None = None


@dataclass(eq=False)
class Counters:
    generate_calls: int = 0
    finished: int = 0
    aborted: int = 0  # ended by cancellation or Abort before finishing
    last_abort_at: float = 0.0  # unix seconds


def _hold_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class ScriptedDecodeNode(pbg.DecodeNodeServicer):
    """Streams the script for every Generate call (changes only its own counters and active set)."""

    def __init__(self, node_id: str, script: Script, cfg: ScriptConfig) -> None:
        self.node_id = node_id
        self.script = script
        self.cfg = cfg
        self.active: dict[str, Active] = {}
        self.counters = Counters()

    def blocks_used(self) -> int:
        bs = self.cfg.block_size
        return sum(math.ceil((a.prompt_tokens + a.generated) / bs) for a in self.active.values())

    def load(self) -> NodeLoad:
        used = self.blocks_used()
        return NodeLoad(queue_len=0, running=len(self.active), kv_blocks_used=used,
                        kv_blocks_free=max(0, self.cfg.num_kv_blocks - used), kv_blocks_total=self.cfg.num_kv_blocks,
                        in_flight=len(self.active))

    def _logprob(self, token_id: int, position: int, k: int) -> pb.TokenLogprob:
        ids = self.script.token_ids
        alts = [ids[(position + j) % len(ids)] for j in range(1, k + 1)]
        lp = -0.05 - 0.1 * (position % 5)
        return pb.TokenLogprob(token_id=token_id, logprob=lp, top_token_ids=[token_id, *alts][:k],
                               top_logprobs=[lp - 0.5 * j for j in range(k)])

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        self.counters.generate_calls += 1
        if self.cfg.reject:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"scripted node {self.node_id} rejects requests")
        p = request.params
        offset = (p.seed if p.HasField("seed") else 0) % len(self.script.token_ids) if p.temperature > 0 else 0
        ids = self.script.token_ids
        expected = [ids[(offset + j) % len(ids)] for j in range(len(request.resume_token_ids))]
        if list(request.resume_token_ids) != expected:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"resume_token_ids {list(request.resume_token_ids)} "
                                f"are not the script's {expected}")
        rid = request.request_id
        entry = Active(len(request.prompt_token_ids), task=asyncio.current_task())
        self.active[rid] = entry
        finished = False
        try:
            async for msg in self._script(request, entry):
                finished = finished or msg.finished
                yield msg
        finally:
            self.active.pop(rid, None)
            if finished:
                self.counters.finished += 1
            else:
                self.counters.aborted += 1
                self.counters.last_abort_at = time.time()

    async def _script(self, request: pb.GenerateRequest, entry: Active):
        p = request.params
        ids, pieces = self.script.token_ids, self.script.pieces
        offset = (p.seed if p.HasField("seed") else 0) % len(ids) if p.temperature > 0 else 0
        k = p.logprobs if p.HasField("logprobs") else None
        stops = list(p.stop)
        natural = self.cfg.reply_tokens
        start = len(request.resume_token_ids)  # a resumed call continues the script after these
        text = "".join(pieces[(offset + j) % len(ids)] for j in range(start))
        released = request.resume_text_chars
        seed = p.seed if p.HasField("seed") else None
        t0 = time.perf_counter()
        if self.cfg.first_token_s:
            await asyncio.sleep(self.cfg.first_token_s)  # the scripted time to first token
        for i in range(start, p.max_tokens):
            if i > start and self.cfg.token_interval_s:
                await asyncio.sleep(self.cfg.token_interval_s)  # the scripted time between tokens
            pos = (offset + i) % len(ids)
            tid = ids[pos]
            entry.generated = i + 1
            text += pieces[pos]
            msg = pb.GenerateResponse(request_id=request.request_id, token_ids=[tid])
            if k is not None:
                msg.logprobs.append(self._logprob(tid, pos, k))
            if i == start:
                msg.timing.CopyFrom(pb.Timing(prefill_s=time.perf_counter() - t0))
                msg.prefill_node_id = request.prefill_node_id or self.node_id
                msg.decode_node_id = self.node_id
                msg.serving_path = pb.SERVING_PATH_DISAGGREGATED if request.prefill_node_id else pb.SERVING_PATH_LOCAL_PREFILL
                msg.num_prompt_tokens = len(request.prompt_token_ids)
            reason, stop_reason = "", ""
            hits = [(text.find(s, max(0, released - len(s))), s) for s in stops]
            hits = [(at, s) for at, s in hits if at >= 0]
            if hits:
                at, stop_reason = min(hits)
                text, reason = text[:at], "stop"
            elif self.cfg.fail_seed is not None and seed == self.cfg.fail_seed and i == start + 1:
                msg.finished, msg.finish_reason, msg.error = True, pb.FINISH_REASON_ERROR, "scripted failure"
                yield msg
                return
            elif i + 1 >= natural and not p.ignore_eos:
                reason, stop_reason = "stop", "<eos>"
            elif i + 1 >= p.max_tokens:
                reason = "length"
            elif self.cfg.handover_seed is not None and seed == self.cfg.handover_seed and start == 0 and i == 1:
                reason = "hand_over"  # the drain hand-over: this token is delivered, the rest comes elsewhere
            held = 0 if reason in ("stop", "length") else _hold_back(text[released:], stops)
            end = len(text) - held
            msg.text, released = text[released:end], max(released, end)
            if reason:
                msg.finished, msg.finish_reason, msg.stop_reason = True, finish_reason_value(reason), stop_reason
                msg.num_prompt_tokens = len(request.prompt_token_ids)
                msg.num_completion_tokens = i + 1
                msg.decode_node_id = self.node_id
                msg.prefill_node_id = request.prefill_node_id or self.node_id
            yield msg
            if reason:
                return

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:  # noqa: N802
        entry = self.active.get(request.request_id)
        if entry is not None and entry.task is not None:
            entry.task.cancel()
        return pb.AbortResponse(found=entry is not None)

    async def GetLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:  # noqa: N802
        used = self.blocks_used()
        return pb.LoadResponse(node_id=self.node_id, role="decode", waiting=0, running=len(self.active),
                               kv_blocks_total=self.cfg.num_kv_blocks, kv_blocks_used=used,
                               kv_blocks_free=max(0, self.cfg.num_kv_blocks - used))


# --- OpenAI-compatible HTTP face (for baseline proxies) ------------------------------------------


@dataclass(eq=False)
class HttpScript:
    """A raw ASGI app streaming the same script as OpenAI chat completions."""

    script: Script
    cfg: ScriptConfig
    model: str

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if scope["path"].endswith("/models"):
            await _send_json(send, {"object": "list", "data": [
                {"id": self.model, "object": "model", "created": 0, "owned_by": "scripted"}]})
            return
        req = json.loads(body or b"{}")
        max_tokens = int(req.get("max_tokens") or req.get("max_completion_tokens") or self.cfg.reply_tokens)
        n = min(max_tokens, self.cfg.reply_tokens)
        rid = "chatcmpl-" + uuid.uuid4().hex
        head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model}
        pieces = self.script.pieces
        if not req.get("stream"):
            if self.cfg.first_token_s:
                await asyncio.sleep(self.cfg.first_token_s)  # the scripted time to first token
            if self.cfg.token_interval_s and n > 1:
                await asyncio.sleep(self.cfg.token_interval_s * (n - 1))  # the scripted time of the rest
            text = "".join(pieces[i % len(pieces)] for i in range(n))
            await _send_json(send, {**head, "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                 "finish_reason": "length" if n == max_tokens else "stop"}],
                "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        if self.cfg.first_token_s:
            await asyncio.sleep(self.cfg.first_token_s)  # the scripted time to first token
        for i in range(n):
            if i and self.cfg.token_interval_s:
                await asyncio.sleep(self.cfg.token_interval_s)  # the scripted time between tokens
            delta: dict[str, Any] = {"content": pieces[i % len(pieces)]}
            if i == 0:
                delta["role"] = "assistant"
            chunk = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
            await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(chunk) + b"\n\n",
                        "more_body": True})
        last = {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length" if n == max_tokens else "stop"}]}
        usage = {**head, "choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}}
        tail = b"data: " + orjson.dumps(last) + b"\n\n"
        if (req.get("stream_options") or {}).get("include_usage"):
            tail += b"data: " + orjson.dumps(usage) + b"\n\n"
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False})


async def _send_json(send: Any, obj: Any) -> None:
    body = orjson.dumps(obj)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# --- process ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class Running:
    servers: list[grpc.aio.Server] = field(default_factory=list)
    registrations: list[NodeRegistration] = field(default_factory=list)


def _record(role: str, node_id: str, args: argparse.Namespace, address: str) -> NodeRecord:
    return NodeRecord(role=role, node_id=node_id, cluster=args.cluster, grpc_address=address,  # type: ignore[arg-type]
                      kv_address="127.0.0.1:1", model=args.model, model_fingerprint=args.fingerprint,
                      dtype="float32", block_size=args.block_size, prefix_hash_seed=args.prefix_hash_seed,
                      capacity=NodeCapacity(num_kv_blocks=args.kv_blocks, max_num_seqs=args.max_num_seqs,
                                            max_num_batched_tokens=2048))


async def run(args: argparse.Namespace) -> None:
    script = Script.build(args.reply, args.tokenizer)
    cfg = ScriptConfig(reply_tokens=args.reply_tokens or len(script.token_ids),
                       first_token_s=args.first_token_ms / 1e3, token_interval_s=args.token_interval_ms / 1e3,
                       fail_seed=args.fail_seed, handover_seed=args.handover_seed, reject=args.reject, block_size=args.block_size,
                       num_kv_blocks=args.kv_blocks)
    state = Running()
    addresses = []
    for i in range(args.num_nodes):
        node_id = args.node_id if args.num_nodes == 1 else f"{args.node_id}-{i}"
        node = ScriptedDecodeNode(node_id, script, cfg)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pbg.add_DecodeNodeServicer_to_server(node, server)
        port = server.add_insecure_port(f"127.0.0.1:{args.grpc_port + i if args.grpc_port else 0}")
        await server.start()
        state.servers.append(server)
        address = f"127.0.0.1:{port}"
        addresses.append(address)
        if args.etcd:
            reg = NodeRegistration(args.etcd, _record("decode", node_id, args, address), node.load, ttl_s=2,
                                   load_interval_s=args.load_interval)
            await reg.start()
            state.registrations.append(reg)
        print(f"scripted decode node {node_id} grpc {address}", flush=True)
    if args.etcd:
        for pid in filter(None, args.prefill_ids.split(",")):
            reg = NodeRegistration(args.etcd, _record("prefill", pid, args, addresses[0]),
                                   lambda: NodeLoad(), ttl_s=2, load_interval_s=args.load_interval)
            await reg.start()
            state.registrations.append(reg)
            print(f"scripted prefill record {pid}", flush=True)
    http_task = None
    if args.http_port:
        import uvicorn

        http = uvicorn.Server(uvicorn.Config(HttpScript(script, cfg, args.model), host="127.0.0.1",
                                             port=args.http_port, log_level="warning", access_log=False))
        http.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        http_task = asyncio.ensure_future(http.serve())
        print(f"scripted OpenAI HTTP on http://127.0.0.1:{args.http_port}/v1", flush=True)
    print("ready", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for reg in state.registrations:
        await reg.close()
    for server in state.servers:
        await server.stop(grace=0.5)
    if http_task is not None:
        http_task.cancel()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="scripted DecodeNode (benchmark and test tool; no model)")
    p.add_argument("--etcd", action="append", default=[], help="etcd endpoint; without it nothing is registered")
    p.add_argument("--cluster", default="default")
    p.add_argument("--model", default="tiny-llama", help="pool model name to register under")
    p.add_argument("--node-id", default="scripted-decode")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--grpc-port", type=int, default=0, help="first gRPC port (0: any free port)")
    p.add_argument("--http-port", type=int, default=0, help="also serve the script as OpenAI HTTP on this port")
    p.add_argument("--prefill-ids", default="", help="comma-separated scripted prefill records to register")
    p.add_argument("--tokenizer", default=None, help="model directory whose tokenizer.json tokenizes the reply")
    p.add_argument("--reply", default=DEFAULT_REPLY)
    p.add_argument("--reply-tokens", type=int, default=0, help="natural reply length (0: the reply's tokens)")
    p.add_argument("--first-token-ms", type=float, default=0.0)
    p.add_argument("--token-interval-ms", type=float, default=0.0)
    p.add_argument("--fail-seed", type=int, default=None)
    p.add_argument("--handover-seed", type=int, default=None)
    p.add_argument("--reject", action="store_true", help="refuse every Generate call with UNAVAILABLE")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefix-hash-seed", type=int, default=0)
    p.add_argument("--kv-blocks", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--fingerprint", default="scripted0000000000")
    p.add_argument("--load-interval", type=float, default=0.2, help="seconds between load reports")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        import uvloop

        uvloop.run(run(args))
    except ImportError:
        asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
