"""Disaggregated against colocated serving on the same cores, and `pdserve plan`'s predictions against
measurement, in one run on this machine.

    .venv/bin/python bench/shapes.py [--model DIR|tiny] [--profile FILE] [--validate W1,W2,...]
        [--compare WORKLOAD=R1,R2,...] [--requests N] [--slo ttft_p90=..,tpot_p99=..] [--out DIR]

1. Profile (unless `--profile` gives one): `pdserve profile` pinned to one CPU with one torch thread, the
   cost of one node in every shape below (each node runs on one core).
2. `--validate`: first the serving overheads the profile's engine steps leave out (`calibrate_overheads`:
   the nodes' CPU around their steps, the frontend's and the load generator's latency and CPU, which
   here share the nodes' cores), measured on other traffic than the validated runs'; then for each
   workload the planner (`planner.plan`, the simulator) finds each shape's highest
   rate within the workload's SLOs (at most 2 nodes, a core each), then plans at a rate between the two
   best shapes' highest rates, where one fits and the other does not; the recommended shape and that
   alternative are each
   started with `pdserve up --pin` (one core a node) and measured by `pdserve bench`'s load generator with
   the same seed, so the measured run draws the same prompt/output lengths and Poisson arrivals as the
   simulated one. Printed: TTFT p90, TPOT p99 and goodput, predicted against measured, with the ratio,
   and whether the planner ranks the two shapes as measured.
3. `--compare WORKLOAD=RATES`: the workload at each rate on 1P+1D (a core each), one colocated node on both
   cores (two threads) and two colocated nodes (a core each), all behind one frontend: TTFT p90, TPOT
   p99, attainment; each shape's highest rate within the SLOs. A colocated node is a decode node with no
   prefill pool: it prefills every prompt itself, between its decode steps.

The frontend and etcd float over both cores in every shape (they are the same in each). Requests go to
/v1/completions with `ignore_eos`, so the prompt and output lengths are exactly the drawn ones. Results
go to `--out` as JSON (and a PNG of TPOT p99 and goodput against rate with `--compare`).

SLOs are stated relative to the machine's own profile (`ttft_p90=4x`: four times one request's TTFT alone;
`tpot_p99=3x`: three decode steps of one sequence; see `relative_slos`), so each workload is feasible and
discriminating on whatever core runs it; when no shape meets them at any rate, every threshold is doubled,
step by step, and the run says so instead of skipping the workload. `--predict-only` prints the
planner's rates, shapes and figures without starting a cluster (the smoke run of the suite,
tests/test_shapes_bench.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from pdserve.engine.default_model import resolve_model  # noqa: E402
from pdserve.planner.loadgen.client import Target, api_base  # noqa: E402
from pdserve.planner.loadgen.metrics import SLO, Summary, parse_slos  # noqa: E402
from pdserve.planner.loadgen.runner import LoadConfig, run  # noqa: E402
from pdserve.planner.loadgen.workload import WorkloadConfig, parse_dist  # noqa: E402
from pdserve.planner.plan import PlanConfig, Planner  # noqa: E402
from pdserve.planner.profile_model import Profile, load_profile, load_profile_here  # noqa: E402
from pdserve.planner.sim import Overheads, Shape, SimRequest, simulate  # noqa: E402
from pdserve.planner.traffic import Traffic  # noqa: E402
from testing.up_cluster import UpCluster  # noqa: E402

# Workloads: prompt tokens, output tokens, and the SLOs each is judged by (what its users would ask for).
# The SLOs are relative to this machine's own profile (`Nx`: N times what one request alone gets, see
# `relative_slos`), so each workload is feasible and tells the shapes apart on a slow core and a fast one
# alike; fixed thresholds (`3s`, `300ms`) are taken as they are.
# prompt-heavy: documents of 512-1k tokens, short answers (prefill-bound; TTFT matters, TPOT loosely).
# output-heavy: short chats with long answers (decode-bound; the short prompts make a transfer cost more
# than it saves). mixed: mostly short chats with long streams, a quarter 1-2k-token documents whose
# prefill stalls a colocated node's decoding (TPOT p99 is what its streaming users feel).
WORKLOADS: dict[str, tuple[str, str, str]] = {
    "prompt-heavy": ("uniform:512:1024", "uniform:16:32", "ttft_p90=4x,tpot_p99=8x"),
    "output-heavy": ("uniform:64:256", "uniform:128:256", "ttft_p90=10x,tpot_p99=2.5x"),
    "mixed": ("0.75*uniform:64:256+0.25*uniform:1024:2048", "uniform:128:256", "ttft_p90=20x,tpot_p99=3x"),
}
LOOSEN = 2.0  # when no shape meets a workload's SLOs, its thresholds are multiplied by this, step by step
MAX_LOOSEN_STEPS = 8
TOLERANCE = 0.25  # predictions within 25% of measurement


def single_request_s(profile: Profile, traffic: Traffic) -> dict[str, float]:
    """What one request of the workload's mean lengths gets alone on this machine's profile: TTFT (its
    prompt prefilled in one step, then its first decode step), the decode step (TPOT, ITL) at its mean
    context, and e2e."""
    sample = traffic.requests(1.0, 200)
    prompt = round(statistics.mean(r.prompt_tokens for r in sample))
    output = statistics.mean(r.output_tokens for r in sample)
    step = profile.step_s(1, round(prompt + output / 2), 0, 0.0)
    ttft = profile.prefill_s(prompt) + profile.step_s(1, prompt, 0, 0.0)
    return {"ttft": ttft, "tpot": step, "itl": step, "e2e": ttft + output * step}


def relative_slos(text: str, profile: Profile, traffic: Traffic, factor: float = 1.0) -> str:
    """An --slo string with each `METRIC[_pNN]=Nx` resolved against `single_request_s` (N times the
    single-request figure), fixed thresholds kept; every threshold times `factor` (the loosening)."""
    base = single_request_s(profile, traffic)
    items = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = item.partition("=")
        if value.endswith("x"):
            metric = key.split("_p")[0]
            if metric not in base:
                raise ValueError(f"bad relative SLO {item!r}: {metric} is not one of {', '.join(base)}")
            seconds = float(value[:-1]) * base[metric]
        else:
            seconds = parse_slos(item)[0].threshold_s
        items.append(f"{key}={seconds * factor * 1000:.4g}ms")
    return ",".join(items)


@dataclass
class Measured:
    shape: str
    cores: str
    rate: float
    summary: Summary

    def figures(self) -> dict[str, float]:
        return figures(self.summary)


def figures(s: Summary) -> dict[str, float]:
    return {"ttft_p90": s.latency["ttft"].p90, "tpot_p99": s.latency["tpot"].p99,
            "goodput": s.goodput_rate, "attainment": s.attainment, "errors": float(s.failed),
            "meets_target": float(s.meets_target)}


def profile_here(model: str, out: Path, cpu: int, quick: bool) -> Profile:
    """`pdserve profile` with one thread, pinned to one CPU (as each pinned node runs)."""
    argv = [sys.executable, "-m", "pdserve.deploy", "profile", "--model", model, "--num-threads", "1", "--out", str(out),
            "--no-progress", *(["--quick"] if quick else [])]
    print(f"profiling on CPU {cpu}: {' '.join(argv[2:])}", flush=True)
    t0 = time.monotonic()
    subprocess.run(argv, cwd=REPO_ROOT, check=True, preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    print(f"  profiled in {time.monotonic() - t0:.0f} s -> {out}", flush=True)
    return load_profile(out)


def process_kind(cmdline: str) -> str:
    """"prefill" or "decode" for a node's command line (`python -m pdserve.prefill_node ...`), else "host"."""
    args = set(cmdline.split())
    for kind in ("prefill", "decode"):
        if {f"pdserve.{kind}_node", f"{kind}_node"} & args:
            return kind
    return "host"


