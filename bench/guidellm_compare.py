"""Do `pdserve bench`'s figures agree with guidellm's on the same run?

A real local cluster (etcd, 1 prefill + 1 decode node, the frontend; prefix caching off, so that the
second tool to send a prompt gets no cache hit the first one paid for) serves N identical-shape chat
requests: each prompt exactly --prompt-tokens tokens by the model's own tokenizer, --output-tokens
tokens out with ignore_eos, at a fixed concurrency C. The prompts go to a local JSONL file that
guidellm reads (`json_file`, the model directory as its tokenizer, no hub access); `pdserve bench`
(the loadgen API, in process) sends the very same prompts. The tools run one after the other, in
both orders (round 1: pdserve then guidellm; round 2: guidellm then pdserve), because the machine is
small and shared: a drift between rounds shows up as a round-to-round spread, not as a tool bias.
Printed: per round and on average, TTFT / ITL / TPOT / e2e p50 and p90, requests/s and output
tokens/s of both tools, guidellm / pdserve, a `!` beyond +-10%, and why the definitions differ.

Where the definitions differ (read from guidellm 0.8.1's schemas/base/request_stats.py):
  - guidellm ITL is per request: (last token - first token) / (output tokens - 1); pdserve's ITL
    pools every gap between content chunks of every request. guidellm's ITL is pdserve's TPOT.
  - guidellm TPOT is (last token - request start) / output tokens: it includes the TTFT. Its
    same-definition pdserve figure (e2e / output tokens) is printed as "TPOT incl. TTFT".
  - Both time from just before the HTTP request is sent and count output tokens by the server's
    usage.completion_tokens (guidellm asks for it with stream_options.include_usage); neither
    re-tokenizes the output.
  - Requests/s: guidellm's is the count of completed requests over its benchmark window (first
    request start to last request end); pdserve's is the same over its run's wall time.
  - guidellm 0.8.1 may end its benchmark with the last request still in flight and report N-1 of N
    requests ("requests completed" row); its rates then cover N-1 requests over a window ending at
    the (N-1)th completion, which keeps them comparable.
  - Percentiles: guidellm takes the nearest rank of a token-weighted CDF (all requests weigh the
    same here, equal lengths); pdserve interpolates linearly.
  - TTFT has one definition in both, but at a fixed concurrency with equal output lengths requests
    decoded in one batch finish together, their successors arrive together and queue at the prefill;
    how clumped a run's sends are ("co-sent requests") is chance, and TTFT p50/p90 follow it.
  - Client CPU (cores busy in the window; guidellm's whole process tree, sampled from /proc) is
    printed too: on a small machine a busier client would slow the server it measures.

    .venv/bin/python bench/guidellm_compare.py [--model tiny] [--requests 20] [--concurrency 4]
        [--prompt-tokens 256] [--output-tokens 64] [--rounds 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pdserve.engine.default_model import resolve_model  # noqa: E402
from pdserve.planner.loadgen.client import Target  # noqa: E402
from pdserve.planner.loadgen.metrics import percentile  # noqa: E402
from pdserve.planner.loadgen.report import result_json, write_json  # noqa: E402
from pdserve.planner.loadgen.runner import LoadConfig, run  # noqa: E402
from pdserve.planner.loadgen.workload import RequestSpec, TextMaker, WorkloadConfig, parse_dist  # noqa: E402
from pdserve.registry.etcd_server import free_port  # noqa: E402
from testing.cluster import LocalCluster  # noqa: E402
from testing.procs import start_frontend  # noqa: E402

SERVED_NAME = "bench-model"
TOLERANCE = 0.10
INFO = {"client_cpu", "co_sent"}  # printed beside the figures, not figures the tools must agree on
CO_SENT_S = 0.05
# (row label, key) in the order printed; each key is filled by both parsers, in seconds or per second.
ROWS = [
    ("TTFT p50 (s)", "ttft_p50"), ("TTFT p90 (s)", "ttft_p90"),
    # TTFT of the requests sent alone (no other send within CO_SENT_S): clumping taken out.
    ("TTFT p50, sent alone (s)", "ttft_alone_p50"),
    ("ITL p50 (s)", "itl_p50"), ("ITL p90 (s)", "itl_p90"),
    ("TPOT p50 (s)", "tpot_p50"), ("TPOT p90 (s)", "tpot_p90"),
    # Same definitions: pdserve TPOT vs guidellm ITL; pdserve e2e/n vs guidellm TPOT.
    ("TPOT excl. TTFT p50 (s)", "tpot_excl_p50"), ("TPOT excl. TTFT p90 (s)", "tpot_excl_p90"),
    ("TPOT incl. TTFT p50 (s)", "tpot_incl_p50"), ("TPOT incl. TTFT p90 (s)", "tpot_incl_p90"),
    ("e2e p50 (s)", "e2e_p50"), ("e2e p90 (s)", "e2e_p90"),
    ("requests completed", "completed"), ("requests/s", "req_rate"), ("output tokens/s", "out_rate"),
    ("output tokens", "out_tokens"),
    ("prompt tokens (usage)", "prompt_tokens"),  # equal when both sent the same chat messages
    # CPU cores the client itself kept busy during its window: on a small machine a busier client
    # slows the server it measures (pdserve: its in-process event loop; guidellm: its process tree).
    ("client CPU (cores)", "client_cpu"),
    # Share of requests sent within CO_SENT_S of another one. At a fixed concurrency with equal output
    # lengths, requests decoded in one batch finish together and their successors arrive together and
    # queue at the prefill: TTFT follows this clumping, a chance property of each run, not of the tool.
    ("co-sent requests (share)", "co_sent"),
]
WHY = {
    "ttft": "TTFT: same definition (request sent -> first content chunk); at fixed concurrency it follows how "
            "many prompts queue at the prefill at once (see 'co-sent requests'), which varies run to run; "
            "compare 'TTFT p50, sent alone'",
    "itl": "ITL: guidellm's is per request (last-first)/(n-1), pdserve's TPOT; pdserve's pools every chunk gap",
    "tpot": "TPOT: guidellm's is (last token - request start)/n, so it includes the TTFT ('TPOT incl. TTFT')",
    "completed": "requests completed: guidellm may close its benchmark with a request still in flight "
                 "(its report's scheduler_state.processing_requests) and leaves that request out",
    "req_rate": "requests/s: both completed / window; each window opens at its first send, closes at its last end",
    "out_rate": "output tokens/s: both count usage.completion_tokens over the same window as requests/s",
}
# Differences in the same-definition rows have these causes, not a definition.
NOISE = ("percentiles: guidellm takes the nearest rank of a token-weighted CDF, pdserve interpolates "
         "linearly (numpy's default); with N requests a p90 may sit one order statistic apart",
         "timing: the runs are sequential on a small shared machine; 'spread' is the largest round-to-round "
         "change of either tool's figure, the noise floor any gl/pd gap must exceed to mean anything")


@dataclass
class Workload:
    """The shared workload: prompts (exact token counts by the model's tokenizer) and their lengths."""

    prompts: list[str]
    prompt_tokens: int
    output_tokens: int
    concurrency: int


def make_workload(model_dir: Path, n: int, prompt_tokens: int, output_tokens: int, concurrency: int,
                  seed: int) -> Workload:
    maker, rng = TextMaker(model_dir), random.Random(seed)
    return Workload([maker.make(prompt_tokens, rng) for _ in range(n)], prompt_tokens, output_tokens, concurrency)


def write_jsonl(wl: Workload, path: Path) -> None:
    """guidellm's generative column mapper reads `prompt`, `prompt_tokens_count` and `output_tokens_count`;
    an output count makes it send max_tokens=count with ignore_eos, as pdserve bench does below."""
    with path.open("w") as f:
        for p in wl.prompts:
            f.write(json.dumps({"prompt": p, "prompt_tokens_count": wl.prompt_tokens,
                                "output_tokens_count": wl.output_tokens}) + "\n")


# -- pdserve bench -----------------------------------------------------------------------------------

def run_pdserve(base_url: str, wl: Workload, model_dir: Path, keep: Path | None = None) -> dict[str, float]:
    target = Target(f"{base_url}/v1", SERVED_NAME, "chat", None, ignore_eos=True)
    workload = WorkloadConfig(parse_dist(str(wl.prompt_tokens)), parse_dist(str(wl.output_tokens)),
                              tokenizer=str(model_dir))
    cfg = LoadConfig(target, workload, rate=None, concurrency=wl.concurrency, max_requests=len(wl.prompts),
                     progress=False)
    specs = [RequestSpec(i, p, wl.output_tokens, prompt_tokens=wl.prompt_tokens) for i, p in enumerate(wl.prompts)]
    # All queued at once behind a semaphore of C: a closed loop of C clients, as guidellm's `concurrent`.
    cpu0 = time.process_time()
    result = run(cfg, specs=specs)
    cpu = time.process_time() - cpu0
    if keep is not None:
        write_json(keep, result_json(cfg, [result], False))
    s = result.summary
    if s.failed:
        raise RuntimeError(f"pdserve bench: {s.failed} requests failed: {s.errors}")
    ok = [r for r in result.records if r.ok]
    lat = s.latency
    incl = [r.e2e_s / r.output_tokens for r in ok if r.e2e_s is not None and r.output_tokens]
    return {
        "ttft_p50": lat["ttft"].p50, "ttft_p90": lat["ttft"].p90,
        "itl_p50": lat["itl"].p50, "itl_p90": lat["itl"].p90,
        "tpot_p50": lat["tpot"].p50, "tpot_p90": lat["tpot"].p90,
        "tpot_excl_p50": lat["tpot"].p50, "tpot_excl_p90": lat["tpot"].p90,
        "tpot_incl_p50": percentile(incl, 50), "tpot_incl_p90": percentile(incl, 90),
        "e2e_p50": lat["e2e"].p50, "e2e_p90": lat["e2e"].p90,
        "req_rate": s.request_rate, "out_rate": s.output_token_rate, "out_tokens": float(s.output_tokens),
        "completed": float(s.succeeded),
        "prompt_tokens": float(s.prompt_tokens),
        "client_cpu": cpu / s.duration_s,
        **clumping([r.start_s for r in ok], [r.ttft_s or 0.0 for r in ok]),
    }


# -- client CPU --------------------------------------------------------------------------------------

class TreeCpu:
    """Samples the CPU seconds of a process and its descendants (Linux /proc) every `period_s`, so that
    the CPU a client spent inside its measured window can be told apart from its start-up. Per pid the
    last reading is kept, so a worker that exits still counts."""

    def __init__(self, pid: int, period_s: float = 0.2) -> None:
        self.pid, self.period_s = pid, period_s
        self.samples: list[tuple[float, float]] = []  # (epoch s, CPU s of the tree so far)
        self._ticks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        hz = os.sysconf("SC_CLK_TCK")
        while not self._stop.wait(self.period_s):
            parents: dict[int, int] = {}
            ticks: dict[int, int] = {}
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit():
                    continue
                try:
                    # Fields after the ")" that ends the command name: state ppid ... utime(12) stime(13).
                    fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                pid = int(entry.name)
                parents[pid], ticks[pid] = int(fields[1]), int(fields[11]) + int(fields[12])
            for pid, t in ticks.items():
                p = pid
                while p in parents and p != self.pid:
                    p = parents[p]
                if p == self.pid:
                    self._ticks[pid] = t
            self.samples.append((time.time(), sum(self._ticks.values()) / hz))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> float:
        """CPU seconds spent between two epoch times (linear between samples)."""
        times, cpu = [t for t, _ in self.samples], [c for _, c in self.samples]

        def at(x: float) -> float:
            if not times or x <= times[0]:
                return cpu[0] if cpu else 0.0
            for i in range(1, len(times)):
                if x <= times[i]:
                    return cpu[i - 1] + (cpu[i] - cpu[i - 1]) * (x - times[i - 1]) / (times[i] - times[i - 1])
            return cpu[-1]

        return at(end) - at(start)


# -- guidellm ----------------------------------------------------------------------------------------

def guidellm_scenario(base_url: str, wl: Workload, data: Path, model_dir: Path, out: Path) -> dict[str, Any]:
    """A guidellm 0.8 scenario (the `run --scenario` file format): the same endpoint, data, concurrency
    and request count; no warm-up or cool-down exclusion (pdserve bench has none)."""
    return {
        "spec": {
            "backend": {"kind": "openai_http", "target": base_url, "model": SERVED_NAME,
                        "request_format": "/v1/chat/completions", "timeout": 600},
            "profile": {"kind": "concurrent", "streams": [wl.concurrency]},
            "constraints": [{"kind": "max_requests", "count": len(wl.prompts)}],
            "tokenizer": {"kind": "huggingface_auto", "model": str(model_dir)},
            "data": [{"kind": "json_file", "path": str(data)}],
            "outputs": [{"kind": "json", "path": str(out)}],
        },
    }


def guidellm_exe() -> str | None:
    """The guidellm CLI beside this interpreter (the project's venv), else on PATH."""
    return shutil.which("guidellm", path=str(Path(sys.executable).parent)) or shutil.which("guidellm")


def run_guidellm(base_url: str, wl: Workload, data: Path, model_dir: Path, workdir: Path,
                 keep: Path | None = None) -> dict[str, float]:
    out = workdir / f"guidellm-{time.monotonic_ns()}.json"
    scenario = workdir / "scenario.json"
    scenario.write_text(json.dumps(guidellm_scenario(base_url, wl, data, model_dir, out)))
    exe = guidellm_exe()
    assert exe is not None, "checked in main()"
    # Offline: the tokenizer is the local model directory; nothing may reach a model hub.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([exe, "run", "--scenario", str(scenario), "--disable-console-interactive"],
                                env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        sampler = TreeCpu(proc.pid)
        try:
            rc = proc.wait(timeout=900)
        finally:
            sampler.stop()
        if rc != 0 or not out.exists():
            log.seek(0)
            raise RuntimeError(f"guidellm failed ({rc}):\n{log.read()[-4000:]}")
    if keep is not None:
        keep.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(out, keep)
    report = json.loads(out.read_text())
    figures = parse_guidellm(report)
    (bench,) = report["benchmarks"]
    # Only the benchmark window: guidellm's start-up (imports, tokenizer, dataset) precedes it.
    figures["client_cpu"] = sampler.between(bench["start_time"], bench["end_time"]) / bench["duration"]
    return figures


def parse_guidellm(report: dict[str, Any]) -> dict[str, float]:
    """The comparable figures of guidellm's JSON report (its one benchmark), in seconds and per second.
    Its ITL distribution is pdserve's TPOT definition and its TPOT includes the TTFT (see the module
    docstring), so "itl" and "tpot" hold guidellm's figures of those names, and "tpot_excl" /
    "tpot_incl" the same-definition pairs."""
    (bench,) = report["benchmarks"]
    m = bench["metrics"]
    totals = m["request_totals"]
    if totals["errored"] or totals["incomplete"]:
        raise RuntimeError(f"guidellm: requests failed: {totals}")

    def ok(name: str) -> dict[str, Any]:
        return m[name]["successful"]

    def pct(name: str, q: str, scale: float = 1e-3) -> float:
        return float(ok(name)["percentiles"][q]) * scale

    return {
        "ttft_p50": pct("time_to_first_token_ms", "p50"), "ttft_p90": pct("time_to_first_token_ms", "p90"),
        "itl_p50": pct("inter_token_latency_ms", "p50"), "itl_p90": pct("inter_token_latency_ms", "p90"),
        "tpot_p50": pct("time_per_output_token_ms", "p50"), "tpot_p90": pct("time_per_output_token_ms", "p90"),
        "tpot_excl_p50": pct("inter_token_latency_ms", "p50"), "tpot_excl_p90": pct("inter_token_latency_ms", "p90"),
        "tpot_incl_p50": pct("time_per_output_token_ms", "p50"),
        "tpot_incl_p90": pct("time_per_output_token_ms", "p90"),
        "e2e_p50": pct("request_latency", "p50", 1.0), "e2e_p90": pct("request_latency", "p90", 1.0),
        # The means of guidellm's rate-over-time series: completed requests (tokens) / its window.
        "req_rate": float(ok("requests_per_second")["mean"]),
        "out_rate": float(ok("output_tokens_per_second")["mean"]),
        "out_tokens": float(ok("output_token_count")["total_sum"]), "completed": float(totals["successful"]),
        "prompt_tokens": float(ok("prompt_token_count")["total_sum"]),
        **clumping([r["request_start_time"] for r in bench["requests"]["successful"]],
                   [r["time_to_first_token_ms"] * 1e-3 for r in bench["requests"]["successful"]]),
    }


# -- the table ---------------------------------------------------------------------------------------

def co_sent_flags(starts: list[float]) -> list[bool]:
    """Per request (in the given order): was another request sent within CO_SENT_S of it?"""
    order = sorted(range(len(starts)), key=lambda i: starts[i])
    flags = [False] * len(starts)
    for a, b in zip(order, order[1:], strict=False):
        if starts[b] - starts[a] <= CO_SENT_S:
            flags[a] = flags[b] = True
    return flags


def clumping(starts: list[float], ttfts: list[float]) -> dict[str, float]:
    """The co-sent share and the TTFT p50 of the requests sent alone."""
    flags = co_sent_flags(starts)
    alone = [t for t, f in zip(ttfts, flags, strict=True) if not f]
    return {"co_sent": sum(flags) / len(flags) if flags else math.nan, "ttft_alone_p50": percentile(alone, 50)}


def mean_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(r[k] for r in runs) / len(runs) for _, k in ROWS}


