"""Time to first token of a 1k-token prompt at low load: disaggregated (prefill on a prefill node, KV
shipped to the decode node) against colocated (the same decode node prefills it itself).

Starts a real local cluster (etcd, one prefill node, one decode node; see testing/cluster.py), then sends
requests one at a time, alternating the two paths so both see the same machine state. Every prompt is
fresh random tokens, so no prefix-cache hit helps either path. TTFT is measured at the client, from
sending Generate to the first message carrying a token; the decode node forwards the first token as
soon as the prefill node samples it, before the KV transfer ends, so the disaggregated overhead is the
extra control-plane hop, not the transfer. Target: median overhead <= 10%.

    .venv/bin/python bench/ttft_bench.py [--requests 20] [--prompt-tokens 1024] [--model DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from engine.sampling_params import SamplingParams  # noqa: E402
from engine.tiny import default_model_dir  # noqa: E402
from testing.cluster import GenerateResult, LocalCluster  # noqa: E402


def summarize(name: str, results: list[GenerateResult]) -> float:
    ttfts = sorted(r.ttft_s * 1000 for r in results)
    median = statistics.median(ttfts)
    p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]
    timing = [r.messages[0].timing for r in results]
    prefill = statistics.median(t.prefill_s * 1000 for t in timing)
    print(f"{name:>15}: median {median:7.1f} ms  p90 {p90:7.1f} ms  min {ttfts[0]:7.1f} ms  "
          f"(node prefill median {prefill:6.1f} ms, n={len(results)})")
    return median


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20, help="requests per path")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--model", default=None, help="model directory (default: the tiny llama)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)

    model = args.model or str(default_model_dir("llama"))
    node_args = ["--dtype", args.dtype, "--device", args.device, "--num-threads", str(args.threads),
                 "--num-kv-blocks", "1024", "--max-num-batched-tokens", "4096"]
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="ttft-bench-") as tmp, \
            LocalCluster(Path(tmp), model, node_args=node_args) as cluster:
        cluster.start(1, 1)
        vocab_hi = 4000

        def prompt() -> list[int]:
            return [rng.randrange(5, vocab_hi) for _ in range(args.prompt_tokens)]

        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        for _ in range(args.warmup):  # first calls open channels and warm both paths up
            cluster.generate("d0", prompt(), params, prefill_node_id="p0")
            cluster.generate("d0", prompt(), params, force_local_prefill=True)
        disagg: list[GenerateResult] = []
        coloc: list[GenerateResult] = []
        for _ in range(args.requests):
            disagg.append(cluster.generate("d0", prompt(), params, prefill_node_id="p0"))
            coloc.append(cluster.generate("d0", prompt(), params, force_local_prefill=True))
        assert all(r.prefill_node_id == "p0" for r in disagg) and all(r.prefill_node_id == "d0" for r in coloc)
        cluster.wait_clean()
        print(f"TTFT, {args.prompt_tokens}-token prompts, one request at a time, model {Path(model).name}, "
              f"{args.device}, {args.threads} thread(s) per node")
        m_dis = summarize("disaggregated", disagg)
        m_col = summarize("colocated", coloc)
        transfer = statistics.median(r.messages[-1].timing.transfer_s for r in disagg)
        overhead = m_dis / m_col - 1.0
        print(f"overhead of disaggregation (median TTFT): {100 * overhead:+.1f}%  (target <= +10%)")
        if transfer:
            print(f"KV transfer (after the first token, off the TTFT path): median {1000 * transfer:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