@dataclass
class CpuUse:
    """CPU seconds used so far: the load generator and the cluster's processes other than its nodes (the
    launcher, etcd, the frontend and its worker processes) as "host"; each node's outside its busiest
    thread (the engine thread, which runs the steps the profile times)."""

    host: float = 0.0
    prefill_outside_steps: float = 0.0
    decode_outside_steps: float = 0.0

    def __sub__(self, other: CpuUse) -> CpuUse:
        return CpuUse(self.host - other.host, self.prefill_outside_steps - other.prefill_outside_steps,
                      self.decode_outside_steps - other.decode_outside_steps)

    @classmethod
    def now(cls, up: UpCluster) -> CpuUse:
        import psutil

        own = resource.getrusage(resource.RUSAGE_SELF)
        use = cls(host=own.ru_utime + own.ru_stime)
        kinds: dict[int, str] = {}
        for pid, cmdline in up.processes().items():
            kind = process_kind(cmdline)
            with contextlib.suppress(psutil.NoSuchProcess):
                for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
                    if kinds.get(p.pid, "host") == "host":  # the launcher's children include the nodes
                        kinds[p.pid] = kind
        for pid, kind in kinds.items():
            with contextlib.suppress(psutil.NoSuchProcess):
                proc = psutil.Process(pid)
                if kind == "host":
                    t = proc.cpu_times()
                    use.host += t.user + t.system
                    continue
                threads = [t.user_time + t.system_time for t in proc.threads()]
                outside = sum(threads) - max(threads)
                if kind == "prefill":
                    use.prefill_outside_steps += outside
                else:
                    use.decode_outside_steps += outside
        return use


