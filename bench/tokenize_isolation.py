"""Does tokenizing long prompts stall other requests' streams? Inter-token latency (ITL) p99 of 16
streams, alone and while 4 other clients keep sending 8k-token chat prompts, through one frontend in
front of a real local cluster (etcd, one prefill and one decode node running the tiny llama with its
declared context raised to 16k positions). Target: loaded p99 within 20% of the unloaded p99.

What is measured is the frontend: its event loop relays every stream's tokens while its prepare workers
parse, render and tokenize the long prompts. So by default (`--heavy-mode refused`) the heavy clients
ask for `max_tokens` equal to the whole context: the frontend does all of a request's preparation (the
body, the chat template, ~8k tokens) and then answers 400 context_length_exceeded, and the nodes see
nothing of them. Each of the 4 clients sends its next prompt as soon as the last is answered, which makes
far more tokenization than 4 clients of a serving cluster could cause (~80-100 prompts/s here).
`--heavy-mode served` serves them instead (`max_tokens: 1`, each client repeating its prompt so the
prefill node answers from its prefix cache); on this machine the nodes then share the same two cores with
the heavy requests' prefill and transfer work, which a deployment runs on other hosts, so that figure
measures CPU sharing between nodes rather than the frontend.

The heavy clients run in a process of their own at nice 19, standing for clients on other machines: their
JSON encoding and sends must neither delay the measuring loop's reads (ITL is taken at the client) nor
take CPU from the cluster. The same loaded run against a frontend started with `--prepare-inline-bytes`
above every body (tokenizing on the event loop, as it used to) is the baseline.

    .venv/bin/python bench/tokenize_isolation.py [--seconds 20] [--streams 16] [--heavy 4] [--prompt-tokens 8000]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pdserve.engine.tiny import default_model_dir  # noqa: E402
from pdserve.engine.tokenizer import Tokenizer  # noqa: E402
from pdserve.registry.etcd_server import free_port  # noqa: E402
from testing.cluster import LocalCluster  # noqa: E402
from testing.http_load import CallResult, long_context_copy, percentile, stream_chat  # noqa: E402
from testing.procs import FrontendProc, start_frontend  # noqa: E402

MODEL = "tiny"
CONTEXT = 16384  # the tiny llama's declared context, raised to fit the heavy prompts
WORDS = ("river stone lantern copper meadow quiet harbor velvet signal orchard ember falcon granite "
         "thimble compass saffron willow marble cinder pebble").split()


@dataclass(eq=False)
class Phase:
    itls: list[float] = field(default_factory=list)
    streams: int = 0
    heavy_done: int = 0
    heavy_failed: int = 0
    seconds: float = 0.0

    def p99_ms(self) -> float:
        return percentile(self.itls, 0.99) * 1e3

    def p50_ms(self) -> float:
        return percentile(self.itls, 0.5) * 1e3


def heavy_text(tok: Tokenizer, client: int, tokens: int) -> str:
    """A text of about `tokens` tokens, different for every client."""
    words = [f"client{client}"] + [WORDS[(i * 7 + client) % len(WORDS)] for i in range(tokens)]
    text = " ".join(words)
    while len(tok.encode(text, add_special_tokens=False)) > tokens - 16:
        words = words[: int(len(words) * 0.97)]
        text = " ".join(words)
    return text


def _heavy_process(url: str, texts: list[str], max_tokens: int, stop: Any, counts: Any) -> None:
    """The heavy clients, in a process of their own: their JSON encoding and sends must not delay the
    measuring loop's reads (the ITL is taken at the client)."""
    os.nice(19)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=300) as client:

            async def one(text: str) -> None:
                body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
                while not stop.is_set():
                    resp = await client.post(url, json=body)
                    expected = resp.status_code == 200 if max_tokens == 1 else _too_long(resp)
                    with counts.get_lock():
                        counts[0 if expected else 1] += 1
                    if not expected:
                        await asyncio.sleep(0.05)

            await asyncio.gather(*(one(t) for t in texts))

    asyncio.run(main())


def _too_long(resp: httpx.Response) -> bool:
    """A 400 context_length_exceeded: the frontend parsed, templated and tokenized the whole prompt."""
    return resp.status_code == 400 and resp.json().get("error", {}).get("code") == "context_length_exceeded"


async def run_phase(url: str, seconds: float, streams: int, heavy: list[str], stream_tokens: int,
                    heavy_max_tokens: int = 1) -> Phase:
    phase = Phase()
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams)
    ctx = multiprocessing.get_context("spawn")
    stop, counts = ctx.Event(), ctx.Array("l", 2)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def streamer(i: int) -> None:
            deadline = time.monotonic() + seconds
            k = 0
            while time.monotonic() < deadline:
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"stream {i} round {k}"}],
                        "max_tokens": stream_tokens, "temperature": 0, "ignore_eos": True}
                r: CallResult = await stream_chat(client, url, body)
                if r.status != 200 or r.error or r.transport_error:
                    raise RuntimeError(f"stream {i} failed: {r.status} {r.error} {r.transport_error}")
                phase.itls += r.itls
                phase.streams += 1
                k += 1

        start = time.monotonic()
        proc = ctx.Process(target=_heavy_process, args=(url, heavy, heavy_max_tokens, stop, counts), daemon=True) if heavy else None
        if proc is not None:
            proc.start()
        try:
            await asyncio.gather(*(streamer(i) for i in range(streams)))
        finally:
            stop.set()
            if proc is not None:
                await asyncio.to_thread(proc.join, 120)
        phase.seconds = time.monotonic() - start
        phase.heavy_done, phase.heavy_failed = counts[0], counts[1]
    return phase


