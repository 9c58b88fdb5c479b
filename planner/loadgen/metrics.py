"""From request records to a summary: latency percentiles, throughput, errors, SLOs and goodput.

SLO semantics (`--slo ttft_p90=1s,tpot_p90=50ms`): each entry is a per-request threshold on a metric
(ttft, tpot, e2e, or itl = a request's longest gap between content chunks). A request is *good* when it
succeeded and meets every threshold; attainment is good / sent, goodput is good requests (and their
output tokens) per second. The `_pNN` suffix says which percentile of that metric, over all requests,
the summary holds against the threshold: p90 <= 1s means at least 90% of requests met it.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve.planner.loadgen.client import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2e")
_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Stats:
    """Mean and percentiles of one latency metric, in seconds (NaN when there were no samples)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> Stats:
        mean = sum(values) / len(values) if values else math.nan
        return cls(len(values), mean, percentile(values, 50), percentile(values, 90), percentile(values, 99))


@dataclass(frozen=True)
class SLO:
    """A per-request threshold on a metric, judged in the summary at the `pct`-th percentile."""

    metric: str
    pct: float
    threshold_s: float

    @property
    def name(self) -> str:
        return f"{self.metric}_p{self.pct:g}"


def parse_duration(text: str) -> float:
    """`1s`, `50ms`, `200us` or a bare number of seconds -> seconds. Raises ValueError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(s|ms|us)?\s*", text)
    if not m:
        raise ValueError(f"bad duration {text!r}: expected e.g. 1s, 50ms, 200us or 0.5")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def parse_slos(text: str | None) -> list[SLO]:
    """`ttft_p90=1s,tpot_p90=50ms` -> SLOs (no percentile suffix means p90). Raises ValueError."""
    slos: list[SLO] = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        m = re.fullmatch(r"([a-z0-9]+?)(?:_p([0-9]+(?:\.[0-9]+)?))?=(.+)", item)
        if not m or m.group(1) not in METRICS:
            raise ValueError(f"bad SLO {item!r}: expected METRIC[_pNN]=DURATION, METRIC one of {', '.join(METRICS)}")
        pct = float(m.group(2) or 90)
        if not 0 < pct <= 100:
            raise ValueError(f"bad SLO {item!r}: the percentile must be in (0, 100]")
        slos.append(SLO(m.group(1), pct, parse_duration(m.group(3))))
    return slos


def request_value(rec: RequestRecord, metric: str) -> float | None:
    """A request's value of `metric` for SLO checks (itl: its longest gap; 0 with a single chunk)."""
    if metric == "itl":
        return max(rec.itl_s, default=0.0) if rec.ok else None
    return {"ttft": rec.ttft_s, "tpot": rec.tpot_s, "e2e": rec.e2e_s}[metric] if rec.ok else None


def is_good(rec: RequestRecord, slos: list[SLO]) -> bool:
    """Succeeded and met every SLO threshold (a request of one token has no TPOT; it meets a TPOT SLO)."""
    if not rec.ok:
        return False
    for slo in slos:
        value = request_value(rec, slo.metric)
        if slo.metric == "tpot" and value is None:
            continue
        if value is None or value > slo.threshold_s:
            return False
    return True


@dataclass
class SLOResult:
    """One SLO as the summary judges it: the metric's observed percentile over successful requests."""

    name: str
    threshold_s: float
    observed_s: float
    met_fraction: float  # of sent requests, those that succeeded and met this threshold
    passed: bool


@dataclass
class Summary:
    """Everything reported for one run."""

    requests: int
    succeeded: int
    failed: int
    duration_s: float
    request_rate: float  # achieved: succeeded / duration
    output_tokens: int
    prompt_tokens: int
    output_token_rate: float
    prompt_token_rate: float
    chunks: int
    latency: dict[str, Stats]
    errors: dict[str, int]
    slos: list[SLOResult] = field(default_factory=list)
    attainment: float = math.nan
    attainment_target: float = 0.9
    meets_target: bool = False
    good: int = 0
    goodput_rate: float = 0.0
    goodput_token_rate: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _slo_result(slo: SLO, records: list[RequestRecord]) -> SLOResult:
    values = [v for r in records if (v := request_value(r, slo.metric)) is not None]
    observed = percentile(values, slo.pct)
    met = sum(1 for r in records if is_good(r, [slo]))
    fraction = met / len(records) if records else 0.0
    return SLOResult(slo.name, slo.threshold_s, observed, fraction, fraction * 100 >= slo.pct)


def summarize(records: list[RequestRecord], duration_s: float, slos: list[SLO] | None = None,
              attainment_target: float = 0.9) -> Summary:
    """The summary of a run that lasted `duration_s` (first send to last completion); changes nothing."""
    ok = [r for r in records if r.ok]
    slos = slos or []
    dur = max(duration_s, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.usage_prompt_tokens or r.local_prompt_tokens or 0 for r in ok)
    latency = {
        "ttft": Stats.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot": Stats.of([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl": Stats.of([gap for r in ok for gap in r.itl_s]),
        "e2e": Stats.of([r.e2e_s for r in ok if r.e2e_s is not None]),
    }
    good = [r for r in records if is_good(r, slos)]
    attainment = len(good) / len(records) if records else math.nan
    judged = [_slo_result(s, records) for s in slos]
    return Summary(
        requests=len(records), succeeded=len(ok), failed=len(records) - len(ok), duration_s=duration_s,
        request_rate=len(ok) / dur, output_tokens=out_tokens, prompt_tokens=prompt_tokens,
        output_token_rate=out_tokens / dur, prompt_token_rate=prompt_tokens / dur,
        chunks=sum(r.chunks for r in ok), latency=latency,
        errors=dict(Counter(r.error for r in records if r.error).most_common()),
        slos=judged, attainment=attainment, attainment_target=attainment_target,
        meets_target=bool(records) and attainment >= attainment_target and all(s.passed for s in judged),
        good=len(good), goodput_rate=len(good) / dur,
        goodput_token_rate=sum(r.output_tokens for r in good) / dur,
    )
