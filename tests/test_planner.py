"""The capacity planner: the simulator against known answers (queueing theory, closed-form batches,
saturation at the cost model's capacity, colocated against disaggregated TPOT), the profile file, the
`pdserve profile` / `pdserve plan` commands, the values file they write (rendered by deploy/k8s), and
`pdserve plan --check` against a real small cluster. No timing assertions on this machine: simulated time
only."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pdserve.planner.loadgen.metrics import parse_slos
from pdserve.planner.profile_model import EngineFacts, Linear, Profile, fit_linear, load_profile
from pdserve.planner.sim import NodeSettings, Overheads, Shape, SimRequest, load_overheads, simulate
from pdserve.planner.traffic import Traffic


def synthetic(decode: Linear = Linear(0.01), prefill: Linear = Linear(0.01), transfer: Linear = Linear(0.0),
              blocks: int = 100_000, budget: int = 2048, seqs: int = 128, threshold: int = 64) -> Profile:
    """A hand-made cost model: every coefficient is what the test says."""
    return Profile(prefill, decode, transfer, EngineFacts(16, blocks, 1000, budget, seqs, threshold),
                   machine={"synthetic": True})


# ---------------------------------------------------------------------------------------- known answers


def test_one_token_requests_on_one_node_queue_like_md1() -> None:
    """One node serving one request a step (max_num_seqs=1) of constant time s, Poisson arrivals: M/D/1,
    whose mean wait is rho / (2 mu (1 - rho)); TTFT = wait + s."""
    s, rho = 0.01, 0.7
    rate = rho / s
    prof = synthetic(decode=Linear(s), prefill=Linear(s), seqs=1)
    reqs = Traffic.parse("1", "1", seed=3).requests(rate, 40_000)
    res = simulate(prof, Shape(0, 1), reqs)
    ttfts = [r.ttft_s for r in res.records if r.ttft_s is not None]
    assert len(ttfts) == 40_000
    mean_wait = sum(ttfts) / len(ttfts) - s
    expected = rho / (2 * (1 / s) * (1 - rho))
    assert mean_wait == pytest.approx(expected, rel=0.05)
    # Deterministic service: nobody waits less than zero, nobody is served faster than s.
    assert min(ttfts) == pytest.approx(s)


def test_simultaneous_identical_requests_finish_together_as_the_model_says() -> None:
    """N identical requests at once on one colocated node: one prefill step for all N prompts, then K-1
    decode steps of batch N whose context grows by N tokens a step."""
    n, prompt, out = 8, 100, 10
    prof = synthetic(decode=Linear(0.01, 1e-3, 1e-5), prefill=Linear(0.02, 1e-4, 1e-6))
    reqs = [SimRequest(i, 0.0, prompt, out) for i in range(n)]
    res = simulate(prof, Shape(0, 1), reqs)
    t1 = 0.02 + 1e-4 * n * prompt + 1e-6 * n * prompt * prompt
    decode = sum(0.01 + 1e-3 * n + 1e-5 * n * (prompt + i) for i in range(1, out))
    for rec in res.records:
        assert rec.ok and rec.output_tokens == out
        assert rec.ttft_s == pytest.approx(t1)
        assert rec.e2e_s == pytest.approx(t1 + decode)
        assert len(rec.itl_s) == out - 1


def test_remote_prefill_adds_the_transfer_and_decodes_on_the_decode_node() -> None:
    prompt, out = 500, 6
    prof = synthetic(decode=Linear(0.01, 1e-3, 1e-5), prefill=Linear(0.02, 1e-4, 1e-6),
                     transfer=Linear(0.003, 1e-8))
    res = simulate(prof, Shape(1, 1), [SimRequest(0, 0.0, prompt, out)])
    rec = res.records[0]
    ttft = 0.02 + 1e-4 * prompt + 1e-6 * prompt * prompt
    transfer = 0.003 + 1e-8 * prompt * 1000
    decode = sum(0.01 + 1e-3 + 1e-5 * (prompt + i) for i in range(1, out))
    assert rec.ttft_s == pytest.approx(ttft)
    assert rec.e2e_s == pytest.approx(ttft + transfer + decode)
    # A prompt under the local-prefill threshold never leaves the decode node: no transfer.
    short = simulate(prof, Shape(1, 1), [SimRequest(0, 0.0, 10, 2)]).records[0]
    assert short.ttft_s == pytest.approx(0.02 + 1e-4 * 10 + 1e-6 * 100)
    assert short.e2e_s == pytest.approx(short.ttft_s + 0.01 + 1e-3 + 1e-5 * 11)


def test_a_busy_decode_node_reserves_blocks_between_steps() -> None:
    """The engine thread reserves a remote prompt's blocks only between steps: a request that arrives
    while the decode node is mid-step reaches the prefill node when that step ends."""
    prof = synthetic(decode=Linear(0.1), prefill=Linear(0.02))
    busy = SimRequest(0, 0.0, 10, 20)  # local (under the threshold): the node decodes it from t=0.02
    late = SimRequest(1, 0.05, 500, 2)  # arrives in the middle of the first step (0.02 .. 0.12)
    res = simulate(prof, Shape(1, 1), [busy, late])
    assert res.records[1].ttft_s == pytest.approx(0.12 - 0.05 + 0.02)
    # An idle decode node reserves at once.
    alone = simulate(prof, Shape(1, 1), [SimRequest(0, 0.05, 500, 2)]).records[0]
    assert alone.ttft_s == pytest.approx(0.02)


def test_overheads_add_what_they_say() -> None:
    """Each overhead alone, against the bare simulation of one request: latency delays every token (TTFT
    and e2e, not the gaps); a prefill node's per-prompt CPU lengthens its step; a decode node's per-request
    CPU lengthens its first step there, its per-token CPU every step."""
    prof = synthetic(decode=Linear(0.01), prefill=Linear(0.02), transfer=Linear(0.0))
    req = [SimRequest(0, 0.0, 500, 4)]
    bare = simulate(prof, Shape(1, 1), req).records[0]
    assert bare.ttft_s == pytest.approx(0.02) and bare.e2e_s == pytest.approx(0.05)

    def one(shape: Shape = Shape(1, 1), **costs: float) -> Any:
        return simulate(prof, shape, req, overheads=Overheads(**costs)).records[0]

    lat = one(latency_s=0.005, latency_per_prompt_token_s=1e-5)
    assert lat.ttft_s == pytest.approx(0.02 + 0.005 + 0.005) and lat.e2e_s == pytest.approx(0.05 + 0.01)
    assert lat.itl_s == pytest.approx(bare.itl_s)
    assert one(prefill_cpu_per_request_s=0.003).ttft_s == pytest.approx(0.023)
    remote = one(decode_cpu_per_remote_request_s=0.004, decode_cpu_per_local_request_s=1.0)
    assert remote.itl_s == pytest.approx([0.014, 0.01, 0.01])
    local = one(Shape(0, 1), decode_cpu_per_remote_request_s=1.0, decode_cpu_per_local_request_s=0.004)
    # colocated: the prefill step emits the first token, which is the request's first step there
    assert local.ttft_s == pytest.approx(0.024) and local.itl_s == pytest.approx([0.01, 0.01, 0.01])
    tok = one(decode_cpu_per_token_s=0.001)
    assert tok.itl_s == pytest.approx([0.011, 0.011, 0.011])


def test_host_processes_take_the_cores_the_nodes_leave_then_the_prefill_nodes() -> None:
    o = Overheads(host_cpu_per_token_s=1e-3, host_cores=2)
    assert o.host_share(Shape(0, 1), False, 0.8) == 0.0  # one node on two cores: the other core absorbs it
    assert o.host_share(Shape(0, 1), False, 1.3) == pytest.approx(0.3)
    assert o.host_share(Shape(1, 1), True, 0.3) == pytest.approx(0.3)  # disaggregated: the prefill node's core
    assert o.host_share(Shape(1, 1), False, 0.3) == 0.0
    assert o.host_share(Shape(0, 2), False, 0.3) == pytest.approx(0.15)  # colocated: spread over the nodes
    assert o.host_share(Shape(1, 1), True, 3.0) == Overheads.MAX_SHARE
    assert Overheads(host_cpu_per_token_s=1e-3).host_share(Shape(1, 1), True, 3.0) == 0.0  # cores of their own
    # In a run: streamed tokens slow the prefill node, so a later prompt's TTFT grows; decode steps do not.
    prof = synthetic(decode=Linear(0.01), prefill=Linear(0.1))
    reqs = [SimRequest(i, 0.3 * i, 500, 100) for i in range(8)]
    bare = simulate(prof, Shape(1, 1), reqs).records
    shared = simulate(prof, Shape(1, 1), reqs, overheads=Overheads(host_cpu_per_token_s=2e-3, host_cores=2)).records
    assert shared[0].ttft_s == pytest.approx(bare[0].ttft_s)  # nothing streamed yet
    assert shared[-1].ttft_s > 1.2 * bare[-1].ttft_s
    assert all(gap == pytest.approx(0.01) for r in shared for gap in r.itl_s[1:])  # after the join: 10 ms steps
    with pytest.raises(ValueError):
        Overheads(latency_s=-1.0)


def test_overheads_round_trip_and_bad_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "overheads.json"
    o = Overheads(latency_s=0.01, prefill_cpu_per_request_s=0.02, host_cpu_per_token_s=3e-4, host_cores=2)
    o.save(path)
    assert load_overheads(path) == o
    path.write_text('{"latency": 1}')
    with pytest.raises(ValueError, match="not an overheads file"):
        load_overheads(path)


def test_throughput_saturates_at_the_profile_capacity() -> None:
    """Decode-bound traffic on one node of batch 8: at most 8 tokens a step of a + 8b seconds."""
    a, b, batch, out = 0.01, 1e-3, 8, 64
    prof = synthetic(decode=Linear(a, b), prefill=Linear(a, b), seqs=batch)
    capacity = batch / (a + b * batch)  # tokens/s
    traffic = Traffic.parse("1", str(out), seed=1)
    over = simulate(prof, Shape(0, 1), traffic.requests(10 * capacity / out, 400)).summary
    assert over.output_token_rate == pytest.approx(capacity, rel=0.05)
    under_rate = 0.3 * capacity / out
    under = simulate(prof, Shape(0, 1), traffic.requests(under_rate, 400)).summary
    assert under.request_rate == pytest.approx(under_rate, rel=0.15)
    assert under.latency["ttft"].p50 < over.latency["ttft"].p50


def test_colocated_tpot_spikes_on_long_prompts_and_disaggregated_does_not() -> None:
    """Prefill chunks of long prompts share a colocated node's steps with its decodes; on a decode node
    they run elsewhere."""
    prof = synthetic(decode=Linear(0.01, 2e-4, 1e-7), prefill=Linear(0.01, 1e-4, 1e-8),
                     transfer=Linear(0.002, 1e-9), threshold=64)
    p99: dict[tuple[str, str], float] = {}
    for prompts in ("uniform:100:200", "uniform:2000:4000"):
        reqs = Traffic.parse(prompts, "64", seed=2).requests(2.0, 300)
        for shape in (Shape(0, 2), Shape(1, 1)):
            p99[(prompts, shape.label)] = simulate(prof, shape, reqs).summary.latency["tpot"].p99
    short, long_ = "uniform:100:200", "uniform:2000:4000"
    assert p99[(long_, "2C")] > 2 * p99[(short, "2C")]
    assert p99[(long_, "1P:1D")] < 1.5 * p99[(short, "1P:1D")]
    assert p99[(long_, "2C")] > 2 * p99[(long_, "1P:1D")]


def test_kv_capacity_makes_requests_wait_for_blocks_and_preempts() -> None:
    """A KV cache of 20 blocks (320 tokens) and requests of 100 + 100 tokens: they cannot all run together,
    so some wait for blocks or are preempted, and every block is free at the end (checked by the run)."""
    prof = synthetic(decode=Linear(0.01), prefill=Linear(0.01), blocks=20)
    reqs = [SimRequest(i, 0.0, 100, 100) for i in range(6)]
    big = simulate(synthetic(decode=Linear(0.01), prefill=Linear(0.01)), Shape(0, 1), reqs)
    small = simulate(prof, Shape(0, 1), reqs)
    assert all(r.ok for r in small.records)
    assert small.preemptions > 0
    assert small.summary.duration_s > big.summary.duration_s
    # A prompt the whole pool cannot hold fails like the scheduler's rejection.
    res = simulate(prof, Shape(1, 1), [SimRequest(0, 0.0, 1000, 4), SimRequest(1, 0.0, 10, 4)])
    assert [r.ok for r in res.records] == [False, True]
    assert res.records[0].error == "abort"
    # One that outgrows the whole pool while generating: preempted, then cut short ("length").
    res = simulate(prof, Shape(0, 1), [SimRequest(0, 0.0, 100, 400)])
    (rec,) = res.records
    # It runs until its 320 computed tokens fill the pool; the token sampled last makes 321, which no
    # longer fits, so it ends with 321 - 100 completion tokens, as the engine's rejection would.
    assert rec.ok and rec.output_tokens == 320 + 1 - 100
    assert res.preemptions >= 1


def test_simulation_is_deterministic_for_a_seed() -> None:
    prof = synthetic(decode=Linear(0.01, 1e-4, 1e-7), prefill=Linear(0.01, 1e-4, 1e-8))
    run = [simulate(prof, Shape(1, 2), Traffic.parse("uniform:10:800", "uniform:1:50", seed=s).requests(20, 200))
           for s in (5, 5, 6)]
    assert [r.e2e_s for r in run[0].records] == [r.e2e_s for r in run[1].records]
    assert [r.e2e_s for r in run[0].records] != [r.e2e_s for r in run[2].records]


def test_slo_summary_uses_loadgen_definitions() -> None:
    prof = synthetic(decode=Linear(0.01), prefill=Linear(0.01))
    reqs = [SimRequest(i, 0.0, 10, 5) for i in range(4)]
    res = simulate(prof, Shape(0, 1), reqs, parse_slos("ttft_p90=5ms"), 0.9)
    assert res.summary.attainment == 0.0 and not res.summary.meets_target  # TTFT is one 10 ms step
    res = simulate(prof, Shape(0, 1), reqs, parse_slos("ttft_p90=15ms,tpot_p99=15ms"), 0.9)
    assert res.summary.attainment == 1.0 and res.summary.meets_target
    assert res.summary.goodput_rate == pytest.approx(4 / 0.05)


# ---------------------------------------------------------------------------------------- profile file


def test_fit_recovers_known_coefficients() -> None:
    rows = [(float(x1), float(x2)) for x1 in (1, 4, 16, 64) for x2 in (10, 300, 5000)]
    ys = [0.003 + 2e-4 * x1 + 5e-7 * x2 for x1, x2 in rows]
    fit = fit_linear(rows, ys)
    assert fit.a == pytest.approx(0.003, rel=1e-4)
    assert fit.b == pytest.approx(2e-4, rel=1e-4)
    assert fit.c == pytest.approx(5e-7, rel=1e-4)
    assert fit.rmse < 1e-9
    # A feature that never varies gets no coefficient (instead of a singular system).
    flat = fit_linear([(float(x), 0.0) for x in range(1, 6)], [1 + 2 * x for x in range(1, 6)])
    assert (flat.a, flat.b, flat.c) == pytest.approx((1.0, 2.0, 0.0), abs=1e-6)


def test_profile_round_trips_and_refuses_other_schema_versions(tmp_path: Path) -> None:
    prof = synthetic(decode=Linear(0.01, 1e-3, 1e-6, 1e-4))
    prof.points = {"decode": [{"batch": 1, "context": 10, "seconds": 0.011}]}
    path = tmp_path / "p.json"
    prof.save(path)
    back = load_profile(path)
    assert back.to_dict() == prof.to_dict()
    data = json.loads(path.read_text())
    data["schema_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="schema_version"):
        load_profile(path)


def test_node_settings_override_the_profile() -> None:
    s = NodeSettings.of(synthetic(), max_num_seqs=4, local_prefill_threshold=None)
    assert (s.max_num_seqs, s.local_prefill_threshold) == (4, 64)
    with pytest.raises(ValueError):
        Shape(1, 0)
    assert Shape(0, 3).label == "3C" and Shape(2, 3).label == "2P:3D" and not math.isnan(Shape(2, 3).nodes)


def test_the_planner_needs_no_torch() -> None:
    """`pdserve plan` runs where torch is not installed: only `planner.measure` imports the engine."""
    import subprocess
    import sys

    code = ("import sys, pdserve.planner.sim, pdserve.planner.traffic, pdserve.planner.profile_model, "
            "pdserve.planner.plan, pdserve.planner.cli, pdserve.planner.check, pdserve.deploy.cli\n"
            "pdserve.deploy.cli.build_parser()\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------- plan


def _plan_args(*argv: str) -> list[str]:
    return ["plan", *argv]


def _run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from pdserve.deploy.cli import build_parser

    args = build_parser().parse_args(argv)
    rc = args.fn(args)
    return rc, capsys.readouterr().out


def _long_prompt_profile(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    synthetic(decode=Linear(0.01, 2e-4, 1e-7), prefill=Linear(0.01, 1e-4, 1e-8), transfer=Linear(0.002, 1e-9),
              blocks=4000).save(path)
    return path


def test_plan_recommends_the_cheapest_fitting_shape(tmp_path: Path) -> None:
    """The recommendation is the fewest nodes that fit; every cheaper shape misses the SLOs, and the
    recommended one meets them in its own simulation."""
    from pdserve.planner.plan import PlanConfig, Planner

    prof = load_profile(_long_prompt_profile(tmp_path))
    cfg = PlanConfig(prof, parse_slos("ttft_p90=1s,tpot_p99=18ms"), 0.9, 5, rate=4.0,
                     traffic=Traffic.parse("uniform:100:3000", "64"), requests=300)
    plan = Planner(cfg).run()
    rec = plan.recommended
    assert rec is not None and rec.fits and rec.best is not None and rec.best.summary.meets_target
    assert all(not r.fits for r in plan.results if r.shape.nodes < rec.shape.nodes)
    assert len(plan.results) == 5 + sum(n - 1 for n in range(2, 6))
    # A tight TPOT SLO with long prompts: colocated nodes cannot hold it at this size, split ones can.
    assert not rec.shape.colocated
    same_size_colocated = next(r for r in plan.results if r.shape == Shape(0, rec.shape.nodes))
    assert not same_size_colocated.fits


def test_sweep_brackets_each_shapes_highest_rate(tmp_path: Path) -> None:
    from pdserve.planner.plan import SWEEP_RESOLUTION, PlanConfig, Planner

    prof = synthetic(decode=Linear(0.01, 1e-3), prefill=Linear(0.01, 1e-4), seqs=16)
    cfg = PlanConfig(prof, parse_slos("ttft_p90=500ms"), 0.9, 2, sweep=True, traffic=Traffic.parse("32", "32"),
                     requests=200)
    planner = Planner(cfg)
    plan = planner.run()
    by = {r.shape.label: r for r in plan.results}
    for r in plan.results:
        assert r.max_rate is not None and r.at_max is not None and r.at_max.summary.meets_target
        above = [run for run in r.curve if run.rate and run.rate > r.max_rate]
        assert above and not min(above, key=lambda x: x.rate or 0).summary.meets_target
        assert min(x.rate or 0 for x in above) <= r.max_rate * SWEEP_RESOLUTION * 1.0001
    assert by["2C"].max_rate > 1.5 * by["1C"].max_rate  # two nodes: about twice the rate


def test_plan_cli_prints_json_and_writes_a_values_file_the_render_accepts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.deploy.k8s.render import load_values, render_objects

    values = tmp_path / "values.yaml"
    overheads = tmp_path / "overheads.json"
    Overheads(latency_s=0.01, prefill_cpu_per_request_s=0.005).save(overheads)
    rc, out = _run_cli(_plan_args("--profile", str(_long_prompt_profile(tmp_path)), "--workload",
                                  "prompt=uniform:100:3000,output=64", "--rate", "4", "--slo",
                                  "ttft_p90=1s,tpot_p99=18ms", "--max-nodes", "4", "--requests", "300",
                                  "--overheads", str(overheads), "--values-out", str(values), "--json"), capsys)
    assert rc == 0
    result = json.loads(out)
    rec = result["recommended"]
    assert rec["run"]["meets_target"] and rec["prefill"] >= 1
    objs = render_objects(load_values([values]))
    replicas = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]["replicas"]
                for d in objs if d["kind"] == "Deployment"}
    assert (replicas["prefill"], replicas["decode"]) == (rec["prefill"], rec["decode"])


def test_plan_with_no_fitting_shape_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    values = tmp_path / "values.yaml"
    rc, out = _run_cli(_plan_args("--profile", str(_long_prompt_profile(tmp_path)), "--workload",
                                  "prompt=3000,output=8", "--rate", "50", "--slo", "ttft_p90=10ms",
                                  "--max-nodes", "2", "--requests", "50", "--values-out", str(values)), capsys)
    assert rc == 1 and "no shape of at most 2 nodes" in out
    assert not values.exists()


def test_plan_replays_a_trace_at_its_own_rate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": i * 0.5, "prompt_tokens": 50 + i, "output_tokens": 8}) + "\n"
                             for i in range(40)) + json.dumps({"arrival_s": 20.0, "prompt": "a b c",
                                                               "output_tokens": 4}) + "\n")
    plot = tmp_path / "plan.png"
    rc, out = _run_cli(_plan_args("--profile", str(_long_prompt_profile(tmp_path)), "--trace", str(trace),
                                  "--slo", "ttft_p90=1s", "--max-nodes", "2", "--plot", str(plot), "--json"), capsys)
    assert rc == 0
    result = json.loads(out)
    assert result["target_rate"] == pytest.approx(40 / 20.0)
    assert result["recommended"]["shape"] == "1C"  # light traffic: one node is enough
    assert plot.stat().st_size > 0


def test_workload_spec_errors_are_clear() -> None:
    from pdserve.planner.cli import parse_workload

    t = parse_workload("prompt=uniform:1:9,output=7,prefix=5")
    assert (str(t.prompt_tokens), str(t.output_tokens), t.shared_prefix_tokens) == ("uniform:1:9", "7", 5)
    for bad in ("prompt", "foo=1", "prefix=x", "prompt=uniform:9:1"):
        with pytest.raises(ValueError):
            parse_workload(bad)


def test_fit_drops_a_slope_that_noise_makes_negative() -> None:
    rows = [(1.0, 10.0), (2.0, 10.0), (4.0, 10.0), (8.0, 20.0)]
    ys = [0.010, 0.009, 0.008, 0.012]  # a falling cost per sequence is noise, not physics
    fit = fit_linear(rows, ys)
    assert fit.b == 0.0 and fit.c >= 0.0
    # Likewise a negative fixed cost: the line goes through the origin instead.
    through = fit_linear([(1.0, 0.0), (2.0, 0.0), (3.0, 0.0)], [0.5, 1.5, 2.5])
    assert through.a == 0.0 and through.b > 0


# ---------------------------------------------------------------------------------------- smoke


def test_profile_quick_then_plan_on_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`pdserve profile --quick` on the tiny model writes a valid profile; `pdserve plan` on it prints a
    recommendation and writes a values file. No assertion on the timings themselves."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    prof_path, values = tmp_path / "profile.json", tmp_path / "values.yaml"
    out = subprocess.run([sys.executable, "-m", "pdserve.deploy", "profile", "--model", str(tiny_llama_dir), "--quick",
                          "--num-threads", "1", "--out", str(prof_path), "--no-progress"],
                         cwd=repo, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "decode_step_s" in out.stdout
    prof = load_profile(prof_path)
    data = json.loads(prof_path.read_text())
    assert data["schema_version"] == 1 and len(data["model"]["fingerprint"]) == 64
    assert data["machine"]["cpu_count"] >= 1 and prof.engine.num_kv_blocks > 0
    cpu = data["machine"]["cpu"]  # the machine kind `plan` compares against (planner/machine.py)
    assert cpu["vendor"] and cpu["model_name"] and cpu["kernel_isa"] and isinstance(cpu["flags"], list)
    assert {"prefill", "decode", "transfer"} <= data["points"].keys()
    assert any(p["cached"] > 0 for p in data["points"]["prefill"])  # the prefix-hit points
    assert all(p["seconds"] > 0 for pts in data["points"].values() for p in pts)
    for fit in (prof.prefill, prof.decode, prof.transfer):
        assert fit.a >= 0 and fit.b >= 0 and fit.c >= 0
    out = subprocess.run([sys.executable, "-m", "pdserve.deploy", "plan", "--profile", str(prof_path), "--workload",
                          "prompt=uniform:16:256,output=16", "--rate", "1", "--slo", "ttft_p90=30s",
                          "--max-nodes", "2", "--requests", "50", "--values-out", str(values)],
                         cwd=repo, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "recommended:" in out.stdout
    assert "replicas" in values.read_text()


# ---------------------------------------------------------------------------------------- --check


def test_check_reads_a_live_cluster_and_judges_its_shape(tiny_llama_dir: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A real 1P:1D cluster with a frontend serves a few requests; `plan --check` reads the frontend's and
    the nodes' /metrics: the request count and token totals equal what the responses reported, the
    shape is 1P:1D, and the verdict follows the SLO (lenient: fits; impossible: does not, nothing does)."""
    import httpx

    from pdserve.registry.etcd_server import free_port
    from testing.cluster import LocalCluster
    from testing.procs import start_frontend

    node_args = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "256", "--model-name", "tiny"]
    prof_path = _long_prompt_profile(tmp_path)
    with LocalCluster(tmp_path / "cluster", tiny_llama_dir, node_args=node_args) as cluster:
        cluster.start(1, 1, decode_args=["--local-prefill-threshold", "0"])
        fe = start_frontend("frontend", tmp_path, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                            "--model", f"tiny={tiny_llama_dir}", "--log-level", "warning")
        try:
            usage = []
            with httpx.Client(base_url=fe.base_url, timeout=60) as client:
                for i in range(5):
                    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "the cat " * (3 + i),
                                                             "max_tokens": 4 + i})
                    assert r.status_code == 200, r.text
                    usage.append(r.json()["usage"])
            cluster.wait_clean()
            urls = ["--metrics-url", f"{fe.base_url}/metrics"]
            for node in ("p0", "d0"):
                urls += ["--node-metrics-url", f"http://{cluster.nodes[node].info['metrics_address']}/metrics"]
            base = ["plan", "--check", "--profile", str(prof_path), *urls, "--window", "0", "--max-nodes", "3",
                    "--requests", "50", "--json"]
            rc, out = _run_cli([*base, "--slo", "ttft_p90=60s"], capsys)
            res = json.loads(out)
            obs = res["observed"]
            assert obs["requests"] == 5
            assert obs["prompt_tokens"] == sum(u["prompt_tokens"] for u in usage)
            assert obs["completion_tokens"] == sum(u["completion_tokens"] for u in usage)
            assert (obs["prefill_nodes"], obs["decode_nodes"], obs["prefill_tp"], obs["decode_tp"]) == (1, 1, 1, 1)
            assert obs["window_s"] > 0 and obs["rate"] > 0
            assert rc == 0 and res["current_fits"] is True and res["recommended"] is not None
            rc, out = _run_cli([*base, "--slo", "ttft_p90=1us"], capsys)
            res = json.loads(out)
            assert rc == 1 and res["current_fits"] is False and res["recommended"] is None
            rc, out = _run_cli([*base[:-1], "--slo", "ttft_p90=1us"], capsys)
            assert "current 1P:1D: does NOT fit" in out
            _check_through_prometheus(cluster, fe.base_url, tmp_path, prof_path, usage, capsys)
        finally:
            assert fe.stop() == 0, fe.proc.tail()
        cluster.check_integrity()


