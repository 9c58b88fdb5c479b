"""The autoscaler under a traffic step, against the best fixed shape within the same node budget.

    .venv/bin/python bench/autoscale_bench.py [--model DIR|tiny] [--profile FILE] [--overheads FILE]
        [--node-budget 3] [--phase-s 40] [--slo ttft_p90=4x] [--out DIR] [--smoke]

One open-loop schedule of requests (Poisson arrivals, seeded) in three phases:
A. short prompts at a base rate, B. the same prompts at twice the rate, C. long prompts at the base rate.
The base rate is chosen from the profile and the serving overheads: 0.7 times the planner's highest rate
for 1P:1D on phase A's traffic, so phase B is past what 1P:1D serves within the SLOs (1.4 times its
highest rate); `--base-rate` sets it instead. The overheads (what the profile's engine steps leave out:
the frontend's and the nodes' own CPU, which on a small machine share the nodes' cores) are measured first
(bench/shapes.py's `calibrate_overheads`, on other traffic than the schedule's) unless `--overheads FILE`
gives them or `--no-overheads` leaves them out; the controller is given the same file
(`--autoscale-overheads`). Without them the model's rates can be several times what the cluster serves.

1. `pdserve up --autoscale` starting from 1P:1D with `--node-budget` nodes (3 on this 2-core machine):
   the schedule is sent, the launcher's log is watched for the controller's decisions and the nodes it
   starts and drains; reported: the seconds from each step (B, C) to the controller's first change
   after it and to the new shape serving (its last node ready or drained).
2. The same schedule replayed against each fixed disaggregated shape within the budget (no autoscaler).
3. SLO attainment of each run (a request attains when it succeeded and met every SLO threshold), the best
   fixed shape chosen afterwards, and the ratio autoscaled / best fixed; every request sent is matched to
   its answer's status: lost (no answer: a connection error or a timeout) and failed (an answer other than
   200, or a stream that ended in an error) must both be 0, above all while nodes start and drain.

The profile is `pdserve profile`'s format: `--profile FILE`, else `pdserve profile --quick` with one thread
pinned to one CPU (bench/shapes.py's `profile_here`); `--smoke` without `--profile` writes a hand-made one
(decode nodes that run one sequence at a time, so that the step needs a second decode node on any machine).
SLOs are stated relative to the profile (`ttft_p90=4x`: four times one short request's TTFT alone; see
bench/shapes.py's `relative_slos`). The frontend, etcd, the load generator and the nodes share the cores.
`--smoke` (the tiny model, seconds-long phases) is run by tests/test_autoscale_bench.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from bench.cpu_isa import isa_summary  # noqa: E402
from bench.shapes import calibrate_overheads, profile_here, relative_slos  # noqa: E402
from pdserve.engine.default_model import resolve_model  # noqa: E402
from pdserve.planner.loadgen.metrics import SLO, parse_slos  # noqa: E402
from pdserve.planner.plan import PlanConfig, Planner, shapes  # noqa: E402
from pdserve.planner.profile_model import EngineFacts, Linear, Profile, load_profile_here  # noqa: E402
from pdserve.planner.sim import Overheads, Shape, load_overheads  # noqa: E402
from pdserve.planner.traffic import Traffic  # noqa: E402
from testing.up_cluster import UpCluster  # noqa: E402

WORD = " the"  # one token in the models' tokenizers: a prompt of N words is about N tokens


@dataclass(frozen=True)
class Phase:
    name: str
    rate: float  # requests per second
    prompt_tokens: int
    output_tokens: int
    duration_s: float


@dataclass(frozen=True)
class Send:
    at_s: float  # since the schedule's start
    phase: str
    prompt_tokens: int
    output_tokens: int


@dataclass
class Answer:
    send: Send
    status: str  # "200", another HTTP status, "lost: ..." or "failed: ..."
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "200"


def schedule(phases: list[Phase], seed: int) -> list[Send]:
    """Poisson arrivals in each phase, one after the other (the same list for every run)."""
    rng, out, start = random.Random(seed), [], 0.0
    for ph in phases:
        t = start + rng.expovariate(ph.rate)
        while t < start + ph.duration_s:
            out.append(Send(t, ph.name, ph.prompt_tokens, ph.output_tokens))
            t += rng.expovariate(ph.rate)
        start += ph.duration_s
    return out


def one_request(client: httpx.Client, url: str, model: str, send: Send, timeout_s: float) -> Answer:
    """A streamed completion; TTFT is the first token's chunk, e2e the stream's end."""
    t0 = time.monotonic()
    body = {"model": model, "prompt": "Say" + WORD * (send.prompt_tokens - 1), "max_tokens": send.output_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    ans = Answer(send, "lost: no answer")
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                r.read()
                ans.status = f"{r.status_code}: {r.text[:200]}"
                return ans
            done = False
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    ans.status = f"failed: {str(chunk['error'])[:200]}"
                    return ans
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if ans.tokens == 0:
                        ans.ttft_s = time.monotonic() - t0
                    ans.tokens += 1
            ans.e2e_s = time.monotonic() - t0
            ans.status = "200" if done else "failed: the stream ended without [DONE]"
    except httpx.HTTPError as err:
        ans.status = f"lost: {type(err).__name__}: {err}"
    return ans


def send_all(url: str, model: str, sends: list[Send], timeout_s: float) -> tuple[list[Answer], float]:
    """Sends the schedule open-loop (a thread a request); returns every answer and the start (monotonic)."""
    answers: list[Answer] = []
    lock = threading.Lock()
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    with httpx.Client(limits=limits) as client:
        def run(s: Send) -> None:
            a = one_request(client, url, model, s, timeout_s)
            with lock:
                answers.append(a)

        threads = []
        t0 = time.monotonic()
        for s in sends:
            time.sleep(max(0.0, t0 + s.at_s - time.monotonic()))
            th = threading.Thread(target=run, args=(s,), daemon=True)
            th.start()
            threads.append(th)
        for th in threads:
            th.join(timeout_s + 30)
    return answers, t0


class LogWatch:
    """The launcher's log lines about the shape (controller decisions, nodes ready or drained), each with
    the time it was seen."""

    PATTERN = re.compile(r"^autoscale: (scale_up|scale_down|reshape): (\d+P:\d+D) -> (\d+P:\d+D)"
                         r"|^\s*ready\s+(\S+)|^\s*drained (\S+)")

    def __init__(self, up: UpCluster) -> None:
        self.up = up
        self.events: list[tuple[float, str]] = []
        self._seen = len(up.stderr())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):  # the poll interval: the delays are this precise
            text = self.up.stderr()
            new, self._seen = text[self._seen:], len(text)
            now = time.monotonic()
            for line in new.splitlines():
                if self.PATTERN.search(line):
                    self.events.append((now, line.strip()))

    def stop(self) -> list[tuple[float, str]]:
        self._stop.set()
        self._thread.join()
        return self.events


def summarize(answers: list[Answer], sent: int, slos: list[SLO]) -> dict[str, Any]:
    """Attainment over every request sent; lost and failed by status."""
    def attains(a: Answer) -> bool:
        if not a.ok:
            return False
        tpot = (a.e2e_s - a.ttft_s) / max(1, a.tokens - 1)
        values = {"ttft": a.ttft_s, "tpot": tpot, "itl": tpot, "e2e": a.e2e_s}
        return all(values.get(s.metric, math.inf) <= s.threshold_s for s in slos)

    lost = sum(a.status.startswith("lost") for a in answers) + (sent - len(answers))
    failed = sum(not a.ok and not a.status.startswith("lost") for a in answers)
    ttfts = sorted(a.ttft_s for a in answers if a.ok)
    by_phase = {}
    for ph in sorted({a.send.phase for a in answers}):
        mine = [a for a in answers if a.send.phase == ph]
        by_phase[ph] = {"sent": len(mine), "attainment": sum(map(attains, mine)) / len(mine)}
    return {"sent": sent, "answered": len(answers), "ok": sum(a.ok for a in answers), "lost": lost,
            "failed": failed, "attainment": sum(map(attains, answers)) / max(1, sent),
            "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else math.nan, "phases": by_phase,
            "errors": sorted({a.status for a in answers if not a.ok})[:5]}


def step_delays(events: list[tuple[float, str]], steps: dict[str, float]) -> dict[str, dict[str, Any]]:
    """For each step (phase name -> its monotonic start): the controller's first change after it (before
    the next step) and when the nodes it asked for were ready or drained."""
    out: dict[str, dict[str, Any]] = {}
    starts = sorted(steps.values())
    for name, t in steps.items():
        end = next((s for s in starts if s > t), math.inf)
        decision = next(((ts, line) for ts, line in events if t <= ts < end and "autoscale:" in line), None)
        row: dict[str, Any] = {"decision_s": None, "serving_s": None, "change": None}
        if decision is not None:
            ts, line = decision
            m = LogWatch.PATTERN.search(line)
            assert m is not None
            row.update(decision_s=ts - t, change=f"{m.group(1)} {m.group(2)} -> {m.group(3)}")
            after = [e for e in events if e[0] >= ts and "autoscale:" not in e[1]]
            nxt = next((e[0] for e in events if e[0] > ts and "autoscale:" in e[1]), math.inf)
            done = [e[0] for e in after if e[0] < nxt]
            row["serving_s"] = (max(done) - t) if done else None
        out[name] = row
    return out


def smoke_profile() -> Profile:
    """Decode nodes that run one sequence at a time, 100 ms a step: twice the base rate needs a second
    decode node whatever this machine's speed."""
    return Profile(Linear(0.005, 1e-5), Linear(0.1), Linear(0.0), EngineFacts(16, 100_000, 1000, 2048, 1, 64),
                   machine={"synthetic": True})


