"""The autoscaling controller: its damping (hysteresis band, cooldown, one node down at a time, holds while a
change is under way), its proposals from the planner's simulator, and `pdserve up --autoscale` with real
processes: heavy traffic makes it start a decode node, light traffic makes it drain one (no request fails,
every KV block is accounted for after each), and a metrics source that stops answering leaves the shape as
it is, said in the log and in `pdserve_autoscale_metrics_up`.

The real-process decisions are made deterministic by the profile: a synthetic one whose decode nodes run
one sequence at a time at 100 ms a step, so 8-token requests at 4 req/s need more than one decode node
whatever this machine's speed, and 2-token requests at 1 req/s clearly do not."""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.planner.autoscale import (
    AutoscaleConfig,
    Controller,
    ControllerMetrics,
    ExportActuator,
    Proposal,
    damp,
    propose,
    step_down,
)
from pdserve.planner.check import Observed, ScrapeSource
from pdserve.planner.loadgen.metrics import parse_slos
from pdserve.planner.profile_model import EngineFacts, Linear, Profile
from pdserve.planner.sim import NodeSettings, Overheads, Shape
from pdserve.registry.etcd_server import free_port
from testing.up_cluster import UpCluster
from testing.waits import wait_until

SLO = "ttft_p90=3s"


def one_seq_profile() -> Profile:
    """Decode nodes that run one sequence at a time, 100 ms a step: a node serves 8-token requests at
    1.25 req/s at most."""
    return Profile(Linear(0.005, 1e-5), Linear(0.1), Linear(0.0), EngineFacts(16, 100_000, 1000, 2048, 1, 64),
                   machine={"synthetic": True})


def config(**kw: object) -> AutoscaleConfig:
    prof = one_seq_profile()
    args: dict[str, object] = dict(node_budget=3, interval_s=1.0, window_s=4.0, cooldown_s=10.0,
                                   settings=NodeSettings.of(prof))
    args.update(kw)
    return AutoscaleConfig(prof, parse_slos(SLO), **args)  # type: ignore[arg-type]


def proposal(current_fits: bool, target: Shape, *, fits: bool = True, margin: bool = True) -> Proposal:
    return Proposal(2.0, current_fits, 1.0 if current_fits else 0.2, target, fits, 0.95 if fits else 0.5, margin)


# ---------------------------------------------------------------------------------------- damping


def test_a_shape_that_meets_the_slos_is_kept() -> None:
    d = damp(Shape(1, 2), proposal(True, Shape(1, 2)), now=100, last_change=0, cooldown_s=10)
    assert d.action == "hold" and d.target == Shape(1, 2) and "meets the SLOs" in d.reason


def test_scale_up_when_the_shape_misses_and_not_within_the_cooldown() -> None:
    p = proposal(False, Shape(1, 2))
    d = damp(Shape(1, 1), p, now=100, last_change=0, cooldown_s=10)
    assert (d.action, d.target) == ("scale_up", Shape(1, 2)) and "1P:1D misses the SLOs" in d.reason
    d = damp(Shape(1, 1), p, now=105, last_change=100, cooldown_s=10)
    assert (d.action, d.target) == ("hold", Shape(1, 1)) and "cooldown: 5 s" in d.reason


def test_scale_down_needs_the_margin_and_goes_one_node_at_a_time() -> None:
    d = damp(Shape(1, 3), proposal(True, Shape(1, 1), margin=False), now=100, last_change=0, cooldown_s=10)
    assert d.action == "hold" and "hysteresis margin" in d.reason
    d = damp(Shape(1, 3), proposal(True, Shape(1, 1)), now=100, last_change=0, cooldown_s=10)
    assert (d.action, d.target) == ("scale_down", Shape(1, 2))
    d = damp(Shape(1, 3), proposal(True, Shape(1, 1)), now=100, last_change=95, cooldown_s=10)
    assert d.action == "hold" and "cooldown" in d.reason and "1P:2D" in d.reason
    assert step_down(Shape(2, 3), Shape(1, 1)) == Shape(2, 2)  # the pool furthest above its target first
    assert step_down(Shape(3, 2), Shape(1, 2)) == Shape(2, 2)


def test_a_change_under_way_holds_and_a_same_size_move_is_a_reshape() -> None:
    d = damp(Shape(1, 1), proposal(False, Shape(1, 2)), now=100, last_change=0, cooldown_s=10,
             busy="decode-1 is starting")
    assert d.action == "hold" and "decode-1 is starting" in d.reason
    d = damp(Shape(2, 1), proposal(False, Shape(1, 2)), now=100, last_change=0, cooldown_s=10)
    assert (d.action, d.target) == ("reshape", Shape(1, 2))
    d = damp(Shape(1, 2), proposal(False, Shape(1, 2), fits=False), now=100, last_change=0, cooldown_s=10)
    assert d.action == "hold" and "no shape within the budget does better" in d.reason


