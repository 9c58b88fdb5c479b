"""Overload: the frontend in front of a real local cluster (etcd, one prefill and one decode node running
the tiny llama) offered 10x what the cluster can serve. Excess requests are refused at once (429/503 with
Retry-After, in the OpenAI error shape) instead of queueing until they time out, the requests it accepts
get their first token within the tenant's TTFT budget, and the frontend's memory stays bounded.

`bench/overload.py` is the same for the full 30 s; this quick version runs 8 s.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from pdserve.frontend.tenants import hash_key
from pdserve.registry.etcd_server import free_port
from testing.cluster import LocalCluster
from testing.http_load import closed_loop_rate, open_loop, percentile, rss_bytes
from testing.procs import start_frontend

pytestmark = [pytest.mark.timeout(300), pytest.mark.quick]

MODEL = "tiny-llama"
KEY = "sk-overload-0123456789abcdef"
BUDGET_MS = 1500
NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "1024", "--block-size", "16",
             "--model-name", MODEL]
WORDS = "amber basin cedar delta ember fjord glade harbor inlet juniper kestrel lagoon meadow".split()


def bodies(seed: int) -> Iterator[dict[str, Any]]:
    """Distinct ~500-token chats (no prefix-cache help), two output tokens each."""
    rng = random.Random(seed)
    for i in itertools.count():
        text = f"request {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(400))
        yield {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2,
               "temperature": 0}


@pytest.mark.serial  # refusals within 50 ms at p90
def test_ten_times_capacity_refuses_fast_meets_ttft_and_bounds_memory(tmp_path: Path, tiny_llama_dir: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_bytes(orjson.dumps({"tenants": [
        {"name": "load", "keys_sha256": [hash_key(KEY)], "ttft_budget_ms": BUDGET_MS}]}))
    with LocalCluster(tmp_path / "cluster", tiny_llama_dir, node_args=NODE_ARGS) as cluster:
        cluster.start(1, 1, decode_args=["--local-prefill-threshold", "0"])
        fe = start_frontend("frontend", tmp_path, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                            "--model", f"{MODEL}={tiny_llama_dir}", "--tenants", str(tenants), "--request-log",
                            "off", "--max-inflight", "256", "--log-level", "warning")
        try:
            url = f"{fe.base_url}/v1/chat/completions"
            headers = {"authorization": f"Bearer {KEY}"}
            # The capacity probe opts out of the tenant's TTFT budget with a request header of an hour.
            probe_headers = {**headers, "x-pdserve-ttft-budget-ms": "3600000"}
            capacity = asyncio.run(closed_loop_rate(url, bodies(1), clients=2, seconds=3.0, headers=probe_headers))
            baseline_rss = rss_bytes(fe.proc.popen.pid)
            run = asyncio.run(open_loop(url, bodies(2), rate=10 * capacity, seconds=8.0, pid=fe.proc.popen.pid,
                                        headers=headers))
            accepted, refused = run.accepted, run.refused
            print(f"capacity {capacity:.1f} req/s; offered {len(run.results)} in {run.seconds:.1f}s: "
                  f"{len(accepted)} accepted, {len(refused)} refused; refusal p50/p99/max "
                  f"{percentile([r.head_s or 0 for r in refused], 0.5) * 1e3:.1f}/"
                  f"{percentile([r.head_s or 0 for r in refused], 0.99) * 1e3:.1f}/"
                  f"{max((r.head_s or 0 for r in refused), default=0) * 1e3:.1f} ms; accepted TTFT p50/p99 "
                  f"{percentile([r.ttft_s or 0 for r in accepted], 0.5) * 1e3:.0f}/"
                  f"{percentile([r.ttft_s or 0 for r in accepted], 0.99) * 1e3:.0f} ms; RSS "
                  f"{baseline_rss / 2**20:.0f} -> max {max(run.rss) / 2**20:.0f} MiB")

            assert not [r for r in run.results if r.transport_error], "every request got an answer"
            assert len(refused) > len(run.results) / 2 and len(accepted) >= capacity * 8 * 0.3
            for r in refused:
                assert r.status in (429, 503), (r.status, r.error)
                assert r.error is not None and set(r.error) == {"message", "type", "param", "code"}
                assert int(r.headers["retry-after"]) >= 1
            # Measured at the client, on a machine the nodes keep busy: the bulk of the refusals must take
            # under 50 ms (bench/overload.py reports p99 and max on a quiet machine).
            refusal_times = sorted(r.head_s or 0 for r in refused)
            slow = [(r.status, (r.error or {}).get("code"), round(r.head_s or 0, 3)) for r in refused
                    if (r.head_s or 0) >= 0.05]
            print(f"refusals over 50 ms: {len(slow)} of {len(refused)}: {slow[:12]}")
            assert percentile(refusal_times, 0.9) < 0.05, slow
            ttfts = [r.ttft_s or 0 for r in accepted]
            met = sum(t <= BUDGET_MS / 1e3 for t in ttfts)
            print(f"accepted within the {BUDGET_MS} ms budget: {met}/{len(ttfts)}")
            assert met >= 0.9 * len(ttfts), sorted(ttfts)[-10:]
            assert max(run.rss) - baseline_rss < 150 * 2**20
            # Still serving normally once the load is gone: the accepted requests are done and the load
            # records the frontend predicts TTFT from say so (on a slow CPU one reported waiting prompt
            # is already more than the budget).
            cluster.wait_clean()
            cluster.wait_registry(lambda m: all(x.load is not None and x.load.queue_len == 0 for x in m.values()),
                                  timeout_s=30, what="load records with nothing waiting")
            after = asyncio.run(closed_loop_rate(url, bodies(3), clients=1, seconds=0.5, headers=headers))
            assert after > 0
            cluster.wait_clean()
            cluster.check_integrity()
        finally:
            assert fe.stop() == 0, fe.proc.tail()
            assert "Traceback" not in fe.proc.log_text(), fe.proc.tail(80)
