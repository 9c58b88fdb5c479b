"""Time to first token, and to decode-ready, of 1k- and 4k-token prompts at low load: disaggregated with
layer-wise KV sends (the prefill node ships each layer as its last prefill step computes it),
disaggregated without them (the send starts after the first token, `--no-layerwise-send`), and
colocated (the decode node prefills the prompt itself).

Starts a real local cluster (etcd; prefill node p0 with layer-wise sends, p1 without, one decode node;
see testing/cluster.py), then sends requests one at a time, rotating the three paths so all see the same
machine state. Every prompt is fresh random tokens, so no prefix-cache hit helps any path. Measured at
the client from sending Generate:

- TTFT: to the first message carrying a token (the decode node forwards the prefill node's first token
  at once, before the transfer ends).
- decode-ready: to the moment the decode node could run the request's first decode step, i.e. its KV
  had landed: the arrival of the second token less the decode node's `first_decode_step_s` (landing to
  the end of that step, GenerateResponse.timing). Colocated, the prompt's K/V are in place when the
  first token is sampled: decode-ready is its TTFT.
- exposed transfer: decode-ready - TTFT, the part of the transfer (and its control messages) that the
  prefill's compute did not hide. Reported for the layer-wise path as a fraction of the same figure
  without layer-wise sends, where the whole send follows the compute (target <= 20%).

The default model is the one `pdserve up` serves (engine.default_model.resolve_model; fetched on first
use), in the dtype it serves (`auto`: the model config's); `--model tiny` for a fast run.

    .venv/bin/python bench/ttft_bench.py [--requests 10] [--prompt-tokens 1000,4000] [--model tiny]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pdserve.engine.default_model import resolve_model  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.node_common.convert import params_to_proto  # noqa: E402
from pdserve.rpc import pdserve_pb2 as pb  # noqa: E402
from testing.cluster import LocalCluster  # noqa: E402

PATHS = ("layer-wise", "whole send", "colocated")


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    ready_s: float  # decode-ready (see the module docstring)
    transfer_s: float  # the prefill node's send time (0 colocated)


def run_one(cluster: LocalCluster, path: str, prompt: list[int], params: SamplingParams, check: bool = True) -> Sample:
    """One request over `path`, timed per message at the client; with `check`, raises unless it took
    that path."""
    prefill = {"layer-wise": "p0", "whole send": "p1", "colocated": ""}[path]
    request = pb.GenerateRequest(prompt_token_ids=prompt, params=params_to_proto(params), prefill_node_id=prefill,
                                 force_local_prefill=path == "colocated")
    start = time.monotonic()
    arrivals: list[float] = []  # one per token
    messages: list[pb.GenerateResponse] = []
    for msg in cluster.decode_stub("d0").Generate(request, timeout=600):
        arrivals.extend([time.monotonic() - start] * len(msg.token_ids))
        messages.append(msg)
    last = messages[-1]
    if last.error or len(arrivals) < 2:
        raise RuntimeError(f"{path}: request failed or too short: {last}")
    want = prefill or "d0"
    if check and messages[0].prefill_node_id != want:
        raise RuntimeError(f"{path}: prefilled on {messages[0].prefill_node_id}, not {want}")
    ttft = arrivals[0]
    if path == "colocated":
        return Sample(ttft, ttft, 0.0)
    ready = max(ttft, arrivals[1] - last.timing.first_decode_step_s)
    return Sample(ttft, ready, last.timing.transfer_s)


def ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


def report(prompt_tokens: int, samples: dict[str, list[Sample]]) -> None:
    print(f"\n{prompt_tokens}-token prompts (medians, n={len(samples[PATHS[0]])} per path)")
    print(f"{'path':>12}  {'TTFT ms':>9}  {'decode-ready ms':>15}  {'exposed ms':>10}  {'send ms':>8}")
    for path in PATHS:
        got = samples[path]
        print(f"{path:>12}  {ms([s.ttft_s for s in got]):9.1f}  {ms([s.ready_s for s in got]):15.1f}  "
              f"{ms([s.ready_s - s.ttft_s for s in got]):10.1f}  {ms([s.transfer_s for s in got]):8.1f}")
    exposed_lw = statistics.median(s.ready_s - s.ttft_s for s in samples["layer-wise"])
    exposed_whole = statistics.median(s.ready_s - s.ttft_s for s in samples["whole send"])
    if exposed_whole > 0:
        print(f"exposed transfer after the last layer's compute, layer-wise / whole send: "
              f"{100 * exposed_lw / exposed_whole:.0f}%  (target <= 20%)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10, help="requests per path and prompt length")
    parser.add_argument("--prompt-tokens", default="1000,4000", help="comma-separated prompt lengths")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--model", default=None, help="model directory, or tiny (default: the served default model)")
    parser.add_argument("--dtype", default="auto", help="as `pdserve up` serves (auto: the model config's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--warmup", type=int, default=2, help="requests per path before measuring")
    args = parser.parse_args(argv)

    model = resolve_model(args.model)
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    node_args = ["--dtype", args.dtype, "--device", args.device, "--num-threads", str(args.threads),
                 "--kv-cache-memory-mib", "1024", "--max-num-batched-tokens", "2048"]
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="ttft-bench-") as tmp, \
            LocalCluster(Path(tmp), model.path, node_args=node_args) as cluster:
        cluster.start_etcd()
        nodes = [cluster.spawn_node("prefill", "p0"), cluster.spawn_node("prefill", "p1", ["--no-layerwise-send"]),
                 cluster.spawn_node("decode", "d0", ["--local-prefill-threshold", "32"])]
        cluster.wait_ready(nodes, timeout_s=600)  # model load (and a first fetch) on a busy machine
        # The decode node follows the prefill hint once the prefill nodes' load records are in its view.
        cluster.wait_registry(lambda m: all(n in m and m[n].load is not None for n in ("p0", "p1", "d0")),
                              timeout_s=30, what="every node with a load record")
        print(f"model {model.name}, dtype {args.dtype}, {args.device}, {args.threads} thread(s) per node, "
              "one request at a time")
        for n in lengths:
            def prompt(n: int = n) -> list[int]:
                return [rng.randrange(5, 4000) for _ in range(n)]

            for _ in range(args.warmup):  # the first calls open channels and warm every path up
                for path in PATHS:
                    run_one(cluster, path, prompt(), params, check=False)
            samples: dict[str, list[Sample]] = {path: [] for path in PATHS}
            for _ in range(args.requests):
                for path in PATHS:
                    samples[path].append(run_one(cluster, path, prompt(), params))
            report(n, samples)
        cluster.wait_clean()
    return 0


if __name__ == "__main__":
    sys.exit(main())