ALONE_PROMPTS = (128, 1024)  # prompt lengths whose TTFT alone fits the latency


@dataclass
class ClusterCosts:
    """One shape's measured costs beyond the engine steps (seconds of CPU), and one request's TTFT alone."""

    host_per_request: float
    host_per_token: float
    prefill_per_request: float
    decode_per_request: float
    decode_per_token: float
    ttft_alone: dict[int, float]  # prompt tokens -> TTFT p50 of such requests sent one at a time
    note: str


def cluster_costs(model: str, shape: Shape, cpus: tuple[int, ...], workdir: Path) -> ClusterCosts:
    """`shape` pinned to `cpus` (the frontend and the load generator float over every CPU, as in the
    measured shapes), with other traffic than the validated runs': CPU by process for two loads, short
    and long outputs, solved for the cost per request and per streamed token; then 128-token prompts one
    at a time."""
    workdir.mkdir(parents=True, exist_ok=True)
    up = UpCluster.start(workdir, up_args(model, shape, cpus), timeout_s=600)
    try:
        target = Target(api_base(up.base_url), "", "completions", None, True, 0.0)

        def load(output: int, n: int, concurrency: int, seed: int, prompt: int = 128) -> tuple[Summary, CpuUse]:
            # a seed of its own for each load: no prompt hits the prefix cache
            wl = WorkloadConfig(parse_dist(str(prompt)), parse_dist(str(output)), seed=seed, tokenizer=model)
            before = CpuUse.now(up)
            res = run(LoadConfig(target, wl, concurrency=concurrency, max_requests=n, timeout_s=600.0,
                                 progress=False))
            if res.summary.failed:
                raise RuntimeError(f"calibration load failed: {res.summary.errors}")
            return res.summary, CpuUse.now(up) - before

        load(4, 4, 1, seed=1000)  # warm-up
        short, cpu_short = load(8, 32, 4, seed=1001)
        long, cpu_long = load(128, 32, 8, seed=1002)
        alone = {prompt: load(2, 6, 1, seed=1003 + i, prompt=prompt)[0].latency["ttft"].p50
                 for i, prompt in enumerate(ALONE_PROMPTS)}
    finally:
        try:
            up.interrupt(timeout_s=120)
        finally:
            up.close()
    (n1, t1), (n2, t2) = ((x.succeeded, x.output_tokens) for x in (short, long))

    def per_request_and_token(c1: float, c2: float) -> tuple[float, float]:
        # c = requests * per_request + tokens * per_token, for both loads
        per_token = max(0.0, (n1 * c2 - n2 * c1) / (n1 * t2 - n2 * t1))
        return max(0.0, (c1 - t1 * per_token) / n1), per_token

    host = per_request_and_token(cpu_short.host, cpu_long.host)
    decode = per_request_and_token(cpu_short.decode_outside_steps, cpu_long.decode_outside_steps)
    prefill = (cpu_short.prefill_outside_steps + cpu_long.prefill_outside_steps) / (n1 + n2)
    note = (f"{shape.label}: host {host[0] * 1e3:.2f} ms a request + {host[1] * 1e3:.3f} ms a token, decode node "
            f"{decode[0] * 1e3:.2f} ms + {decode[1] * 1e3:.3f} ms"
            + (f", prefill node {prefill * 1e3:.2f} ms a prompt" if shape.prefill else "")
            + "; TTFT alone " + ", ".join(f"{v * 1e3:.1f} ms at {k} tokens" for k, v in alone.items()))
    return ClusterCosts(*host, prefill, *decode, alone, note)


