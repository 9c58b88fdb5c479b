"""Overload: 10x the cluster's capacity for 30 s through one frontend in front of a real local cluster
(etcd, one prefill and one decode node running the tiny llama), with a tenant TTFT budget.

Capacity is measured first (two clients back to back, the budget lifted by a request header); then
requests arrive at 10x that rate, evenly spaced, without waiting for answers. Reported: how fast the
excess is refused (target: under 50 ms, measured at the client), how many accepted requests met the TTFT
budget (target: all), and the frontend's RSS over the run (target: bounded). tests/test_frontend_overload.py
is the same for 8 s.

    .venv/bin/python bench/overload.py [--seconds 30] [--factor 10] [--budget-ms 1500] [--prompt-words 400]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pdserve.engine.tiny import default_model_dir  # noqa: E402
from pdserve.frontend.tenants import hash_key  # noqa: E402
from pdserve.registry.etcd_server import free_port  # noqa: E402
from testing.cluster import LocalCluster  # noqa: E402
from testing.http_load import closed_loop_rate, open_loop, percentile, rss_bytes  # noqa: E402
from testing.procs import start_frontend  # noqa: E402

MODEL = "tiny-llama"
KEY = "sk-overload-bench-0123456789"
WORDS = "amber basin cedar delta ember fjord glade harbor inlet juniper kestrel lagoon meadow".split()


def bodies(seed: int, words: int) -> Iterator[dict[str, Any]]:
    rng = random.Random(seed)
    for i in itertools.count():
        text = f"request {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(words))
        yield {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--factor", type=float, default=10.0, help="offered load as a multiple of capacity")
    parser.add_argument("--budget-ms", type=int, default=1500, help="the tenant's TTFT budget")
    parser.add_argument("--prompt-words", type=int, default=400)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="overload-bench-") as tmpdir:
        tmp = Path(tmpdir)
        model = default_model_dir("llama")
        tenants = tmp / "tenants.yaml"
        tenants.write_bytes(orjson.dumps({"tenants": [
            {"name": "load", "keys_sha256": [hash_key(KEY)], "ttft_budget_ms": args.budget_ms}]}))
        node_args = ["--dtype", "float32", "--num-threads", str(args.threads), "--num-kv-blocks", "1024",
                     "--block-size", "16", "--model-name", MODEL]
        with LocalCluster(tmp / "cluster", model, node_args=node_args) as cluster:
            cluster.start(1, 1, decode_args=["--local-prefill-threshold", "0"])
            fe = start_frontend("frontend", tmp, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                                "--model", f"{MODEL}={model}", "--tenants", str(tenants), "--request-log", "off",
                                "--log-level", "warning")
            try:
                url = f"{fe.base_url}/v1/chat/completions"
                headers = {"authorization": f"Bearer {KEY}"}
                probe = {**headers, "x-pdserve-ttft-budget-ms": "3600000"}
                capacity = asyncio.run(closed_loop_rate(url, bodies(1, args.prompt_words), 2, 5.0, probe))
                pid = fe.proc.popen.pid
                rss0 = rss_bytes(pid)
                print(f"capacity {capacity:.2f} req/s; offering {args.factor * capacity:.1f} req/s for "
                      f"{args.seconds:.0f} s", flush=True)
                run = asyncio.run(open_loop(url, bodies(2, args.prompt_words), args.factor * capacity,
                                            args.seconds, pid, headers))
            finally:
                fe.stop()
        refused, accepted = run.refused, run.accepted
        times = [(r.head_s or 0.0) * 1e3 for r in refused]
        ttfts = [(r.ttft_s or 0.0) * 1e3 for r in accepted]
        met = sum(t <= args.budget_ms for t in ttfts)
        codes: dict[str, int] = {}
        for r in refused:
            key = f"{r.status} {(r.error or {}).get('code')}"
            codes[key] = codes.get(key, 0) + 1
        lost = [r for r in run.results if r.transport_error]
        print(f"offered {len(run.results)} in {run.seconds:.1f} s: {len(accepted)} accepted, {len(refused)} refused "
              f"{codes}, {len(lost)} without an answer")
        print(f"refusals: p50 {percentile(times, 0.5):.1f} ms  p99 {percentile(times, 0.99):.1f} ms  "
              f"max {max(times, default=0):.1f} ms  (target < 50 ms: "
              f"{'met' if percentile(times, 0.99) < 50 else 'NOT met'} at p99)")
        print(f"accepted TTFT: p50 {percentile(ttfts, 0.5):.0f} ms  p99 {percentile(ttfts, 0.99):.0f} ms  "
              f"within the {args.budget_ms} ms budget: {met}/{len(ttfts)}")
        print(f"frontend RSS: {rss0 / 2**20:.0f} MiB before, max {max(run.rss) / 2**20:.0f} MiB during, "
              f"{run.rss[-1] / 2**20:.0f} MiB at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
