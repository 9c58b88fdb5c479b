"""The whole cluster against a plain transformers batch, on the same machine, in the same run.

`pdserve up` (1 prefill + 1 decode node, the frontend, etcd) serves N concurrent streamed chat requests
(default 32, max_tokens 128, ignore_eos) sent by the load generator (loadgen, as `pdserve bench` does);
transformers generates the same N chat prompts (the same chat template, checked to give the same token
ids as the server's tokenizer) as one static fp32 batch, left-padded, with max_new_tokens = min_new_tokens
= 128, greedy. Prints both output-token rates and their ratio (target >= 3x), with the loadgen's TTFT and
TPOT percentiles, once per node thread count in --num-threads (default: what `pdserve up` gives each node;
e.g. 1,2 on a 2-core machine) and per decode-node --max-prefill-queue-tokens (default: `pdserve up`'s; 0
sends every prompt above the local threshold to the prefill node), and the load average at each phase
(the machine may be shared).

    .venv/bin/python bench/cluster_bench.py [--model DIR|tiny] [--dtype auto|float32|bfloat16]
        [--num-threads default,1,2] [--max-prefill-queue-tokens default,0] [--requests 32] [--max-tokens 128]
        [--prompt-tokens uniform:64:256] [--hf-threads N] [--skip-hf]

Default model: SmolLM2-135M-Instruct (fetched and imported on first use); default dtype: what
`pdserve up` serves (bf16 on AVX512-BF16/AMX CPUs). The transformers baseline is always float32.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pdserve.engine.default_model import resolve_model  # noqa: E402
from pdserve.engine.gguf_import import StderrProgress  # noqa: E402
from pdserve.planner.loadgen.client import Target  # noqa: E402
from pdserve.planner.loadgen.runner import LoadConfig, RunResult, run  # noqa: E402
from pdserve.planner.loadgen.workload import RequestSpec, Workload, WorkloadConfig, parse_dist  # noqa: E402
from testing.up_cluster import UpCluster  # noqa: E402


def load_average() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def make_prompts(model_dir: Path, n: int, prompt_tokens: str, seed: int) -> list[RequestSpec]:
    """`n` synthetic user prompts of `prompt_tokens` tokens (by the model's tokenizer) and their lengths."""
    workload = Workload(WorkloadConfig(parse_dist(prompt_tokens), parse_dist("1"), seed=seed,
                                       tokenizer=str(model_dir)))
    return [workload.spec(i) for i in range(n)]


def chat_ids(model_dir: Path, specs: list[RequestSpec]) -> list[list[int]]:
    """The chat-template token ids of each prompt through transformers; asserts they are the ids the
    server's tokenizer renders, so both sides run the very same prompts."""
    from transformers import AutoTokenizer

    from pdserve.engine.tokenizer import Tokenizer

    hf, ours = AutoTokenizer.from_pretrained(str(model_dir)), Tokenizer(model_dir)
    out: list[list[int]] = []
    for spec in specs:
        messages = [{"role": "user", "content": spec.prompt}]
        ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        assert ids == ours.encode_chat(messages), f"request {spec.index}: transformers and pdserve ids differ"
        out.append(ids)
    return out


@dataclass
class BatchResult:
    tokens: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def hf_batch(model_dir: Path, ids: list[list[int]], max_tokens: int, threads: int) -> BatchResult:
    """One static fp32 batch of all prompts, left-padded, exactly `max_tokens` new tokens each, greedy;
    timed after a short warm-up generate. Sets torch's thread count."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    width = max(len(x) for x in ids)
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else (pad or 0)
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])

    def generate(n: int) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=pad)

    generate(2)  # one-time costs (allocator, kernels) stay out of the timing
    t0 = time.perf_counter()
    out = generate(max_tokens)
    seconds = time.perf_counter() - t0
    assert out.shape == (len(ids), width + max_tokens), out.shape
    return BatchResult(len(ids) * max_tokens, seconds)


def served_dtype(up: UpCluster) -> str:
    """The dtype the decode node says it serves in (its log's loader line), else "?"."""
    for log in sorted((up.cluster_dir / "logs").glob("decode*.log")):
        for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
            if "pdserve.engine.loader" in line and " dtype " in line:
                return line.split(" dtype ", 1)[1].split(":", 1)[0].strip()
    return "?"


def cluster_run(args: argparse.Namespace, threads: str, queue: str, specs: list[RequestSpec],
                warmup: list[RequestSpec], workdir: Path) -> tuple[RunResult, str]:
    """Starts `pdserve up` with `threads` torch threads per node (and the decode nodes'
    --max-prefill-queue-tokens `queue` unless "default"), warms it up, sends every spec at once, stops it;
    returns the measured run and the dtype served."""
    extra = ["--dtype", args.dtype] + (["--num-threads", threads] if threads != "default" else [])
    if queue != "default":
        extra += ["--max-prefill-queue-tokens", queue]
    if args.model is not None:
        extra += ["--model", args.model]
    up = UpCluster.start(workdir, extra, timeout_s=600)
    try:
        target = Target(f"{up.base_url}/v1", "", ignore_eos=True, temperature=0.0)
        cfg = LoadConfig(target, WorkloadConfig(parse_dist("1"), parse_dist("1")), rate=math.inf,
                         timeout_s=900, progress=sys.stderr.isatty())
        run(cfg, specs=warmup)  # channels, allocator and first-batch costs stay out of the timing
        result = run(cfg, specs=specs)
        dtype = served_dtype(up)
    finally:
        up.close()
    return result, dtype


def print_cluster(threads: str, queue: str, dtype: str, res: RunResult, hf: BatchResult | None,
                  ids: list[list[int]]) -> None:
    s = res.summary
    label = f"pdserve up ({dtype}, {threads} threads/node, prefill queue {queue})"
    print(f"{label:<44} {s.output_tokens} tokens in {s.duration_s:6.2f} s = {s.output_token_rate:7.1f} tok/s"
          + (f"  -> {s.output_token_rate / hf.rate:.2f}x transformers (target >= 3x)" if hf else ""))
    if s.failed:
        print(f"  FAILED requests: {s.errors}")
    served = [r.usage_prompt_tokens for r in sorted(res.records, key=lambda r: r.index)]
    if served != [len(x) for x in ids]:
        print("  WARNING: the server's prompt token counts differ from transformers' chat template ids")
    for name in ("ttft", "tpot", "itl", "e2e"):
        st = s.latency[name]
        print(f"  {name.upper():<5} ms  p50 {1000 * st.p50:8.1f}  p90 {1000 * st.p90:8.1f}  p99 {1000 * st.p99:8.1f}"
              f"  mean {1000 * st.mean:8.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory or tiny (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--num-threads", default="default",
                   help="torch threads per node (default: pdserve up's); a comma list runs each")
    p.add_argument("--max-prefill-queue-tokens", default="default",
                   help="the decode node's --max-prefill-queue-tokens (default: pdserve up's); a comma list runs each")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", default="uniform:64:256", help="user-message tokens (loadgen syntax)")
    p.add_argument("--hf-threads", type=int, default=os.cpu_count() or 1, help="torch threads for transformers")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    model_dir = resolve_model(args.model, StderrProgress()).path
    specs = make_prompts(model_dir, args.requests, args.prompt_tokens, args.seed)
    for spec in specs:
        spec.max_tokens = args.max_tokens
    warmup = make_prompts(model_dir, 4, args.prompt_tokens, args.seed + 1)
    for spec in warmup:
        spec.max_tokens = 8
    ids = chat_ids(model_dir, specs)
    lengths = sorted(len(x) for x in ids)
    print(f"cluster bench: {model_dir.name}, {args.requests} concurrent streamed chat requests x "
          f"{args.max_tokens} tokens (ignore_eos), chat prompts of {lengths[0]}..{lengths[-1]} tokens "
          f"(transformers and pdserve ids identical); {os.cpu_count()} CPUs")
    hf = None
    rates: dict[tuple[str, str], float] = {}
    if not args.skip_hf:
        print(f"[{load_average()}]")
        hf = hf_batch(model_dir, ids, args.max_tokens, args.hf_threads)
        print(f"{f'transformers fp32 static batch ({args.hf_threads} threads)':<44} {hf.tokens} tokens in "
              f"{hf.seconds:6.2f} s = {hf.rate:7.1f} tok/s")
    for threads in args.num_threads.split(","):
        for queue in args.max_prefill_queue_tokens.split(","):
            print(f"[{load_average()}]")
            with tempfile.TemporaryDirectory(prefix="cluster-bench-") as tmp:
                res, dtype = cluster_run(args, threads, queue, specs, warmup, Path(tmp))
            print_cluster(threads, queue, dtype, res, hf, ids)
            rates[threads, queue] = res.summary.output_token_rate
    print(f"[{load_average()}]")
    if len(rates) > 1:
        (t, q) = max(rates, key=lambda k: rates[k])
        print(f"fastest: {t} threads/node, prefill queue {q} ({rates[t, q]:.1f} tok/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