def _check_through_prometheus(cluster: Any, frontend_url: str, tmp_path: Path, prof_path: Path,
                              earlier: list[dict[str, int]], capsys: pytest.CaptureFixture[str]) -> None:
    """The same cluster scraped by a real Prometheus: `--check --prometheus` sees its shape and the
    traffic. `increase` extrapolates to the window's edges, and whether it counts the requests served
    before a series' first scrape depends on the Prometheus version (created-timestamp handling), so the
    count lies between the later batch and everything, and the mean lengths between the two batches'."""
    import subprocess
    import time

    import httpx
    import yaml

    from pdserve.deploy.metrics_render import query
    from pdserve.registry.etcd_server import free_port
    from tests.test_prometheus_live import prometheus_binary

    targets = [frontend_url.removeprefix("http://")]
    targets += [str(cluster.nodes[n].info["metrics_address"]) for n in ("p0", "d0")]
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
              "scrape_configs": [{"job_name": "pdserve", "honor_labels": True,
                                  "static_configs": [{"targets": targets}]}]}
    (tmp_path / "prom.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "prom.log", "wb") as log:
        proc = subprocess.Popen([prometheus_binary(), f"--config.file={tmp_path / 'prom.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def wait_for(expr: str, want: float) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "prom.log").read_text()[-2000:]
            try:
                if [v for _, v in query(url, expr)] == [want]:
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.2)  # the poll interval
        raise AssertionError(f"Prometheus never saw {expr} == {want}")

    try:
        wait_for('sum(pdserve_frontend_requests_total{status="200"})', 5)
        wait_for('count(count by (node) (pdserve_kv_blocks))', 2)
        prompt_tokens = completion_tokens = 0
        with httpx.Client(base_url=frontend_url, timeout=60) as client:
            for _ in range(6):
                r = client.post("/v1/completions", json={"model": "tiny", "prompt": "a dog " * 10, "max_tokens": 6})
                assert r.status_code == 200, r.text
                prompt_tokens += r.json()["usage"]["prompt_tokens"]
                completion_tokens += r.json()["usage"]["completion_tokens"]
        wait_for('sum(pdserve_frontend_requests_total{status="200"})', 11)
        cluster.wait_clean()
        rc, out = _run_cli(["plan", "--check", "--profile", str(prof_path), "--prometheus", url, "--window", "600",
                            "--max-nodes", "3", "--requests", "50", "--slo", "ttft_p90=60s", "--json"], capsys)
        obs = json.loads(out)["observed"]
        assert rc == 0 and (obs["prefill_nodes"], obs["decode_nodes"], obs["prefill_tp"], obs["decode_tp"]) == (1, 1, 1, 1)
        assert 6 <= obs["requests"] <= 11 * 1.5
        for key, later in (("prompt_tokens", prompt_tokens / 6), ("completion_tokens", completion_tokens / 6)):
            first = sum(u[key] for u in earlier) / len(earlier)
            mean = obs["mean_prompt" if key == "prompt_tokens" else "mean_output"]
            assert 0.8 * min(first, later) <= mean <= 1.2 * max(first, later)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---------------------------------------------------------------------------------------- machine kind

_XEON = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)  Platinum 8480+\n"
         "flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8\n\n"
         "processor\t: 1\nvendor_id\t: GenuineIntel\n")
