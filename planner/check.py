"""`pdserve plan --check`: a live cluster's traffic, read from its metrics, against its current shape.

What the metrics give (deploy/prometheus/README.md has the catalogue):
- arrival rate: finished requests (`pdserve_frontend_requests_total`, status 200) over the window;
- mean prompt and output lengths: `pdserve_frontend_tokens_total{kind=prompt|completion}` per request.
  The metrics hold no per-request length histograms, so the simulated traffic uses these means as fixed
  lengths (a wide length spread makes the real tail worse than predicted);
- the current shape: the nodes whose /metrics (or Prometheus series `pdserve_kv_blocks`) say `pool`
  prefill or decode.
From /metrics URLs the window is two scrapes `--window` seconds apart (0: everything since each counter
was created); from Prometheus, `increase(...[window])`. Then the current shape is simulated at the
observed rate, and the plan searched as `pdserve plan --rate` would.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.parse
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from pdserve.planner.loadgen.metrics import parse_slos
from pdserve.planner.plan import PlanConfig, Planner
from pdserve.planner.profile_model import load_profile_here
from pdserve.planner.sim import NodeSettings, Shape, load_overheads
from pdserve.planner.traffic import Traffic


@dataclass
class Observed:
    """The traffic and shape a live cluster shows."""

    requests: float  # finished requests in the window
    prompt_tokens: float
    completion_tokens: float
    window_s: float
    prefill_nodes: int | None = None  # None: not known (no node metrics given)
    decode_nodes: int | None = None
    prefill_tp: int = 1  # the pools' TP widths (the nodes' pdserve_model_info{tp}; 1 where not known)
    decode_tp: int = 1

    @property
    def rate(self) -> float:
        return self.requests / self.window_s if self.window_s > 0 else 0.0

    @property
    def mean_prompt(self) -> float:
        return self.prompt_tokens / self.requests if self.requests else 0.0

    @property
    def mean_output(self) -> float:
        return self.completion_tokens / self.requests if self.requests else 0.0

    @property
    def shape(self) -> Shape | None:
        if not self.decode_nodes:
            return None
        return Shape(self.prefill_nodes or 0, self.decode_nodes, self.prefill_tp if self.prefill_nodes else 1,
                     self.decode_tp)

    def count_nodes(self, nodes: list[tuple[str | None, int]]) -> None:
        """Sets the shape from each node's (pool, TP width): a pool's width is its widest node's."""
        self.prefill_nodes = sum(pool == "prefill" for pool, _ in nodes)
        self.decode_nodes = sum(pool == "decode" for pool, _ in nodes)
        self.prefill_tp = max((tp for pool, tp in nodes if pool == "prefill"), default=1)
        self.decode_tp = max((tp for pool, tp in nodes if pool == "decode"), default=1)


@dataclass
class Counters:
    """One or more frontends' request and token counters (summed)."""

    requests: float = 0.0
    prompt: float = 0.0
    completion: float = 0.0
    created: float = math.inf  # earliest counter creation (unix s)


def get_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (operator-given URL)
        return resp.read().decode("utf-8")


def frontend_counters(text: str) -> Counters:
    c = Counters()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "pdserve_frontend_requests_total" and s.labels.get("status") == "200":
                c.requests += s.value
            elif s.name == "pdserve_frontend_tokens_total":
                if s.labels.get("kind") == "prompt":
                    c.prompt += s.value
                elif s.labels.get("kind") == "completion":
                    c.completion += s.value
            elif s.name in ("pdserve_frontend_requests_total_created", "pdserve_frontend_requests_created"):
                c.created = min(c.created, s.value)
    return c


def node_pool(text: str) -> tuple[str | None, int]:
    """A node's /metrics -> (its pool, its TP width: pdserve_model_info's `tp`, 1 where absent)."""
    pool, tp = None, 1
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if pool is None and s.labels.get("pool") in ("prefill", "decode"):
                pool = s.labels["pool"]
            if s.name == "pdserve_model_info" and s.labels.get("tp", "").isdigit():
                tp = int(s.labels["tp"])
    return pool, tp


