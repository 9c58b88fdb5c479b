"""Do priority classes keep interactive TTFT within its SLO while batch work absorbs the queueing?

A real local cluster (etcd, 1 prefill + 1 decode node, the frontend) is overloaded by closed-loop batch
clients (long prompts, longer outputs) while interactive clients arrive open-loop (Poisson) with short
chats. The same load runs twice in one process: first with every request at the same priority (the
baseline: one FIFO queue), then with the batch clients sending `"priority": "batch"`. Printed: interactive
and batch TTFT p50/p90, the share of interactive requests within the TTFT SLO, batch throughput, and
interactive p90 with priorities over the baseline's.

    .venv/bin/python bench/priority.py [--model tiny] [--seconds 30] [--batch-clients 24]
        [--interactive-rate 1.0] [--ttft-slo 2.0] [--max-num-seqs 8]
"""

from __future__ import annotations

import argparse
import asyncio
import random
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

from pdserve.engine.default_model import resolve_model  # noqa: E402
from pdserve.registry.etcd_server import free_port  # noqa: E402
from testing.cluster import LocalCluster  # noqa: E402
from testing.http_load import CallResult, percentile, stream_chat  # noqa: E402
from testing.procs import start_frontend  # noqa: E402

WORDS = "river stone lantern copper meadow quiet harbor velvet signal orchard ember falcon granite".split()


@dataclass(eq=False)
class Phase:
    interactive: list[CallResult] = field(default_factory=list)
    batch: list[CallResult] = field(default_factory=list)
    seconds: float = 0.0


def _batch_body(rng: random.Random, model: str, words: int, priority: str) -> dict[str, Any]:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return {"model": model, "messages": [{"role": "user", "content": f"Summarize: {text}"}],
            "max_tokens": 48, "ignore_eos": True, "priority": priority}


def _interactive_body(rng: random.Random, model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": f"Name a {rng.choice(WORDS)}."}],
            "max_tokens": 8, "ignore_eos": True, "priority": "interactive"}


async def run_phase(url: str, model: str, args: argparse.Namespace, batch_priority: str) -> Phase:
    phase = Phase()
    rng = random.Random(7)
    stop_at = time.perf_counter() + args.seconds
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:

        async def batch_client(i: int) -> None:
            local = random.Random(i)
            while time.perf_counter() < stop_at:
                phase.batch.append(await stream_chat(client, url, _batch_body(local, model, args.batch_words,
                                                                              batch_priority)))

        async def interactive_arrivals() -> None:
            tasks = []
            while time.perf_counter() < stop_at:
                await asyncio.sleep(rng.expovariate(args.interactive_rate))
                tasks.append(asyncio.ensure_future(stream_chat(client, url, _interactive_body(rng, model))))
            phase.interactive += await asyncio.gather(*tasks)

        start = time.perf_counter()
        await asyncio.gather(interactive_arrivals(), *(batch_client(i) for i in range(args.batch_clients)))
        phase.seconds = time.perf_counter() - start
    return phase


def _ttfts(results: list[CallResult]) -> list[float]:
    return [r.ttft_s for r in results if r.ttft_s is not None and r.error is None]


def report(name: str, phase: Phase, slo: float) -> float:
    inter, batch = _ttfts(phase.interactive), _ttfts(phase.batch)
    errors = sum(1 for r in phase.interactive + phase.batch if r.error is not None or r.transport_error)
    within = sum(1 for t in inter if t <= slo) / max(1, len(inter))
    tokens = sum(r.tokens for r in phase.batch)
    p90 = percentile(inter, 0.9)
    print(f"{name:<12} interactive n={len(inter):3d} TTFT p50 {percentile(inter, 0.5):6.2f}s p90 {p90:6.2f}s "
          f"within {slo:g}s SLO {within:6.1%} | batch n={len(batch):3d} TTFT p50 {percentile(batch, 0.5):6.2f}s "
          f"p90 {percentile(batch, 0.9):6.2f}s, {tokens / phase.seconds:6.1f} tok/s | errors {errors}")
    return p90


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny (default) or a model directory / the default model")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--batch-clients", type=int, default=24)
    ap.add_argument("--batch-words", type=int, default=300, help="words of each batch prompt")
    ap.add_argument("--interactive-rate", type=float, default=1.0, help="interactive arrivals per second")
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--max-num-seqs", type=int, default=8, help="decode node's running sequences at most")
    args = ap.parse_args()
    resolved = resolve_model(None if args.model == "default" else args.model)
    model_dir, name = resolved.path, "bench-model"
    node_args = ["--num-threads", "1", "--num-kv-blocks", "1024", "--model-name", name]
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(Path(tmp), model_dir, node_args=node_args) as cluster:
        # Threshold 0: every prompt, interactive ones too, is prefilled on the prefill node, so both classes
        # meet in its queue and in the decode node's reservation queue and running slots.
        cluster.start(1, 1, decode_args=["--max-num-seqs", str(args.max_num_seqs), "--local-prefill-threshold", "0"],
                      prefill_args=["--max-num-seqs", str(args.max_num_seqs)])
        fe = start_frontend("frontend", Path(tmp), cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                            "--model", f"{name}={model_dir}", "--log-level", "warning", "--request-log", "off")
        try:
            url = f"{fe.base_url}/v1/chat/completions"
            print(f"model {model_dir}; {args.batch_clients} batch clients ({args.batch_words}-word prompts, 48 "
                  f"tokens), interactive arrivals {args.interactive_rate:g}/s (8 tokens), {args.seconds:g}s per "
                  f"phase, decode --max-num-seqs {args.max_num_seqs}")
            base = report("one class", asyncio.run(run_phase(url, name, args, "interactive")), args.ttft_slo)
            cluster.wait_clean()
            prio = report("priorities", asyncio.run(run_phase(url, name, args, "batch")), args.ttft_slo)
            cluster.wait_clean()
            print(f"interactive TTFT p90 with priorities / one class: {prio / base:.2f}")
        finally:
            fe.stop()


if __name__ == "__main__":
    main()