_ZEN3 = "vendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7763 64-Core Processor\nflags\t\t: sse2 avx2 fma f16c\n"


def test_machine_kind_reads_cpuinfo_and_names_what_differs() -> None:
    from pdserve.planner.machine import MachineKind, differences, this_machine

    xeon, zen = this_machine("avx512_vnni", _XEON), this_machine("avx2", _ZEN3)
    assert (xeon.vendor, xeon.model_name) == ("GenuineIntel", "Intel(R) Xeon(R) Platinum 8480+")
    assert "amx_bf16" in xeon.flags and "avx512_bf16" in xeon.flags and "avx512f" not in zen.flags
    assert MachineKind.from_dict(xeon.to_dict()) == xeon
    diff = differences(xeon, zen)
    assert any("lacks avx512f" in d and "amx_bf16" in d for d in diff) and any("vendor" in d for d in diff)
    assert differences(xeon, this_machine("avx512_vnni", _XEON)) == []
    here = this_machine()  # this machine: whatever it is, it is its own kind
    assert here.arch and differences(here, this_machine()) == []


def _profile_of(tmp_path: Path, cpu: dict[str, Any] | None) -> Path:
    prof = synthetic(decode=Linear(0.01, 2e-4, 1e-7), prefill=Linear(0.01, 1e-4, 1e-8), transfer=Linear(0.002, 1e-9))
    prof.machine = {} if cpu is None else {"cpu": cpu}
    path = tmp_path / "profile.json"
    prof.save(path)
    return path