def observe_metrics(frontend_urls: list[str], node_urls: list[str], window_s: float) -> Observed:
    """Reads the frontends' /metrics (twice, `window_s` apart; once with 0) and the nodes' pools."""
    first = [frontend_counters(get_text(u)) for u in frontend_urls]
    if window_s > 0:
        started = time.monotonic()
        time.sleep(window_s)  # the observation window itself, not a synchronisation
        second = [frontend_counters(get_text(u)) for u in frontend_urls]
        window = time.monotonic() - started
        delta = [(b.requests - a.requests, b.prompt - a.prompt, b.completion - a.completion)
                 for a, b in zip(first, second, strict=True)]
    else:
        created = min((c.created for c in first), default=math.inf)
        window = time.time() - created if math.isfinite(created) else 0.0
        delta = [(c.requests, c.prompt, c.completion) for c in first]
    nodes = [node_pool(get_text(u)) for u in node_urls]
    obs = Observed(sum(d[0] for d in delta), sum(d[1] for d in delta), sum(d[2] for d in delta), window)
    if node_urls:
        obs.count_nodes(nodes)
    return obs


def _prom_query(base: str, query: str) -> list[dict]:
    """The result series of an instant query against a Prometheus server's API."""
    url = f"{base.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    data = json.loads(get_text(url))
    if data.get("status") != "success":
        raise ValueError(f"Prometheus query {query!r} failed: {data.get('error', data)}")
    return data["data"]["result"]


def _prom_scalar(base: str, query: str) -> float:
    result = _prom_query(base, query)
    return float(result[0]["value"][1]) if result else 0.0


def _prom_label_values(base: str, query: str, label: str) -> list[int]:
    """The integer values of `label` over the query's result series."""
    return [int(v) for r in _prom_query(base, query) if (v := r["metric"].get(label, "")).isdigit()]


def observe_prometheus(base: str, window_s: float) -> Observed:
    """The same figures from a Prometheus server's query API over the last `window_s` seconds."""
    w = f"{max(int(window_s), 1)}s"
    req = _prom_scalar(base, f'sum(increase(pdserve_frontend_requests_total{{status="200"}}[{w}]))')
    prompt = _prom_scalar(base, f'sum(increase(pdserve_frontend_tokens_total{{kind="prompt"}}[{w}]))')
    completion = _prom_scalar(base, f'sum(increase(pdserve_frontend_tokens_total{{kind="completion"}}[{w}]))')
    prefill = _prom_scalar(base, 'count(count by (node) (pdserve_kv_blocks{pool="prefill"}))')
    decode = _prom_scalar(base, 'count(count by (node) (pdserve_kv_blocks{pool="decode"}))')
    obs = Observed(req, prompt, completion, float(max(int(window_s), 1)), int(prefill), int(decode))
    # a pool's width: its widest node's, from the info series' tp label
    obs.prefill_tp, obs.decode_tp = (max(_prom_label_values(base, f'count by (tp) (pdserve_model_info{{pool="{pool}"}})',
                                                            "tp"), default=1) for pool in ("prefill", "decode"))
    return obs


class ScrapeSource:
    """Frontends' /metrics scraped at each observation; the traffic is the counters' increase over the
    samples of the last `window_s` (a counter that went down, a restarted frontend, starts a new window).
    `node_urls` give the current shape (each node's pool)."""

    def __init__(self, frontend_urls: list[str], node_urls: list[str], window_s: float,
                 timeout_s: float = 3.0) -> None:
        assert frontend_urls, "a ScrapeSource needs at least one frontend /metrics URL"
        self.frontend_urls, self.node_urls = frontend_urls, node_urls
        self.window_s, self.timeout_s = window_s, timeout_s
        self.history: deque[tuple[float, Counters]] = deque()

    def observe(self) -> Observed:
        total = Counters()
        for url in self.frontend_urls:
            c = frontend_counters(get_text(url, self.timeout_s))
            total.requests, total.prompt, total.completion = (total.requests + c.requests, total.prompt + c.prompt,
                                                              total.completion + c.completion)
        now = time.monotonic()
        if self.history and total.requests < self.history[-1][1].requests:
            self.history.clear()  # a frontend restarted: its counters began again
        self.history.append((now, total))
        while len(self.history) > 2 and now - self.history[1][0] >= self.window_s:
            self.history.popleft()
        t0, first = self.history[0]
        obs = Observed(total.requests - first.requests, total.prompt - first.prompt,
                       total.completion - first.completion, now - t0)
        if self.node_urls:
            obs.count_nodes([node_pool(get_text(u, self.timeout_s)) for u in self.node_urls])
        return obs

    @property
    def warm(self) -> bool:
        """Whether the samples span a whole window yet."""
        return len(self.history) >= 2 and self.history[-1][0] - self.history[0][0] >= self.window_s * 0.9