def test_proposals_follow_the_load_and_keep_the_kind() -> None:
    """The simulator's answers for the real-process tests' traffic: 8-token requests at 4 req/s need a
    second decode node (the budget's most), 2-token requests at 1 req/s fit one with the margin; no
    request in the window proposes the smallest shape; a colocated config proposes colocated shapes."""
    cfg = config()
    heavy = propose(cfg, Observed(16, 16 * 12, 16 * 8, 4.0), Shape(1, 1))
    assert not heavy.current_fits and heavy.target == Shape(1, 2)
    light = propose(cfg, Observed(4, 4 * 12, 4 * 2, 4.0), Shape(1, 2))
    assert light.current_fits and light.target == Shape(1, 1) and light.margin_fits
    idle = propose(cfg, Observed(0, 0, 0, 4.0), Shape(1, 2))
    assert idle.idle and idle.target == Shape(1, 1)
    col = propose(config(colocated=True), Observed(16, 16 * 12, 16 * 8, 4.0), Shape(0, 1))
    assert col.target.prefill == 0 and col.target.decode > 1
    with pytest.raises(ValueError, match="node-budget"):
        config(node_budget=1)


def test_overheads_enter_the_proposal() -> None:
    """The light load that one decode node serves on the engine steps alone does not fit once each
    request costs the decode node 1.5 s of CPU outside its steps (more than a second a second) (`--autoscale-overheads`): the
    controller then asks for the second decode node."""
    light = Observed(4, 4 * 12, 4 * 2, 4.0)
    assert propose(config(), light, Shape(1, 1)).current_fits
    costly = Overheads(decode_cpu_per_remote_request_s=1.5, decode_cpu_per_local_request_s=1.5)
    p = propose(config(overheads=costly), light, Shape(1, 1))
    assert not p.current_fits and p.target == Shape(1, 2)


def test_a_controller_without_its_metrics_source_keeps_the_shape_and_says_so() -> None:
    """A ScrapeSource on a port nothing listens on: every tick holds the shape KEDA last got, the log says
    it once, and the series say it (metrics_up 0, desired replicas unchanged)."""
    said: list[str] = []
    actuator = ExportActuator()
    actuator.apply(Shape(1, 2))
    metrics = ControllerMetrics()
    ctl = Controller(config(), ScrapeSource([f"http://127.0.0.1:{free_port()}/metrics"], [], 4.0, 0.5),
                     actuator, metrics, say=said.append)
    for _ in range(3):
        d = ctl.tick()
        assert d is not None and d.action == "hold" and d.target == Shape(1, 2)
    assert len(said) == 1 and "metrics source lost" in said[0] and "keeping 1P:2D" in said[0]
    assert metrics.registry.get_sample_value("pdserve_autoscale_metrics_up") == 0
    assert metrics.registry.get_sample_value("pdserve_autoscale_decisions_total", {"action": "hold"}) == 3
    assert actuator.shape() == Shape(1, 2)


# ---------------------------------------------------------------------------------------- real processes

pytestmark_up = pytest.mark.skipif(importlib.util.find_spec("pdserve.frontend.main") is None,
                                   reason="pdserve up serves through the frontend (frontend.main), which is missing")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpCluster]:
    workdir = tmp_path_factory.mktemp("autoscale")
    prof = workdir / "profile.json"
    one_seq_profile().save(prof)
    overheads = workdir / "overheads.json"
    Overheads().save(overheads)  # none: the decisions below are the profile's; the flag's path is exercised
    cluster = UpCluster.start(workdir, [
        "--model", "tiny", "--prefill", "1", "--decode", "1", "--lease-ttl", "2", "--kv-memory", "64",
        "--num-threads", "1", "--drain-timeout", "20", "--autoscale", "--node-budget", "3",
        "--autoscale-profile", str(prof), "--autoscale-slo", SLO, "--autoscale-interval", "1",
        "--autoscale-window", "4", "--autoscale-cooldown", "4", "--autoscale-overheads", str(overheads)],
        timeout_s=480)
    try:
        yield cluster
    finally:
        cluster.close()


