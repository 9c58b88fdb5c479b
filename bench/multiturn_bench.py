"""Multi-turn chats whose working set is about three times one node's KV pool: the KV tier with routing
by exact cached prefix against pdserve without them (pool LRU, least-loaded decode nodes, prefix-hash
affinity), in one run, on the same cores.

Each configuration is a fresh cluster (etcd, 2 colocated decode nodes, the frontend) serving the same
workload: `--conversations` chats on one shared system prompt, each `--turns` turns run one after another
(every conversation concurrently), each turn adding a user message of about `--turn-words` words and
generating `--max-tokens`. Clients send no session key, as most OpenAI clients do. Reported per
configuration: TTFT p50 / p90 of turns 2 and later, prompt tokens actually computed (prompt minus
cached), requests per decode node (max over min), and the ratios between the two. The greedy answers of
the two configurations are compared (reported).

    .venv/bin/python bench/multiturn_bench.py            # the default model, ~3x one pool
    .venv/bin/python bench/multiturn_bench.py --quick    # the tiny model, a few turns (the suite runs this)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cpu_isa import isa_summary  # noqa: E402
from pdserve.engine.default_model import resolve_model  # noqa: E402
from pdserve.registry.etcd_server import free_port  # noqa: E402
from testing.cluster import LocalCluster  # noqa: E402
from testing.procs import start_frontend  # noqa: E402

WORDS = ("river bridge council mayor engineers water town square night watch report sandbags bank road ford "
         "rain spring records safety mark crews truck shop owner closure vote houses street lights").split()


@dataclass
class Turn:
    conversation: int
    index: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    request_id: str
    text: str
    node: str = "?"


@dataclass
class Result:
    name: str
    turns: list[Turn] = field(default_factory=list)

    def later(self) -> list[Turn]:
        return [t for t in self.turns if t.index > 0]

    def ttft(self, q: float) -> float:
        values = sorted(t.ttft_s for t in self.later())
        return values[min(len(values) - 1, int(q * len(values)))]

    @property
    def computed(self) -> int:
        return sum(t.prompt_tokens - t.cached_tokens for t in self.turns)

    def per_node(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.turns:
            counts[t.node] = counts.get(t.node, 0) + 1
        return counts

    @property
    def balance(self) -> float:
        counts = list(self.per_node().values())
        return max(counts) / min(counts) if len(counts) > 1 else float("inf")


def user_message(conversation: int, turn: int, words: int) -> str:
    picked = [WORDS[(conversation * 31 + turn * 7 + i * 13) % len(WORDS)] for i in range(words)]
    return f"Turn {turn + 1} of talk {conversation}: " + " ".join(picked) + ". What follows from this?"


def system_prompt(words: int) -> str:
    return "You are the town's assistant. Background: " + " ".join(WORDS[i % len(WORDS)] for i in range(words)) + "."


def chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str, dict, str]:
    """One streamed greedy chat: (TTFT, text, usage, request id)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, text, usage, rid = None, [], {}, ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            rid = chunk.get("id", rid)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - start
                text.append(piece)
    return (first if first is not None else time.perf_counter() - start), "".join(text), usage, rid


