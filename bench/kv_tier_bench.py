"""The KV tier after a restart: TTFT of a conversation's next turns on a node restarted with its tier
(warm) against one restarted without (cold), in one run, on the default model.

A multi-turn chat's history is served once (its blocks committed, so written to the tier); then each
engine is built anew, as a restarted node is: cold (no tier: the whole history is prefilled again) and
warm (the same tier directory: the history's blocks are read back, only the new turn is prefilled).
Reported per turn length: TTFT cold, warm, and warm/cold, with the tier's read rate; also the TTFT of the
engine that never restarted (its pool still holds the history) as the floor. Greedy outputs of warm and
cold must be token-identical (reported).

    .venv/bin/python bench/kv_tier_bench.py               # default model (its GGUF, served as it is)
    .venv/bin/python bench/kv_tier_bench.py --quick       # the tiny model, seconds (the suite runs this)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cpu_isa import isa_summary  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.default_model import resolve_model  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402

TOPICS = ["the river", "the council", "the bridge", "the fire service", "sandbags", "the engineers", "the ford",
          "the shop owner", "the mayor", "the lower town", "the records", "the safety mark"]


WARMUP = [5, 6, 7, 8, 9]  # an unrelated short prompt: shares no block with the conversation


def history(turns: int) -> list[dict[str, str]]:
    """A conversation of `turns` user/assistant exchanges (fixed text: the same tokens every run)."""
    out = []
    for i in range(turns):
        topic = TOPICS[i % len(TOPICS)]
        out.append({"role": "user", "content": f"Tell me more about {topic}, with details about what happened "
                                                f"on day {i + 1} and why it mattered to the town."})
        out.append({"role": "assistant", "content": f"On day {i + 1}, {topic} was the main concern. People met "
                                                     f"at the square, listened to the reports, and agreed to keep "
                                                     f"watch through the night while the water kept rising."})
    return out


def ttft(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Seconds from adding the request to its first token, and its greedy tokens."""
    start = time.perf_counter()
    seq = engine.add_request(f"t{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=max_tokens))
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.new_token_ids:
                first = time.perf_counter() - start
    assert first is not None
    return first, list(seq.completion_token_ids)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory or tiny (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--turns", type=int, nargs="+", default=[8, 16, 32], help="history lengths, in exchanges")
    ap.add_argument("--reps", type=int, default=3, help="restarts measured per length (median kept)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--tier-dir", default=None, help="where the tier lives (default: a temporary directory)")
    ap.add_argument("--quick", action="store_true", help="the tiny model, short histories: seconds (the suite)")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.turns, args.reps = "tiny", [2, 4], 1
    print(f"CPU ISA {isa_summary()}")
    model = resolve_model(args.model)
    tmp = Path(args.tier_dir or tempfile.mkdtemp(prefix="kv-tier-bench-"))
    base = EngineConfig(model=str(model.path), num_kv_blocks=4096, num_threads=args.num_threads)
    warm_cfg = EngineConfig(**{**base.__dict__, "kv_tier_dir": str(tmp / "tier")})
    first = LLMEngine(warm_cfg)
    print(f"model {model.name}, weights {first.weights.describe()}, KV {first.kv_dtype}; TTFT of the next turn "
          f"after a restart, median of {args.reps}")
    first.close()  # one process per tier directory: each engine below opens it in turn
    print(f"{'history':>8} {'tokens':>7} {'no restart':>11} {'cold':>9} {'warm':>9} {'warm/cold':>10} "
          f"{'tier read':>10} identical")
    ok = True
    try:
        for turns in args.turns:
            first = LLMEngine(warm_cfg)  # the node before its restart
            convo = history(turns)
            served = first.tokenizer.encode_chat(convo)
            ttft(first, served, 1)  # the history's turn: its blocks are committed (and written to the tier)
            nxt = first.tokenizer.encode_chat([*convo, {"role": "user", "content": "And what happened next?"}])
            floor, _ = ttft(first, nxt, args.max_tokens)
            first.close()  # the restart: its pending blocks on disk, the directory released
            cold, warm, reads = [], [], []
            same = True
            for _ in range(args.reps):
                c = LLMEngine(base)  # restarted without a tier
                ttft(c, WARMUP, 1)  # one-time costs of a new engine, apart from the measured turn
                t_cold, out_cold = ttft(c, nxt, args.max_tokens)
                del c
                w = LLMEngine(warm_cfg)  # restarted with it
                ttft(w, WARMUP, 1)
                loaded0 = w.kv_tier.stats.loaded if w.kv_tier else 0
                t_warm, out_warm = ttft(w, nxt, args.max_tokens)
                blocks = (w.kv_tier.stats.loaded if w.kv_tier else 0) - loaded0
                w.close()
                del w
                cold.append(t_cold)
                warm.append(t_warm)
                reads.append(blocks)
                same &= out_cold == out_warm
            t_c, t_w = statistics.median(cold), statistics.median(warm)
            ok &= same and min(reads) > 0
            print(f"{turns:>8} {len(nxt):>7} {floor * 1e3:>9.1f}ms {t_c * 1e3:>7.1f}ms {t_w * 1e3:>7.1f}ms "
                  f"{t_w / t_c:>9.2f}x {min(reads):>6} blk {'yes' if same else 'NO'}")
    finally:
        first.close()  # closing twice is harmless
        if args.tier_dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    print("warm restarts read the history from the tier; outputs identical" if ok
          else "a warm restart read nothing or its output differed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
