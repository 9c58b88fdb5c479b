"""The Grafana dashboards without a Prometheus: importable structure (unique ids, a layout inside the
24-column grid, every query on the `datasource` variable), the model and node variables, metric names
that the catalogue (deploy/prometheus/README.md) or the recording rules define, and the renderer's
variable expansion and legends."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from pdserve.deploy.metrics_render import expand, legend, load_panels

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana").glob("*.json"))
CATALOGUE = (DEPLOY / "prometheus" / "README.md").read_text(encoding="utf-8")
RULES = {r["record"] for g in yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())["groups"]
         for r in g["rules"] if "record" in r}
# Series names a histogram or counter of the catalogue gives rise to.
SUFFIXES = ("_bucket", "_sum", "_count", "_total")
PROMQL_WORDS = {"sum", "by", "rate", "max", "or", "vector", "histogram_quantile", "le", "up", "without"}


def catalogued(name: str) -> bool:
    base = next((name[: -len(s)] for s in SUFFIXES if name.endswith(s) and f"`{name[: -len(s)]}" in CATALOGUE), name)
    return f"`{base}`" in CATALOGUE or f"`{name}`" in CATALOGUE


@pytest.mark.parametrize("path", DASHBOARDS, ids=[d.stem for d in DASHBOARDS])
def test_dashboard_is_importable(path: Path) -> None:
    dash = json.loads(path.read_text(encoding="utf-8"))
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("cluster", "model", "node"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    # One Prometheus may watch several clusters: the other variables and every query narrow to $cluster.
    for name in ("model", "node"):
        assert 'cluster=~"$cluster"' in variables[name]["query"]["query"], name
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names.index("cluster") < names.index("model") < names.index("node")  # each refines the one before
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    occupied: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        cells = {(g["y"] + dy, g["x"] + dx) for dy in range(g["h"]) for dx in range(g["w"])}
        assert not cells & occupied, f"panel {p['title']!r} overlaps another"
        occupied |= cells
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}"
            assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])


@pytest.mark.parametrize("path", DASHBOARDS, ids=[d.stem for d in DASHBOARDS])
def test_queries_use_known_metrics(path: Path) -> None:
    unknown = set()
    for panel in load_panels(path):
        for target in panel.targets:
            # Metric names: identifiers followed by a selector or a range, outside of label matchers.
            for name in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[\{\[]", re.sub(r'"[^"]*"', '""', target.expr)):
                if name not in PROMQL_WORDS and name not in RULES and not catalogued(name):
                    unknown.add(f"{panel.title}: {name}")
    assert not unknown, sorted(unknown)


@pytest.mark.parametrize("path", DASHBOARDS, ids=[d.stem for d in DASHBOARDS])
def test_every_query_selects_the_cluster_variable(path: Path) -> None:
    for panel in load_panels(path):
        for target in panel.targets:
            selectors = re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", target.expr)
            bare = re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\[", target.expr)
            assert selectors and not bare, f"{panel.title}: {target.expr}"
            for name, matchers in selectors:
                assert 'cluster=~"$cluster"' in matchers, f"{panel.title}: {name}"


def test_isl_osl_panel_reads_the_length_rules() -> None:
    panels = {p.title: p for p in load_panels(DEPLOY / "grafana" / "pdserve.json")}
    (isl,) = [p for title, p in panels.items() if "ISL" in title]
    exprs = [t.expr for t in isl.targets]
    assert {e.split("{")[0] for e in exprs} == {
        "pool_model:pdserve_frontend_prompt_tokens_per_request:ratio_rate5m",
        "pool_model:pdserve_frontend_completion_tokens_per_request:ratio_rate5m",
        "pool_model:pdserve_frontend_request_input_tokens:histogram_quantile_5m",
        "pool_model:pdserve_frontend_request_output_tokens:histogram_quantile_5m",
    } and {e.split("{")[0] for e in exprs} <= RULES


def test_expand_and_legend() -> None:
    expr = 'sum by (node) (rate(x_total{model=~"$model", node=~"${node}"}[$__rate_interval]))'
    assert expand(expr, {"model": "m.*", "node": "d0|d1"}, "2m") == \
        'sum by (node) (rate(x_total{model=~"m.*", node=~"d0|d1"}[2m]))'
    assert legend("{{pool}} {{ node }} p{{quantile}}", {"pool": "decode", "node": "d0", "quantile": "0.9"}) == \
        "decode d0 p0.9"
    assert legend("", {"b": "2", "a": "1"}) == "{a=1, b=2}"