def up_args(model: str, shape: tuple[int, int], common: list[str]) -> list[str]:
    return ["--model", model, "--prefill", str(shape[0]), "--decode", str(shape[1]), *common]


def run_one(label: str, model: str, argv: list[str], sends: list[Send], phases: list[Phase], slos: list[SLO],
            workdir: Path, timeout_s: float, watch: bool, log_dir: Path) -> dict[str, Any]:
    print(f"-- {label}: pdserve up {' '.join(argv)}", flush=True)
    t_start = time.monotonic()
    up = UpCluster.start(workdir, argv, timeout_s=600)
    print(f"   up in {time.monotonic() - t_start:.0f} s; sending {len(sends)} requests", flush=True)
    watcher = LogWatch(up) if watch else None
    try:
        answers, t0 = send_all(up.base_url, up.state()["model"], sends, timeout_s)
        events = watcher.stop() if watcher else []
        up.wait_clean(60)  # every KV block back, every node's accounting consistent
        final = sorted(f"{p['pool']}" for p in up.nodes().values())
    finally:
        try:
            up.interrupt(timeout_s=120)
        finally:
            up.close()
            log_dir.mkdir(parents=True, exist_ok=True)
            for stream, text in (("stdout", up.stdout()), ("stderr", up.stderr())):
                (log_dir / f"{label.replace(' ', '-').replace(':', '')}.{stream}").write_text(text, encoding="utf-8")
    res = summarize(answers, len(sends), slos)
    res["label"] = label
    res["final_nodes"] = {pool: final.count(pool) for pool in ("prefill", "decode")}
    if watch:
        steps, start = {}, t0
        for ph in phases:
            steps[ph.name] = start
            start += ph.duration_s
        res["events"] = [(round(ts - t0, 2), line) for ts, line in events]
        res["steps"] = step_delays(events, {k: v for k, v in steps.items() if k != phases[0].name})
    print(f"   attainment {res['attainment']:.3f}  sent {res['sent']} ok {res['ok']} lost {res['lost']} "
          f"failed {res['failed']}  TTFT p90 {res['ttft_p90_s']:.3f} s"
          + (f"  errors {res['errors']}" if res["errors"] else ""), flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory, or tiny (default: the embedded default model)")
    ap.add_argument("--profile", default=None, help="a `pdserve profile` JSON (else profiled here with --quick)")
    ap.add_argument("--allow-other-machine", action="store_true", help="use a profile of another CPU kind")
    ap.add_argument("--overheads", default=None, help="an overheads JSON (`pdserve plan --overheads`; else measured "
                                                      "here, or none with --no-overheads or --smoke)")
    ap.add_argument("--no-overheads", action="store_true", help="plan with the profile's engine steps alone")
    ap.add_argument("--node-budget", type=int, default=3, help="the most nodes (3: on 2 cores)")
    ap.add_argument("--base-rate", type=float, default=None,
                    help="phase A's rate in req/s (default 0.7 times the planner's highest rate for 1P:1D)")
    ap.add_argument("--phase-s", type=float, default=40.0, help="seconds each phase lasts (40)")
    ap.add_argument("--short", type=int, default=32, help="phases A and B: prompt tokens (32)")
    ap.add_argument("--long", type=int, default=512, help="phase C: prompt tokens (512)")
    ap.add_argument("--output", type=int, default=16, help="output tokens of every request (16)")
    ap.add_argument("--slo", default="ttft_p90=4x", help="SLOs, fixed or relative to the profile (ttft_p90=4x)")
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--interval", type=float, default=2.0, help="the controller's interval (2 s)")
    ap.add_argument("--window", type=float, default=10.0, help="the controller's window (10 s)")
    ap.add_argument("--cooldown", type=float, default=10.0, help="the controller's cooldown (10 s)")
    ap.add_argument("--fixed", default="all", help="fixed shapes to replay against (all: every disaggregated "
                                                   "shape within the budget; '' for none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="autoscale-result", help="directory for result.json")
    ap.add_argument("--smoke", action="store_true", help="the tiny model, 4-second phases, one fixed shape (the test's run)")
    args = ap.parse_args()
    # one token for the clusters started here and this process's integrity checks on their nodes
    os.environ.setdefault("PDSERVE_CLUSTER_TOKEN", "pdserve-bench-" + os.urandom(12).hex())
    if args.smoke:
        args.model = args.model or "tiny"
        args.phase_s, args.short, args.long, args.output = min(args.phase_s, 4.0), 12, 64, 4
        args.fixed = "1P:1D" if args.fixed == "all" else args.fixed  # one fixed replay keeps the smoke short
        args.interval, args.window, args.cooldown = 1.0, 3.0, 2.0
        args.slo = args.slo if args.slo != "ttft_p90=4x" else "ttft_p90=1s"
    model = str(resolve_model(args.model).path) if args.model != "tiny" else "tiny"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"CPU ISA {isa_summary()}; {os.cpu_count()} CPUs; model {model}", flush=True)
    if args.profile:
        profile_path = Path(args.profile)
    elif args.smoke:
        profile_path = out / "profile.json"
        smoke_profile().save(profile_path)
    else:
        profile_path = out / "profile.json"
        profile_here(model, profile_path, sorted(os.sched_getaffinity(0))[0], quick=True)
    profile = load_profile_here(str(profile_path), args.allow_other_machine)
    overheads: Overheads | None = None
    overheads_path: Path | None = None
    if args.overheads:
        overheads_path = Path(args.overheads)
        overheads = load_overheads(overheads_path)
    elif not (args.no_overheads or args.smoke):
        with tempfile.TemporaryDirectory(prefix="asbench-overheads-") as tmp:
            overheads = calibrate_overheads(model, profile, tuple(sorted(os.sched_getaffinity(0))), Path(tmp))
        overheads_path = out / "overheads.json"
        overheads.save(overheads_path)
    short = Traffic.parse(str(args.short), str(args.output), 0, args.seed)
    slo_text = relative_slos(args.slo, profile, short)
    slos = parse_slos(slo_text)
    sweep = Planner(PlanConfig(profile, slos, args.attainment, 2, None, True, short, requests=200,
                               overheads=overheads)).run()
    top = next(r for r in sweep.results if r.shape.label == "1P:1D").max_rate
    if not top:
        raise SystemExit(f"1P:1D meets {slo_text} at no rate the planner tried: loosen --slo")
    base = args.base_rate or float(f"{0.7 * top:.3g}")
    phases = [Phase("A", base, args.short, args.output, args.phase_s),
              Phase("B", 2 * base, args.short, args.output, args.phase_s),
              Phase("C", base, args.long, args.output, args.phase_s)]
    sends = schedule(phases, args.seed)
    print(f"SLO {slo_text} (stated {args.slo}), attainment target {args.attainment}; planner: 1P:1D meets it up to "
          f"{top:.3g} req/s; phases " + ", ".join(f"{p.name} {p.rate:g} req/s x {p.prompt_tokens}/{p.output_tokens} "
                                                 f"tokens for {p.duration_s:g} s" for p in phases), flush=True)
    common = ["--num-threads", "1", "--lease-ttl", "2", "--kv-memory", "64", "--drain-timeout", "30"]
    timeout_s = 120.0
    # labels as `Shape.parse` reads them (1P:1D, 1p:2d, ...); TP 1 shapes only: the replays run pdserve up at TP 1
    wanted = None if args.fixed == "all" else {Shape.parse(x) for x in args.fixed.split(",") if x.strip()}
    fixed = [(s.prefill, s.decode) for s in shapes(args.node_budget) if s.prefill > 0
             and (wanted is None or s in wanted)]
    result: dict[str, Any] = {"isa": isa_summary(), "model": model, "profile": str(profile_path), "slo": slo_text,
                              "overheads": asdict(overheads) if overheads else None,
                              "node_budget": args.node_budget, "phases": [asdict(p) for p in phases],
                              "requests": len(sends)}
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="asbench-") as tmp:
        auto_argv = up_args(model, (1, 1), common) + [
            "--autoscale", "--node-budget", str(args.node_budget), "--autoscale-profile", str(profile_path),
            "--autoscale-slo", slo_text, "--autoscale-interval", str(args.interval), "--autoscale-window",
            str(args.window), "--autoscale-cooldown", str(args.cooldown),
            *(["--allow-other-machine"] if args.allow_other_machine else []),
            *(["--autoscale-overheads", str(overheads_path)] if overheads_path else [])]
        (Path(tmp) / "auto").mkdir()
        result["autoscaled"] = run_one("autoscaled", model, auto_argv, sends, phases, slos, Path(tmp) / "auto",
                                       timeout_s, watch=True, log_dir=out / "logs")
        result["fixed"] = []
        for p, d in fixed:
            label = f"{p}P:{d}D"
            wd = Path(tmp) / label.replace(":", "")
            wd.mkdir()
            result["fixed"].append(run_one(f"fixed {label}", model, up_args(model, (p, d), common), sends, phases,
                                           slos, wd, timeout_s, watch=False, log_dir=out / "logs"))
    if not result["fixed"]:
        (out / "result.json").write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
        return 0
    best = max(result["fixed"], key=lambda r: (r["attainment"], -sum(r["final_nodes"].values())))
    auto = result["autoscaled"]
    result["best_fixed"] = best["label"]
    result["ratio_autoscaled_to_best_fixed"] = auto["attainment"] / best["attainment"] if best["attainment"] else math.nan
    result["wall_s"] = time.monotonic() - t_all

    print(f"\n== autoscale bench: {isa_summary()}; {model}; budget {args.node_budget} nodes; SLO {slo_text}")
    print(f"{'run':<12} {'attain':>7} " + " ".join(f"{'att ' + p.name:>6}" for p in phases)
          + f" {'TTFTp90':>8} {'sent':>5} {'ok':>5} {'lost':>5} {'failed':>6}  final")
    for r in [auto, *result["fixed"]]:
        print(f"{r['label']:<12} {r['attainment']:>7.3f} "
              + " ".join(f"{r['phases'].get(p.name, {}).get('attainment', math.nan):>6.2f}" for p in phases)
              + f" {r['ttft_p90_s']:>8.3f} {r['sent']:>5} {r['ok']:>5} {r['lost']:>5} {r['failed']:>6}  "
              + f"{r['final_nodes']['prefill']}P:{r['final_nodes']['decode']}D")
    def fmt(v: float | None) -> str:
        return f"{v:.1f} s" if v is not None else "-"

    for name, row in auto["steps"].items():
        print(f"step to {name}: first change {row['change'] or 'none'}; decision after {fmt(row['decision_s'])}, "
              f"new shape serving after {fmt(row['serving_s'])}")
    print(f"best fixed shape (chosen afterwards): {best['label']} attainment {best['attainment']:.3f}; "
          f"autoscaled / best fixed = {result['ratio_autoscaled_to_best_fixed']:.3f}; "
          f"lost {auto['lost']}, failed {auto['failed']} under the autoscaler; run took {result['wall_s']:.0f} s")
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    print(f"wrote {out / 'result.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