class PrometheusSource:
    """The same figures from a Prometheus server over the last `window_s`."""

    warm = True

    def __init__(self, base: str, window_s: float) -> None:
        self.base, self.window_s = base, window_s

    def observe(self) -> Observed:
        return observe_prometheus(self.base, self.window_s)



@dataclass
class CheckResult:
    """The observation, whether the current shape fits it, and the plan's recommendation."""

    observed: Observed
    current_fits: bool | None  # None: current shape unknown
    current_attainment: float | None
    recommended: str | None
    recommended_prefill: int | None
    recommended_decode: int | None

    def verdict(self) -> str:
        o = self.observed
        head = (f"observed: {o.rate:.3g} req/s over {o.window_s:.0f} s ({o.requests:.0f} requests), "
                f"mean prompt {o.mean_prompt:.0f} tokens, mean output {o.mean_output:.0f} tokens")
        shape = o.shape
        if shape is None:
            now = "current shape unknown (give --node-metrics-url for each node)"
        else:
            att = f" (SLO attainment {100 * (self.current_attainment or 0):.1f}% predicted)"
            now = f"current {shape.label}: {'still fits' if self.current_fits else 'does NOT fit'}{att}"
        if self.recommended is None:
            rec = "no shape within --max-nodes fits this traffic"
        elif shape is not None and self.recommended == shape.label:
            rec = f"recommended: keep {shape.label}"
        else:
            rec = f"recommended: {self.recommended}"
        return f"{head}\n{now}\n{rec}"


def check(args: argparse.Namespace) -> CheckResult:
    """Observes the cluster, simulates its current shape and searches the plan. Raises ValueError."""
    if not args.metrics_url and not args.prometheus:
        raise ValueError("--check needs --metrics-url (each frontend's /metrics) or --prometheus URL")
    if args.metrics_url and args.prometheus:
        raise ValueError("give --metrics-url or --prometheus, not both")
    obs = (observe_prometheus(args.prometheus, args.window) if args.prometheus
           else observe_metrics(args.metrics_url, args.node_metrics_url, args.window))
    if obs.requests < 1 or obs.rate <= 0:
        raise ValueError("the cluster finished no request in the window: nothing to plan for")
    profile = load_profile_here(args.profile, args.allow_other_machine)
    traffic = Traffic.parse(str(max(1, round(obs.mean_prompt))), str(max(1, round(obs.mean_output))), 0, args.seed)
    settings = NodeSettings.of(profile, local_prefill_threshold=args.local_prefill_threshold,
                               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                               num_kv_blocks=args.num_kv_blocks)
    # the widths the plan may take: --tp-widths, and the ones the cluster runs at (the profile must have them)
    shape = obs.shape
    widths = set(getattr(args, "tp_widths", None) or (profile.tp,))
    if shape is not None:
        widths |= {shape.decode_tp} | ({shape.prefill_tp} if shape.prefill else set())
    cfg = PlanConfig(profile, parse_slos(args.slo), args.attainment, args.max_nodes, rate=obs.rate,
                     traffic=traffic, requests=args.requests, settings=settings,
                     overheads=load_overheads(args.overheads) if getattr(args, "overheads", None) else None,
                     tp_widths=tuple(sorted(widths)))
    planner = Planner(cfg)
    current = planner.simulate(obs.shape, obs.rate).summary if obs.shape is not None else None
    plan = planner.run()
    rec = plan.recommended
    return CheckResult(obs, None if current is None else current.meets_target,
                       None if current is None else current.attainment,
                       None if rec is None else rec.shape.label, None if rec is None else rec.shape.prefill,
                       None if rec is None else rec.shape.decode)


def main(args: argparse.Namespace) -> int:
    """Prints the check; 0 when the current shape fits (or, unknown, when some shape does), else 1."""
    res = check(args)
    if args.json:
        d = asdict(res)
        d["observed"].update(rate=res.observed.rate, mean_prompt=res.observed.mean_prompt,
                             mean_output=res.observed.mean_output)
        print(json.dumps(d, indent=1))
    else:
        Console(width=160).print(res.verdict(), highlight=False)
    if args.values_out and res.recommended_decode is not None:
        from pdserve.planner.plan import write_values

        shape = Shape.parse(res.recommended) if res.recommended else Shape(0, res.recommended_decode)
        write_values(args.values_out, shape, "pdserve plan --check: " + res.verdict())
        print(f"wrote {args.values_out}", file=sys.stderr)
    if res.current_fits is not None:
        return 0 if res.current_fits else 1
    return 0 if res.recommended is not None else 1