def spread_of(runs: list[dict[str, float]], key: str) -> float:
    """max / min - 1 of one figure across rounds (0 with one round)."""
    values = [r[key] for r in runs]
    return max(values) / min(values) - 1 if min(values) > 0 else math.nan


def print_table(title: str, pd: dict[str, float], gl: dict[str, float],
                spread: dict[str, float] | None = None) -> list[str]:
    """Prints one side-by-side table; returns the keys whose gl/pd ratio is beyond the tolerance."""
    print(f"\n{title}\n{'metric':<26}{'pdserve':>12}{'guidellm':>12}{'gl/pd':>8}" + ("   spread" if spread else ""))
    off = []
    for label, key in ROWS:
        a, b = pd[key], gl[key]
        ratio = b / a if a and not math.isnan(a) else math.nan
        # NaN (no sample, e.g. no request sent alone) is not a disagreement.
        flag = " " if math.isnan(ratio) or abs(ratio - 1) <= TOLERANCE or key in INFO else "!"
        if flag == "!":
            off.append(key)
        fmt = "{:12.4f}" if "(s)" in label else "{:12.2f}"
        extra = f"{spread[key]:8.1%}" if spread else ""
        print(f"{label:<26}{fmt.format(a)}{fmt.format(b)}{ratio:8.3f} {flag}{extra}")
    return off


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="default (SmolLM2-135M-Instruct), tiny, or a model directory")
    ap.add_argument("--requests", type=int, default=20, help="per tool and round (20 x 2 rounds: about 4 min)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="round k runs pdserve first when k is odd")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", type=Path, help="directory for each run's raw result (pdserve-K.json, guidellm-K.json)")
    args = ap.parse_args()
    if guidellm_exe() is None:
        sys.exit("guidellm is not installed: pip install -e '.[bench]'")
    resolved = resolve_model(None if args.model == "default" else args.model)
    model_dir = Path(resolved.path)
    wl = make_workload(model_dir, args.requests, args.prompt_tokens, args.output_tokens, args.concurrency, args.seed)
    node_args = ["--dtype", "auto", "--num-threads", "1", "--num-kv-blocks", "1024", "--model-name", SERVED_NAME, "--no-prefix-caching"]
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(Path(tmp), model_dir, node_args=node_args) as cluster:
        work = Path(tmp)
        data = work / "prompts.jsonl"
        write_jsonl(wl, data)
        cluster.start(1, 1, decode_args=["--max-num-seqs", str(max(8, args.concurrency))])
        fe = start_frontend("frontend", work, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                            "--model", f"{SERVED_NAME}={model_dir}", "--log-level", "warning",
                            "--request-log", "off")
        try:
            print(f"model {model_dir}; {args.requests} chat requests, {args.prompt_tokens} prompt tokens, "
                  f"{args.output_tokens} output tokens (ignore_eos), concurrency {args.concurrency}, "
                  f"{args.rounds} round(s), prefix caching off")
            # Warm-up (excluded): the first requests of a fresh cluster pay one-time costs (allocator,
            # kernel selection) that would land on whichever tool ran first.
            run_pdserve(fe.base_url, Workload(wl.prompts[: args.concurrency], wl.prompt_tokens, 8,
                                              args.concurrency), model_dir)
            pds, gls = [], []
            for k in range(args.rounds):
                order = ("pdserve", "guidellm") if k % 2 == 0 else ("guidellm", "pdserve")
                for tool in order:
                    t0 = time.perf_counter()
                    if tool == "pdserve":
                        pds.append(run_pdserve(fe.base_url, wl, model_dir,
                                               args.keep and args.keep / f"pdserve-{k + 1}.json"))
                    else:
                        gls.append(run_guidellm(fe.base_url, wl, data, model_dir, work,
                                                args.keep and args.keep / f"guidellm-{k + 1}.json"))
                    cluster.wait_clean()
                    print(f"round {k + 1}: {tool} done in {time.perf_counter() - t0:.1f}s", flush=True)
                print_table(f"round {k + 1} ({' then '.join(order)})", pds[-1], gls[-1])
            spread = {k: max(spread_of(pds, k), spread_of(gls, k)) for _, k in ROWS} if args.rounds > 1 else None
            pd_mean, gl_mean = mean_of(pds), mean_of(gls)
            off = print_table(f"mean of {args.rounds} round(s)", pd_mean, gl_mean, spread)
        finally:
            fe.stop()
    print("\nbeyond +-10%: " + (", ".join(off) or "none"))
    if spread is not None:
        # A gap no larger than one tool's own change between rounds is not evidence of a tool difference.
        noisy = [k for k in off if abs(gl_mean[k] / pd_mean[k] - 1) <= spread[k]]
        print("  within the round-to-round spread: " + (", ".join(noisy) or "none"))
    # The definition behind each flagged row that has one; the noise notes apply to the rest.
    for note in dict.fromkeys(WHY[k.split("_p")[0]] for k in off if k.split("_p")[0] in WHY):
        print(f"  why: {note}")
    for note in NOISE:
        print(f"  note: {note}")


if __name__ == "__main__":
    main()