def calibrate_overheads(model: str, profile: Profile, cpus: tuple[int, ...], workdir: Path) -> Overheads:
    """What serving costs here beyond the profile's engine steps (`planner.sim.Overheads`): `cluster_costs`
    of 1P+1D on cpus[0] and cpus[1] (remote prefills) and of one colocated node on cpus[0] (local
    prefills). The latency is the client's TTFT of a request alone less its simulated TTFT."""
    print(f"measuring serving overheads beyond the engine steps on CPUs {cpus[:2]}", flush=True)
    remote = cluster_costs(model, Shape(1, 1), cpus[:2], workdir / "remote")
    print(f"  {remote.note}", flush=True)
    local = cluster_costs(model, Shape(0, 1), cpus[:1], workdir / "local")
    print(f"  {local.note}", flush=True)
    partial = Overheads(prefill_cpu_per_request_s=remote.prefill_per_request,
                        decode_cpu_per_remote_request_s=remote.decode_per_request,
                        decode_cpu_per_local_request_s=local.decode_per_request,
                        decode_cpu_per_token_s=(remote.decode_per_token + local.decode_per_token) / 2)
    # measured less simulated TTFT of a request alone, fitted as a + b * prompt tokens over both shapes
    points = [(n, ttft - simulate(profile, shape, [SimRequest(0, 0.0, n, 2)], overheads=partial).records[0].ttft_s)
              for costs, shape in ((remote, Shape(1, 1)), (local, Shape(0, 1))) for n, ttft in costs.ttft_alone.items()]
    lo, hi = ALONE_PROMPTS
    gap = {n: statistics.mean(g for m, g in points if m == n) for n in ALONE_PROMPTS}
    per_token = max(0.0, (gap[hi] - gap[lo]) / (hi - lo))
    overheads = dataclasses.replace(
        partial, latency_s=max(0.0, gap[lo] - per_token * lo), latency_per_prompt_token_s=per_token,
        host_cpu_per_request_s=(remote.host_per_request + local.host_per_request) / 2,
        host_cpu_per_token_s=(remote.host_per_token + local.host_per_token) / 2, host_cores=len(cpus))
    print(f"  overheads: {overheads}", flush=True)
    return overheads


def up_args(model: str, shape: Shape, cpus: tuple[int, ...]) -> list[str]:
    return ["--model", model, "--prefill", str(shape.prefill), "--decode", str(shape.decode), "--pin",
            "--cpus", ",".join(map(str, cpus)), "--lease-ttl", "2"]


