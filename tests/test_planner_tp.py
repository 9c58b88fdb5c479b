"""The planner's tensor-parallel dimension: shapes with a TP width per pool (labels and their parser, the
rank budget), profiles keyed by width (the file, `Profile.at_tp`, a real profiling at TP 2), the
simulation timing each pool by its width's fits, and the plan's values file with each pool's `tp`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdserve.planner.loadgen.metrics import parse_slos
from pdserve.planner.plan import PlanConfig, Planner, shapes, values_document
from pdserve.planner.profile_model import EngineFacts, Linear, Profile, load_profile
from pdserve.planner.sim import Shape, SimRequest, simulate
from pdserve.planner.traffic import Traffic


def synthetic(tp: int = 1, decode: Linear = Linear(0.01), prefill: Linear = Linear(0.01),
              transfer: Linear = Linear(0.0), blocks: int = 100_000, seqs: int = 128) -> Profile:
    return Profile(prefill, decode, transfer, EngineFacts(16, blocks, 1000, 2048, seqs, 64),
                   machine={"synthetic": True}, tp=tp)


def two_widths() -> Profile:
    """TP 1, and TP 2 whose prefill runs at about half the cost per token (and holds twice the blocks)."""
    one = synthetic(1, decode=Linear(0.01, 1e-3, 1e-5), prefill=Linear(0.02, 1e-4, 1e-6),
                    transfer=Linear(0.003, 1e-8), blocks=1000)
    two = synthetic(2, decode=Linear(0.012, 6e-4, 6e-6), prefill=Linear(0.025, 5e-5, 5e-7),
                    transfer=Linear(0.003, 1e-8), blocks=2000)
    return one.with_widths([two])


# ---------------------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("shape,label", [
    (Shape(1, 2), "1P:2D"), (Shape(0, 2), "2C"), (Shape(1, 2, 2, 1), "1P(tp2):2D(tp1)"),
    (Shape(0, 2, 1, 2), "2C(tp2)"), (Shape(3, 1, 1, 4), "3P(tp1):1D(tp4)"), (Shape(2, 2, 2, 2), "2P(tp2):2D(tp2)"),
])
def test_labels_round_trip_through_the_parser(shape: Shape, label: str) -> None:
    assert shape.label == label
    assert Shape.parse(label) == shape


def test_the_parser_takes_either_form_and_refuses_bad_ones() -> None:
    assert Shape.parse("1p(TP2):2d") == Shape(1, 2, 2, 1)  # a width left out is 1; case and spaces ignored
    assert Shape.parse(" 1P:2D(tp2) ") == Shape(1, 2, 1, 2)
    assert Shape.parse("1P(tp1):2D(tp1)") == Shape(1, 2) and Shape(1, 2).label == "1P:2D"
    for bad in ("", "1P", "1P:0D", "0P:2D", "2C(tp0)", "1P(tp):1D", "2X", "1P(tp2)2D", "-1C"):
        with pytest.raises(ValueError):
            Shape.parse(bad)
    with pytest.raises(ValueError, match="prefill_tp"):
        Shape(0, 2, 2, 1)  # a colocated shape has no prefill pool to be wide
    with pytest.raises(ValueError, match="decode_tp"):
        Shape(1, 1, 1, 0)


def test_a_tp_node_counts_its_ranks_against_the_budget() -> None:
    assert Shape(1, 2, 2, 1).cores == 4 and Shape(1, 2, 2, 1).nodes == 3
    assert Shape(0, 3, 1, 2).cores == 6
    # TP 1 only: the same shapes, in the same order, as the node budget gave before.
    old = [Shape(0, n) for n in range(1, 5)] + [Shape(p, n - p) for n in range(2, 5) for p in range(1, n)]
    assert shapes(4) == sorted(old, key=lambda s: (s.nodes, s.prefill))
    wide = shapes(4, (1, 2))
    assert all(s.cores <= 4 for s in wide) and len(set(wide)) == len(wide)
    assert {Shape(0, 1, 1, 2), Shape(0, 2, 1, 2), Shape(1, 1, 2, 1), Shape(1, 1, 2, 2), Shape(1, 2, 2, 1),
            Shape(2, 1, 1, 2)} <= set(wide)
    assert Shape(2, 1, 2, 1) not in wide and Shape(1, 2, 2, 2) not in wide  # 5 and 6 ranks
    assert [s.cores for s in wide] == sorted(s.cores for s in wide)


# ---------------------------------------------------------------------------------------- profiles


def test_a_profile_keeps_each_width_and_old_files_are_tp_1(tmp_path: Path) -> None:
    prof = two_widths()
    assert prof.tp_widths == (1, 2) and prof.at_tp(2).prefill == Linear(0.025, 5e-5, 5e-7)
    path = tmp_path / "p.json"
    prof.save(path)
    data = json.loads(path.read_text())
    assert data["tensor_parallel_size"] == 1 and list(data["tp"]) == ["2"]
    back = load_profile(path)
    assert back.to_dict() == prof.to_dict() and back.at_tp(2).tp == 2 and back.at_tp(2).engine.num_kv_blocks == 2000
    with pytest.raises(ValueError, match="no TP 4 .*--tp-widths 1,2,4"):
        back.at_tp(4)
    # A profile written before TP: no width recorded, read as TP 1.
    del data["tensor_parallel_size"], data["tp"]
    path.write_text(json.dumps(data))
    old = load_profile(path)
    assert old.tp == 1 and old.tp_widths == (1,)
    data["tp"] = {"two": data["fits"]}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not integers"):
        load_profile(path)


# ---------------------------------------------------------------------------------------- simulation


def test_each_pool_is_timed_by_its_widths_profile() -> None:
    """1P(tp2):1D(tp1): the prompt by TP 2's prefill fit and transfer, the decodes by TP 1's decode fit;
    and the other way round for 1P(tp1):1D(tp2)."""
    prof = two_widths()
    prompt, out = 500, 6
    rec = simulate(prof, Shape(1, 1, 2, 1), [SimRequest(0, 0.0, prompt, out)]).records[0]
    ttft = 0.025 + 5e-5 * prompt + 5e-7 * prompt * prompt
    transfer = 0.003 + 1e-8 * prompt * 1000
    decode = sum(0.01 + 1e-3 + 1e-5 * (prompt + i) for i in range(1, out))
    assert rec.ttft_s == pytest.approx(ttft)
    assert rec.e2e_s == pytest.approx(ttft + transfer + decode)
    rec = simulate(prof, Shape(1, 1, 1, 2), [SimRequest(0, 0.0, prompt, out)]).records[0]
    ttft1 = 0.02 + 1e-4 * prompt + 1e-6 * prompt * prompt
    decode2 = sum(0.012 + 6e-4 + 6e-6 * (prompt + i) for i in range(1, out))
    assert rec.ttft_s == pytest.approx(ttft1)
    assert rec.e2e_s == pytest.approx(ttft1 + transfer + decode2)
    # A colocated TP 2 node prefills and decodes by TP 2's fits.
    col = simulate(prof, Shape(0, 1, 1, 2), [SimRequest(0, 0.0, prompt, 2)]).records[0]
    assert col.ttft_s == pytest.approx(0.025 + 5e-5 * prompt + 5e-7 * prompt * prompt)
    with pytest.raises(ValueError, match="no TP 4"):
        simulate(prof, Shape(1, 1, 4, 1), [SimRequest(0, 0.0, 10, 2)])


def test_a_wide_decode_node_holds_its_widths_kv_blocks() -> None:
    """Prompts that need more blocks than a TP 1 decode node has fail there and fit a TP 2 one (twice the
    blocks, as profiled)."""
    prof = two_widths()
    req = [SimRequest(0, 0.0, 1500 * 16, 4)]  # 1500 blocks: over 1000, under 2000
    assert not simulate(prof, Shape(1, 1, 1, 1), req).records[0].ok
    assert simulate(prof, Shape(1, 1, 1, 2), req).records[0].ok


def test_the_plan_counts_ranks_and_writes_each_pools_width(tmp_path: Path) -> None:
    """With TP 1 and 2 under a budget of 3 ranks, a long-prompt traffic that needs a faster prefill than
    a TP 1 node gives is met by a TP 2 prefill node; the values file carries both widths and renders."""
    from pdserve.deploy.k8s.render import load_values, render_objects

    one = synthetic(1, decode=Linear(0.002), prefill=Linear(0.005, 4e-4))
    two = synthetic(2, decode=Linear(0.002), prefill=Linear(0.005, 1.5e-4))
    prof = one.with_widths([two])
    base = dict(traffic=Traffic.parse("2000", "8"), requests=200, rate=1.0)
    slos = parse_slos("ttft_p90=700ms")
    only_one = Planner(PlanConfig(prof, slos, 0.9, 3, **base)).run()
    assert {r.shape.tp for r in only_one.results} == {False}  # default: the profile's own width
    plan = Planner(PlanConfig(prof, slos, 0.9, 3, tp_widths=(1, 2), **base)).run()
    assert all(r.shape.cores <= 3 for r in plan.results)
    rec = plan.recommended
    assert rec is not None and rec.shape.cores <= 3 and rec.shape.tp, rec.shape
    assert all(not r.fits for r in plan.results if r.shape.cores < rec.shape.cores)
    d = plan.to_dict()
    assert d["tp_widths"] == [1, 2] and d["recommended"]["shape"] == rec.shape.label
    values = tmp_path / "values.yaml"
    values.write_text(values_document(rec.shape, "test"))
    v = load_values([values])
    assert v["decode"]["tp"] == rec.shape.decode_tp and v["prefill"]["tp"] == rec.shape.prefill_tp
    render_objects(v)
    assert "tp:" not in values_document(Shape(1, 2), "header")  # unchanged for TP 1 shapes
    with pytest.raises(ValueError, match="no TP 4"):
        PlanConfig(prof, slos, 0.9, 3, tp_widths=(1, 4), **base)


def test_plan_cli_takes_tp_widths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.deploy.cli import build_parser

    path = tmp_path / "p.json"
    two_widths().save(path)
    args = build_parser().parse_args(["plan", "--profile", str(path), "--workload", "prompt=64,output=8", "--rate",
                                      "1", "--slo", "ttft_p90=30s", "--max-cores", "2", "--tp-widths", "2,1",
                                      "--requests", "20", "--json"])
    assert args.tp_widths == (1, 2) and args.max_nodes == 2
    assert args.fn(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert "1C(tp2)" in {r["shape"] for r in out["shapes"]} and all(r["cores"] <= 2 for r in out["shapes"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--profile", str(path), "--tp-widths", "0,1"])


def test_the_autoscaler_keeps_the_pools_widths_and_counts_ranks() -> None:
    """Decode nodes of TP 2 (one sequence at a time, 50 ms a step): the candidates keep the widths within a
    budget of ranks, and a controller that counts nodes from the metrics (no widths) scales the decode
    pool at its width."""
    from pdserve.planner.autoscale import AutoscaleConfig, Controller, ExportActuator, propose
    from pdserve.planner.check import Observed
    from pdserve.planner.sim import NodeSettings

    prof = synthetic(1, decode=Linear(0.1), prefill=Linear(0.005, 1e-5), seqs=1).with_widths(
        [synthetic(2, decode=Linear(0.05), prefill=Linear(0.005, 1e-5), seqs=1)])
    cfg = AutoscaleConfig(prof, parse_slos("ttft_p90=3s"), node_budget=5, decode_tp=2, cooldown_s=0.0,
                          settings=NodeSettings.of(prof))
    cands = cfg.candidates()
    assert cands[0] == cfg.minimum == Shape(1, 1, 1, 2)
    assert set(cands) == {Shape(1, 1, 1, 2), Shape(2, 1, 1, 2), Shape(1, 2, 1, 2), Shape(3, 1, 1, 2)}
    heavy = Observed(16, 16 * 12, 16 * 8, 4.0)  # 4 req/s of 8 tokens: more than one TP 2 node's 2.5 req/s
    p = propose(cfg, heavy, cfg.widths(Shape(1, 1)))
    assert not p.current_fits and p.target == Shape(1, 2, 1, 2)

    class Source:
        warm = True

        def observe(self) -> Observed:
            return Observed(16, 16 * 12, 16 * 8, 4.0, prefill_nodes=1, decode_nodes=1)

    d = Controller(cfg, Source(), ExportActuator(), say=lambda line: None).tick()
    assert d is not None and (d.action, d.target) == ("scale_up", Shape(1, 2, 1, 2)), d
    assert "1P(tp1):1D(tp2) misses the SLOs" in d.reason
    with pytest.raises(ValueError, match="node-budget must be >= 3"):
        AutoscaleConfig(prof, parse_slos("ttft_p90=3s"), node_budget=2, decode_tp=2)


# ---------------------------------------------------------------------------------------- profiling


def test_profiling_at_tp_1_and_2_runs_the_engine_at_each_width(tiny_llama_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`pdserve profile --tp-widths 1,2` (a smaller grid than --quick): a profile with both widths, the
    TP 2 one measured by an engine of two ranks; the KV transfer measured once and shared."""
    from pdserve.planner import measure

    ran: list[int] = []
    real = measure.LLMEngine

    def engine(cfg):  # type: ignore[no-untyped-def]
        ran.append(cfg.tensor_parallel_size)
        return real(cfg)

    monkeypatch.setattr(measure, "LLMEngine", engine)
    monkeypatch.setattr(measure, "QUICK", measure.Grid(prefill=((1, 16), (1, 64), (2, 32)), prefix=(64,),
                                                       decode=((1, 16), (2, 32), (4, 16)), transfer=(16, 64),
                                                       repeats=1, decode_steps=2))
    out = tmp_path / "profile.json"
    args = argparse.Namespace(model=str(tiny_llama_dir), dtype="auto", kv_memory=8, max_num_batched_tokens=256,
                              max_num_seqs=8, local_prefill_threshold=64, num_threads=1, out=str(out), quick=True,
                              no_progress=True, tp_widths=(1, 2))
    assert measure.main(args) == 0
    assert ran == [1, 2]
    prof = load_profile(out)
    assert prof.tp_widths == (1, 2)
    two = prof.at_tp(2)
    assert two.tp == 2 and two.points["decode"] and two.points["prefill"]
    assert two.transfer == prof.transfer and two.points["transfer"] == prof.points["transfer"]
    assert two.engine.num_kv_blocks > prof.engine.num_kv_blocks  # each rank holds half the KV heads
    for fit in (two.prefill, two.decode):
        assert fit.a >= 0 and fit.b >= 0 and fit.c >= 0
    # The profile plans TP 2 shapes.
    res = simulate(prof, Shape(1, 1, 2, 1), [SimRequest(0, 0.0, 40, 4)])
    assert res.records[0].ok