class Load:
    """Open-loop requests at `rate` per second (each in a thread of its own) until stopped; every status
    (or exception) is kept."""

    def __init__(self, up: UpCluster, rate: float, max_tokens: int) -> None:
        self.up, self.rate, self.max_tokens = up, rate, max_tokens
        self.results: list[int | str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._model = up.state()["model"]
        self._pacer = threading.Thread(target=self._pace, daemon=True)
        self._pacer.start()

    def _one(self) -> None:
        try:
            r = httpx.post(f"{self.up.base_url}/v1/completions", timeout=60,
                           json={"model": self._model, "prompt": "the cat sat on the mat",
                                 "max_tokens": self.max_tokens, "ignore_eos": True})
            self.results.append(r.status_code if r.status_code == 200 else f"{r.status_code}: {r.text[:200]}")
        except httpx.HTTPError as err:
            self.results.append(f"{type(err).__name__}: {err}")

    def _pace(self) -> None:
        while not self._stop.wait(1.0 / self.rate):  # the arrival schedule
            t = threading.Thread(target=self._one, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> list[int | str]:
        self._stop.set()
        self._pacer.join()
        for t in self._threads:
            t.join(timeout=90)
        return self.results


def autoscaler_metrics(up: UpCluster) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    target = next(g for g in up.targets() if g["labels"]["pool"] == "autoscaler")["targets"][0]
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def decode_nodes(up: UpCluster) -> list[str]:
    return sorted(n for n, p in up.nodes().items() if p["pool"] == "decode")


@pytestmark_up
@pytest.mark.timeout(900)
def test_heavy_traffic_starts_a_decode_node(up: UpCluster) -> None:
    assert decode_nodes(up) == ["decode-0"]
    load = Load(up, rate=4.0, max_tokens=8)
    try:
        up.wait_for("autoscale: scale_up: 1P:1D -> 1P:2D", 180)
        up.wait_for("ready decode-1", 300)
        time.sleep(1.0)  # requests keep arriving while the new node takes its share
    finally:
        results = load.stop()
    assert results and all(r == 200 for r in results), [r for r in results if r != 200][:5]
    assert decode_nodes(up) == ["decode-0", "decode-1"]
    up.wait_clean()
    m = autoscaler_metrics(up)
    assert m[("pdserve_autoscale_desired_replicas", (("pool", "decode"),))] == 2
    assert m[("pdserve_autoscale_desired_replicas", (("pool", "prefill"),))] == 1
    assert m[("pdserve_autoscale_decisions_total", (("action", "scale_up"),))] == 1
    assert m[("pdserve_autoscale_metrics_up", ())] == 1


@pytestmark_up
@pytest.mark.timeout(900)
def test_light_traffic_drains_a_decode_node_and_no_request_fails(up: UpCluster) -> None:
    if decode_nodes(up) != ["decode-0", "decode-1"]:
        pytest.skip("needs the second decode node the previous test started")
    load = Load(up, rate=1.0, max_tokens=2)
    try:
        up.wait_for("autoscale: scale_down: 1P:2D -> 1P:1D", 180)
        up.wait_for("drained decode-1", 120)
        time.sleep(2.0)  # requests keep arriving after the drain
    finally:
        results = load.stop()
    assert results and all(r == 200 for r in results), [r for r in results if r != 200][:5]
    assert decode_nodes(up) == ["decode-0"]
    up.wait_clean()
    m = autoscaler_metrics(up)
    assert m[("pdserve_autoscale_desired_replicas", (("pool", "decode"),))] == 1
    assert m[("pdserve_autoscale_decisions_total", (("action", "scale_down"),))] == 1
    assert "drained decode-1 (exit 0)" in up.stderr()


@pytestmark_up
@pytest.mark.timeout(120)
def test_a_frozen_frontend_leaves_the_shape_as_it_is(up: UpCluster) -> None:
    """The frontend (the controller's metrics source) stopped with SIGSTOP: the controller says it lost
    its metrics and keeps the shape; once the frontend runs again it says so too."""
    shape = decode_nodes(up)
    frontend = next(p for p in up.state()["processes"] if p["pool"] == "frontend")
    os.kill(frontend["pid"], signal.SIGSTOP)
    try:
        up.wait_for("autoscale: metrics source lost", 30)
        wait_until(lambda: autoscaler_metrics(up)[("pdserve_autoscale_metrics_up", ())] == 0, 10,
                   "metrics_up to drop to 0", interval_s=0.2)
        time.sleep(3.0)  # several ticks without metrics
        assert decode_nodes(up) == shape
        m = autoscaler_metrics(up)
        assert m[("pdserve_autoscale_desired_replicas", (("pool", "decode"),))] == len(shape)
        assert "keeping 1P:" in up.stderr()
    finally:
        os.kill(frontend["pid"], signal.SIGCONT)
    up.wait_for("autoscale: metrics source back", 30)
    up.check_integrity()


def test_the_controllers_series_are_in_the_catalogue() -> None:
    """Every series the controller registers is documented in deploy/prometheus/README.md."""
    import re

    readme = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "README.md"
    catalogue = set(re.findall(r"^\| `(pdserve_[a-z0-9_]+)`", readme.read_text(encoding="utf-8"), re.M))
    names = {m.name + ("_total" if m.type == "counter" else "") for m in ControllerMetrics().registry.collect()}
    assert names and names <= catalogue, sorted(names - catalogue)


def test_the_keda_example_runs_this_controller_and_reads_its_series() -> None:
    """deploy/k8s/examples/autoscale-keda.yaml: the controller's command line is one `pdserve autoscale`
    accepts, and each pool's ScaledObject scales to that pool's desired replicas."""
    import yaml

    from pdserve.deploy.cli import build_parser

    path = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "examples" / "autoscale-keda.yaml"
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["pdserve", "autoscale"]
    args = build_parser().parse_args(command[1:])
    assert args.prometheus and args.node_budget >= 2 and args.metrics_port == 9400
    scaled = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}
    for pool in ("prefill", "decode"):
        trigger = scaled[f"pdserve-{pool}-autoscale"]["spec"]["triggers"][0]
        assert trigger["metadata"]["query"] == f'max(pdserve_autoscale_desired_replicas{{pool="{pool}"}})'
        assert (trigger["metricType"], trigger["metadata"]["threshold"]) == ("AverageValue", "1")