def run_config(name: str, args: argparse.Namespace, model_dir: Path, model_name: str, tmp: Path,
               node_extra: list[str], fe_extra: list[str]) -> Result:
    work = tmp / name
    node_args = ["--num-threads", "1", "--num-kv-blocks", str(args.kv_blocks), "--block-size", "16",
                 "--model-name", model_name, "--colocated"]
    result = Result(name)
    with LocalCluster(work / "cluster", model_dir, node_args=node_args) as cluster:
        cluster.start_etcd()
        nodes = [cluster.spawn_node("decode", f"d{i}", [a.replace("{node}", f"d{i}") for a in node_extra])
                 for i in range(2)]
        cluster.wait_ready(nodes)
        cluster.wait_registry(lambda m: {"d0", "d1"} <= m.keys(), timeout_s=30, what="both nodes")
        log = work / "requests.jsonl"
        fe = start_frontend("frontend", work, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                            "--model", f"{model_name}={model_dir}", "--request-log", str(log), "--log-level",
                            "warning", *fe_extra)
        try:
            system = system_prompt(args.system_words)

            def conversation(c: int) -> list[Turn]:
                messages = [{"role": "system", "content": system}]
                out = []
                for i in range(args.turns):
                    messages.append({"role": "user", "content": user_message(c, i, args.turn_words)})
                    ttft, text, usage, rid = chat(fe.base_url, model_name, messages, args.max_tokens)
                    messages.append({"role": "assistant", "content": text})
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    out.append(Turn(c, i, ttft, usage.get("prompt_tokens", 0), cached, rid, text))
                return out

            with concurrent.futures.ThreadPoolExecutor(args.conversations) as pool:
                for turns in pool.map(conversation, range(args.conversations)):
                    result.turns += turns
            nodes_of = {}
            for line in log.read_bytes().splitlines():
                rec = orjson.loads(line)
                if rec.get("request_id") and rec.get("routes"):
                    nodes_of[rec["request_id"]] = rec["routes"][0]["served_by"]["decode"] or rec["routes"][0]["decode_node"]
            for t in result.turns:
                t.node = nodes_of.get(t.request_id, "?")
        finally:
            fe.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory or tiny (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-words", type=int, default=300, help="words of the shared system prompt")
    ap.add_argument("--turn-words", type=int, default=60, help="words of each user message")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-blocks", type=int, default=192, help="KV blocks of 16 tokens per node")
    ap.add_argument("--quick", action="store_true", help="the tiny model, a few short turns: seconds (the suite)")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.conversations, args.turns, args.system_words, args.turn_words = "tiny", 4, 3, 40, 12
        args.max_tokens, args.kv_blocks = 8, 24
    print(f"CPU ISA {isa_summary()}")
    model = resolve_model(args.model)
    name = "tiny" if args.model == "tiny" else model.name
    with tempfile.TemporaryDirectory(prefix="multiturn-bench-") as tmp_s:
        tmp = Path(tmp_s)
        base = run_config("baseline", args, model.path, name, tmp, [], ["--no-kv-routing"])
        tier = run_config("tier+exact", args, model.path, name, tmp,
                          ["--kv-tier-dir", str(tmp / "tiers" / "{node}"), "--kv-tier-gib", "2"], [])
    tokens = max(t.prompt_tokens for t in base.turns)
    print(f"model {name}; {args.conversations} conversations x {args.turns} turns, 2 colocated decode nodes of "
          f"{args.kv_blocks} blocks x 16 tokens ({args.kv_blocks * 16} tokens each); longest prompt {tokens} tokens; "
          f"distinct history ~{args.conversations * tokens} tokens = {args.conversations * tokens / (args.kv_blocks * 16):.1f}x "
          "one pool")
    print(f"{'config':12} {'TTFT p50':>9} {'TTFT p90':>9} {'computed':>9} {'requests per node':>20} {'max/min':>8}")
    for r in (base, tier):
        per = " ".join(f"{k}:{v}" for k, v in sorted(r.per_node().items()))
        print(f"{r.name:12} {r.ttft(0.5) * 1e3:>7.0f}ms {r.ttft(0.9) * 1e3:>7.0f}ms {r.computed:>9} {per:>20} "
              f"{r.balance:>8.2f}")
    same = sum(a.text == b.text for a, b in zip(sorted(base.turns, key=lambda t: (t.conversation, t.index)),
                                               sorted(tier.turns, key=lambda t: (t.conversation, t.index)),
                                               strict=True))
    p90 = base.ttft(0.9) / tier.ttft(0.9)
    saved = 1 - tier.computed / max(1, base.computed)
    print(f"turns 2+: TTFT p90 {p90:.2f}x lower (target 2x), p50 {base.ttft(0.5) / tier.ttft(0.5):.2f}x; prompt tokens "
          f"computed {saved * 100:.0f}% fewer (target 60%); balance {tier.balance:.2f} (target <= 1.5); greedy answers "
          f"identical {same}/{len(base.turns)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