def test_check_reads_each_pools_width_from_the_nodes_info_series() -> None:
    """`plan --check` and the autoscaler count a node's pool and its TP width from its /metrics
    (pdserve_model_info{tp}); a pool's width is its widest node's; an older node without the label is TP 1."""
    from prometheus_client import generate_latest

    from pdserve.node_common.metrics import MetricLabels, NodeMetrics
    from pdserve.planner.check import Observed, node_pool

    def node_text(pool: str, name: str, tp: int | None) -> str:
        m = NodeMetrics(MetricLabels(pool, name, "tiny"))
        if tp is not None:
            m.set_info("f" * 16, "float32", 16, tp=tp)
        return generate_latest(m.registry).decode()

    nodes = [node_pool(node_text("prefill", "p0", 2)), node_pool(node_text("decode", "d0", 1)),
             node_pool(node_text("decode", "d1", None))]
    assert nodes == [("prefill", 2), ("decode", 1), ("decode", 1)]
    obs = Observed(10, 100, 100, 10.0)
    obs.count_nodes(nodes)
    assert obs.shape == Shape(1, 2, 2, 1) and obs.shape.label == "1P(tp2):2D(tp1)"
    obs.count_nodes([("decode", 2)])
    assert obs.shape == Shape(0, 1, 1, 2)