def measure(model: str, shape: Shape, cpus: tuple[int, ...], workload: WorkloadConfig, rate: float, n: int,
            slos: list[SLO], attainment: float, workdir: Path) -> Measured:
    """Starts the shape with `pdserve up --pin --cpus`, runs the load once, stops it."""
    workdir.mkdir(parents=True, exist_ok=True)
    cores = f"{len(cpus)} core(s)"
    print(f"  measuring {shape.label} on {cores} at {rate:.3g} req/s ({n} requests)", flush=True)
    up = UpCluster.start(workdir, up_args(model, shape, cpus), timeout_s=600)
    try:
        target = Target(api_base(up.base_url), "", "completions", None, True, 0.0)
        cfg = LoadConfig(target, workload, rate=rate, max_requests=n, timeout_s=900.0, slos=slos,
                         attainment_target=attainment, progress=sys.stderr.isatty())
        result = run(cfg)
    finally:
        try:
            up.interrupt(timeout_s=120)
        finally:
            up.close()
    return Measured(shape.label, cores, rate, result.summary)


def rank_key(shape: Shape, s: Summary) -> tuple[bool, int, float, float]:
    """The planner's order (`planner.plan`): fits first, then fewer nodes, then more goodput; then the
    attainment, which separates two shapes that both serve everything."""
    return (s.meets_target, -shape.nodes, round(s.goodput_rate, 3), s.attainment)


def _ratio(measured: float, predicted: float) -> float:
    if predicted == 0 or math.isnan(predicted) or math.isnan(measured):
        return math.nan
    return measured / predicted