def test_plan_refuses_a_profile_of_another_machine_kind_unless_allowed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A profile measured on another CPU kind is refused with a message naming both kinds and the flag;
    --allow-other-machine plans with it and warns loudly; an old profile without the record plans with a
    warning; a profile of this machine's kind plans silently."""
    from pdserve.planner.machine import this_machine

    here = this_machine()
    other = (this_machine("avx2", _ZEN3) if here.vendor != "AuthenticAMD" else this_machine("amx", _XEON)).to_dict()
    argv = ["plan", "--workload", "prompt=64,output=16", "--rate", "1", "--slo", "ttft_p90=30s", "--max-nodes", "2",
            "--requests", "20"]
    def run(cpu: dict[str, Any] | None, *extra: str) -> tuple[int, str, str]:
        from pdserve.deploy.cli import build_parser

        args = build_parser().parse_args([*argv, "--profile", str(_profile_of(tmp_path, cpu)), *extra])
        rc = args.fn(args)
        got = capsys.readouterr()
        return rc, got.out, got.err

    with pytest.raises(ValueError, match="measured on .* this machine is .*--allow-other-machine"):
        run(other)
    rc, out, err = run(other, "--allow-other-machine")
    assert rc == 0 and "recommended:" in out and "WARNING: --allow-other-machine" in err
    rc, out, err = run(None)
    assert rc == 0 and "records no CPU kind" in err
    rc, out, err = run(here.to_dict())
    assert rc == 0 and "recommended:" in out and "WARNING" not in err and "records no" not in err