def report(name: str, phase: Phase, unloaded: Phase | None) -> None:
    ratio = "" if unloaded is None else f"  ratio {phase.p99_ms() / unloaded.p99_ms():.2f}"
    heavy = f"  heavy prompts {phase.heavy_done / phase.seconds:5.1f}/s" if phase.heavy_done else ""
    print(f"{name:>34}: ITL p50 {phase.p50_ms():6.1f} ms  p99 {phase.p99_ms():6.1f} ms{ratio}"
          f"  ({len(phase.itls)} gaps, {phase.streams} streams){heavy}", flush=True)


def warm_up(url: str, heavy: list[str]) -> None:
    """Every heavy prompt once (the prefill node caches its prefix, so measured repeats cost the nodes
    little), then a short stream phase (threads, channels)."""
    with httpx.Client(timeout=600) as client:
        for text in heavy:
            resp = client.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": text}],
                                          "max_tokens": 1})
            resp.raise_for_status()
    asyncio.run(run_phase(url, 1.0, 2, [], 8))


def start_fe(tmp: Path, cluster: LocalCluster, model: Path, name: str, *extra: str) -> FrontendProc:
    return start_frontend(name, tmp, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                          "--model", f"{MODEL}={model}", "--request-log", "off", "--log-level", "warning", *extra)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each measured phase")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--heavy", type=int, default=4, help="clients sending long prompts")
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--stream-tokens", type=int, default=200, help="max_tokens of each measured stream")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per node")
    parser.add_argument("--no-baseline", action="store_true", help="skip the tokenize-on-the-loop baseline")
    parser.add_argument("--heavy-mode", choices=("refused", "served"), default="refused",
                        help="refused: the heavy prompts are tokenized and then refused as too long for the "
                        "context (the frontend's work alone); served: they are served with max_tokens 1")
    args = parser.parse_args(argv)
    heavy_max_tokens = 1 if args.heavy_mode == "served" else CONTEXT

    with tempfile.TemporaryDirectory(prefix="tokenize-isolation-") as tmpdir:
        tmp = Path(tmpdir)
        model = long_context_copy(default_model_dir("llama"), tmp / "model", CONTEXT)
        tok = Tokenizer(model)
        heavy = [heavy_text(tok, i, args.prompt_tokens) for i in range(args.heavy)]
        lengths = [len(tok.encode_chat([{"role": "user", "content": t}])) for t in heavy]
        if lengths:
            print(f"heavy prompts: {min(lengths)}..{max(lengths)} tokens", flush=True)
        node_args = ["--dtype", "float32", "--num-threads", str(args.threads), "--num-kv-blocks", "4096",
                     "--block-size", "16", "--max-num-batched-tokens", "8192", "--model-name", MODEL]
        with LocalCluster(tmp / "cluster", model, node_args=node_args) as cluster:
            cluster.start(1, 1)
            fe = start_fe(tmp, cluster, model, "frontend")
            url = f"{fe.base_url}/v1/chat/completions"
            try:
                warm_up(url, heavy)
                unloaded = asyncio.run(run_phase(url, args.seconds, args.streams, [], args.stream_tokens))
                report("unloaded", unloaded, None)
                loaded = asyncio.run(run_phase(url, args.seconds, args.streams, heavy, args.stream_tokens,
                                               heavy_max_tokens))
                report(f"{args.heavy} clients x {args.prompt_tokens}-token prompts", loaded, unloaded)
            finally:
                fe.stop()
            if not args.no_baseline:
                fe = start_fe(tmp, cluster, model, "frontend-inline", "--prepare-inline-bytes", str(1 << 30))
                url = f"{fe.base_url}/v1/chat/completions"
                try:
                    warm_up(url, heavy)
                    base_unloaded = asyncio.run(run_phase(url, args.seconds, args.streams, [],
                                                          args.stream_tokens))
                    report("baseline (tokenize on the loop)", base_unloaded, None)
                    base = asyncio.run(run_phase(url, args.seconds, args.streams, heavy, args.stream_tokens,
                                                heavy_max_tokens))
                    report("baseline, loaded", base, base_unloaded)
                finally:
                    fe.stop()
        ratio = loaded.p99_ms() / unloaded.p99_ms()
        print(f"ITL p99 unloaded {unloaded.p99_ms():.1f} ms, loaded {loaded.p99_ms():.1f} ms: ratio {ratio:.2f} "
              f"(target <= 1.20: {'met' if ratio <= 1.2 else 'NOT met'})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