def validate(args: argparse.Namespace, profile: Profile, overheads: Overheads | None, cpus: tuple[int, ...],
             workdir: Path) -> list[dict[str, Any]]:
    rows = []
    for name in args.validate:
        prompt, output, stated = WORKLOADS[name]
        stated = args.slo or stated
        traffic = Traffic.parse(prompt, output, seed=args.seed)
        for step in range(MAX_LOOSEN_STEPS + 1):
            slo_text = relative_slos(stated, profile, traffic, LOOSEN ** step)
            slos = parse_slos(slo_text)
            sweep = Planner(PlanConfig(profile, slos, args.attainment, len(cpus), None, True, traffic,
                                       requests=args.sim_requests, overheads=overheads)).run()
            by_max = sorted(sweep.results, key=lambda r: r.max_rate or 0.0, reverse=True)
            top, runner = by_max[0].max_rate or 0.0, by_max[1].max_rate or 0.0
            if top > 0:
                break
            print(f"{name}: no shape meets {slo_text} at any rate simulated; loosening every threshold "
                  f"x{LOOSEN:g}", flush=True)
        if top <= 0:
            print(f"{name}: no shape meets even x{LOOSEN ** MAX_LOOSEN_STEPS:g} the stated SLOs {stated}; "
                  f"nothing to validate", flush=True)
            rows.append({"workload": name, "slo_stated": stated, "slo": slo_text, "feasible": False})
            continue
        # Between the two shapes' highest rates (geometric mean): the planner then says one shape fits
        # and the other does not, which the measurement confirms or refutes.
        rate = float(f"{math.sqrt(top * runner) if runner > 0 else 0.7 * top:.3g}")
        plan = Planner(PlanConfig(profile, slos, args.attainment, len(cpus), rate, False, traffic,
                                  requests=args.requests, overheads=overheads)).run()
        # the same simulation without the overheads, for the record: what modelling them changed
        bare = Planner(PlanConfig(profile, slos, args.attainment, len(cpus), rate, False, traffic,
                                  requests=args.requests))
        by_label = {r.shape.label: r for r in plan.results}
        rec = plan.recommended or by_label[by_max[0].shape.label]
        alt = by_label[by_max[1].shape.label] if rec.shape.label != by_max[1].shape.label \
            else by_label[by_max[0].shape.label]
        loosened = f" (stated {stated}, loosened x{LOOSEN ** step:g})" if step else f" (stated {stated})"
        print(f"\n== {name}: prompt {prompt}, output {output}, SLO {slo_text}{loosened}; simulated highest "
              f"rates {', '.join(f'{r.shape.label} {r.max_rate or 0:.3g}' for r in by_max)}; at {rate} req/s the "
              f"planner recommends {rec.shape.label}, alternative {alt.shape.label}", flush=True)
        if args.predict_only:
            rows.append(predictions(name, prompt, output, stated, slo_text, step, rate, rec, alt))
            continue
        workload = WorkloadConfig(parse_dist(prompt), parse_dist(output), seed=args.seed, tokenizer=args.model)
        measured = {}
        for res in (rec, alt):
            m = measure(args.model, res.shape, cpus[: res.shape.nodes], workload, rate, args.requests, slos,
                        args.attainment, workdir / f"{name}-{res.shape.label.replace(':', '')}")
            measured[res.shape.label] = m
        out = {"workload": name, "prompt": prompt, "output": output, "slo_stated": stated, "slo": slo_text,
               "loosened": LOOSEN ** step, "rate": rate, "shapes": []}
        for res in (rec, alt):
            pred, meas = figures(res.at_rate.summary), measured[res.shape.label].figures()
            pred_bare = figures(bare.simulate(res.shape, rate).summary)
            entry = {"shape": res.shape.label, "recommended": res is rec, "predicted": pred, "measured": meas,
                     "ratio": {k: _ratio(meas[k], pred[k]) for k in ("ttft_p90", "tpot_p99", "goodput")},
                     "predicted_without_overheads": pred_bare}
            out["shapes"].append(entry)
            print(f"  {res.shape.label:<6}{' (rec)' if res is rec else '      '} "
                  + "  ".join(f"{k} pred {pred[k]:.3f} meas {meas[k]:.3f} (x{entry['ratio'][k]:.2f}; "
                              f"x{_ratio(meas[k], pred_bare[k]):.2f} without overheads)"
                              for k in ("ttft_p90", "tpot_p99", "goodput"))
                  + f"  attainment pred {pred['attainment']:.2f} meas {meas['attainment']:.2f}", flush=True)
        meas_order = sorted((rec, alt), key=lambda r: rank_key(r.shape, measured[r.shape.label].summary),
                            reverse=True)
        out["ranked_as_measured"] = meas_order[0] is rec
        out["within_tolerance"] = all(abs(v - 1) <= TOLERANCE for e in out["shapes"] for v in e["ratio"].values()
                                      if not math.isnan(v))
        print(f"  planner ranks as measured: {out['ranked_as_measured']}; every figure within "
              f"{TOLERANCE:.0%}: {out['within_tolerance']}", flush=True)
        rows.append(out)
    return rows


def predictions(name: str, prompt: str, output: str, stated: str, slo_text: str, step: int, rate: float,
                rec: Any, alt: Any) -> dict[str, Any]:
    """--predict-only: the planner's figures for the recommended and the alternative shape, printed."""
    out: dict[str, Any] = {"workload": name, "prompt": prompt, "output": output, "slo_stated": stated,
                           "slo": slo_text, "loosened": LOOSEN ** step, "rate": rate, "feasible": True,
                           "shapes": []}
    for res in (rec, alt):
        pred = figures(res.at_rate.summary)
        out["shapes"].append({"shape": res.shape.label, "recommended": res is rec, "fits": res.fits,
                              "predicted": pred})
        print(f"  {res.shape.label:<6}{' (rec)' if res is rec else '      '} predicted "
              + "  ".join(f"{k} {pred[k]:.3f}" for k in ("ttft_p90", "tpot_p99", "goodput", "attainment"))
              + f"  fits: {res.fits}", flush=True)
    return out


def compare(args: argparse.Namespace, name: str, rates: list[float], cpus: tuple[int, ...], workdir: Path,
            profile: Profile | None) -> dict[str, Any]:
    prompt, output, slo_text = WORKLOADS[name]
    traffic = Traffic.parse(prompt, output, seed=args.seed)
    slo_text = args.slo or slo_text
    if profile is not None:
        slo_text = relative_slos(slo_text, profile, traffic)
    slos = parse_slos(slo_text)
    workload = WorkloadConfig(parse_dist(prompt), parse_dist(output), seed=args.seed, tokenizer=args.model)
    shapes = [(Shape(1, 1), cpus), (Shape(0, 1), cpus), (Shape(0, 2), cpus)]
    print(f"\n== compare on {name}: prompt {prompt}, output {output}, SLO {slo_text}; rates {rates}",
          flush=True)
    out: dict[str, Any] = {"workload": name, "prompt": prompt, "output": output, "slo": slo_text,
                           "shapes": {}}
    for shape, shape_cpus in shapes:
        label = f"{shape.label}/{len(shape_cpus)}cores"
        runs = []
        for rate in sorted(rates):
            m = measure(args.model, shape, shape_cpus, workload, rate, args.requests, slos, args.attainment,
                        workdir / f"compare-{name}-{shape.label.replace(':', '')}-{rate}")
            f = m.figures()
            pred = None
            if profile is not None and shape.nodes == len(shape_cpus):  # the profile is one node on one core
                planner = Planner(PlanConfig(profile, slos, args.attainment, 2, rate, False, traffic,
                                             requests=args.requests))
                pred = figures(planner.simulate(shape, rate).summary)
            runs.append({"rate": rate, "measured": f, "predicted": pred})
            print(f"  {label:<14} {rate:>6.3g} req/s  TTFT p90 {f['ttft_p90']:.3f} s  TPOT p99 "
                  f"{1000 * f['tpot_p99']:.1f} ms  attainment {f['attainment']:.2f}  goodput {f['goodput']:.3f}"
                  + (f"  (sim: TTFT p90 {pred['ttft_p90']:.3f}, TPOT p99 {1000 * pred['tpot_p99']:.1f} ms)"
                     if pred else ""), flush=True)
            if not m.summary.meets_target and not args.full_sweep:
                break
        good = [r["rate"] for r in runs if r["measured"]["meets_target"]]
        out["shapes"][label] = {"runs": runs, "highest_rate_within_slo": max(good) if good else None}
    print("\n  highest rate within the SLOs: " + ", ".join(
        f"{k} {v['highest_rate_within_slo']}" for k, v in out["shapes"].items()), flush=True)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, shape in result["shapes"].items():
        rates = [r["rate"] for r in shape["runs"]]
        a1.plot(rates, [1000 * r["measured"]["tpot_p99"] for r in shape["runs"]], "o-", label=label)
        a2.plot(rates, [r["measured"]["goodput"] for r in shape["runs"]], "o-", label=label)
    for slo in parse_slos(result["slo"]):
        if slo.metric == "tpot":
            a1.axhline(1000 * slo.threshold_s, ls="--", color="grey", label=f"SLO {slo.name}")
    a1.set(xlabel="offered rate (req/s)", ylabel="TPOT p99 (ms)", title=f"{result['workload']}: TPOT p99")
    a2.set(xlabel="offered rate (req/s)", ylabel="goodput (req/s within SLO)", title="goodput")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory, or tiny (default: the embedded default model)")
    ap.add_argument("--profile", default=None, help="a pdserve profile JSON measured with one thread on one core")
    ap.add_argument("--quick-profile", action="store_true", help="pdserve profile --quick (smoke runs)")
    ap.add_argument("--validate", default="prompt-heavy,output-heavy,mixed",
                    help=f"workloads to validate the planner on ({', '.join(WORKLOADS)}; '' for none)")
    ap.add_argument("--compare", action="append", default=[], metavar="WORKLOAD=R1,R2,...",
                    help="disaggregated against colocated on a workload at these rates (repeatable)")
    ap.add_argument("--full-sweep", action="store_true", help="--compare: every rate, not only up to the first miss")
    ap.add_argument("--requests", type=int, default=40, help="requests per measured run (40)")
    ap.add_argument("--sim-requests", type=int, default=400, help="simulated requests per sweep step (400)")
    ap.add_argument("--slo", default="", help="override every workload's SLOs, e.g. ttft_p90=4s,tpot_p99=150ms, "
                                              "or relative to the profile: ttft_p90=5x,tpot_p99=3x")
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-overheads", action="store_true",
                    help="--validate: simulate the profile's engine steps alone (skips measuring the overheads)")
    ap.add_argument("--allow-other-machine", action="store_true",
                    help="use a --profile measured on another CPU kind anyway (warned)")
    ap.add_argument("--predict-only", action="store_true",
                    help="--validate: print the planner's predictions (rates, shapes, figures) without starting a "
                         "cluster or measuring anything but the profile (none with --profile)")
    ap.add_argument("--out", default="shapes-result", help="directory for JSON and plots")
    args = ap.parse_args()
    args.model = str(resolve_model(args.model).path)
    args.validate = [w for w in args.validate.split(",") if w]
    compares: list[tuple[str, list[float]]] = []
    for item in args.compare:
        name, _, rates = item.partition("=")
        try:
            compares.append((name, [float(r) for r in rates.split(",") if r]))
        except ValueError:
            ap.error(f"bad --compare {item!r}: WORKLOAD=R1,R2,...")
        if not compares[-1][1]:
            ap.error(f"--compare {item!r} needs rates")
    for w in [*args.validate, *(c[0] for c in compares)]:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}: {', '.join(WORKLOADS)}")
    cpus = tuple(sorted(os.sched_getaffinity(0)))[:2]
    if args.predict_only:
        if compares:
            ap.error("--predict-only predicts --validate's workloads; --compare measures")
        args.no_overheads = True  # the overheads are measured on a running cluster
        cpus = cpus if len(cpus) >= 2 else (cpus[0], cpus[0])  # two nodes' worth of shapes, nothing pinned
    if len(cpus) < 2:
        ap.error("needs 2 usable CPUs: the shapes compared are 2 nodes on a core each against 1 node on both")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = load_profile_here(args.profile, args.allow_other_machine) if args.profile else None
    relative = any(v.endswith("x") for w in (c[0] for c in compares)
                   for v in (args.slo or WORKLOADS[w][2]).replace("=", ",").split(","))
    if profile is None and (args.validate or relative):  # relative SLOs are this machine's profile's multiples
        profile = profile_here(args.model, out / "profile.json", cpus[0], args.quick_profile)
    result: dict[str, Any] = {"model": args.model, "attainment": args.attainment,
                              "requests": args.requests, "cpus": list(cpus), "started": time.time()}
    with tempfile.TemporaryDirectory(prefix="shapes-") as tmp:
        if args.validate:
            assert profile is not None
            overheads = None if args.no_overheads else calibrate_overheads(args.model, profile, cpus,
                                                                            Path(tmp) / "overheads")
            if overheads is not None:
                overheads.save(out / "overheads.json")
                result["overheads"] = dataclasses.asdict(overheads)
            result["validation"] = validate(args, profile, overheads, cpus, Path(tmp))
        result["compare"] = []
        for name, rates in compares:
            result["compare"].append(compare(args, name, rates, cpus, Path(tmp), profile))
            plot(result["compare"][-1], out / f"compare-{name}.png")
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    print(f"\nwrote {out / 'result.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
