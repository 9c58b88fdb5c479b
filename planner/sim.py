"""A discrete-event simulation of one cluster shape under one workload, timed by a profile's cost model.

What it models (each as the real component decides it, so that the predicted percentiles move the way
the cluster's do):

- frontend routing: each request to the decode node with the fewest outstanding requests, and (when it
  is prefilled remotely) to the prefill node with the fewest (`placement`'s bounded-load rule without
  prefix affinity: the simulation has no prompt contents);
- decode node (`engine.scheduler` per step, in its order): running decodes, landed sequences, running
  partial prefills, then waiting sequences FCFS, under `max_num_batched_tokens` and `max_num_seqs`;
  blocks allocated per chunk, the newest running sequence preempted (recomputed from prompt + tokens so
  far) when a decode finds no block; a prompt below `local_prefill_threshold` (or every prompt when there
  are no prefill nodes: a colocated node) is prefilled here, interleaved with the decodes;
- remote prefill: the decode node reserves blocks for the prompt (FIFO reservation queue, waiting for
  free blocks), the prefill node batches prompts into chunked steps under the same token budget, the
  first token is the client's first token, then the K/V ship over the (prefill, decode) pair channel,
  one transfer at a time per pair, and the sequence joins the decode batch;
- a step's time: `Profile.step_s` (fixed cost + decodes + K/V read + prefill tokens + attention), from the
  profile of the node's pool's TP width (`Shape.prefill_tp`, `Shape.decode_tp`; `Profile.at_tp`), and a
  decode node's KV capacity that width's;
- `Overheads`, what a profile's engine steps leave out: a node's own CPU around its steps (per prompt on
  a prefill node, per request and per streamed token on a decode node) added to the step that causes it; the frontend's
  and clients' latency, added to every token's arrival; and, when they share the nodes' cores, their CPU
  per request and per streamed token taken from the nodes' steps (each step stretched by the share of
  a core they used over the last second).

Not modelled: prefix-cache hits, the prefill node's own KV capacity, network contention between pairs,
failures. Output: one `planner.loadgen.client.RequestRecord` a request, summarised by
`planner.loadgen.metrics.summarize` (the same TTFT/TPOT/ITL/e2e, SLO, attainment and goodput definitions as
`pdserve bench`). The nodes are in `planner.sim_nodes`. Deterministic: no clock and no randomness beyond the workload's seeded draws.
"""

from __future__ import annotations

import heapq
import itertools
import json
import re
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pdserve.planner.loadgen.client import RequestRecord
from pdserve.planner.loadgen.metrics import SLO, Summary, summarize
from pdserve.planner.profile_model import Profile
from pdserve.planner.sim_nodes import DecodeNode, PrefillNode, Seq, Stepper

_SHAPE_RE = re.compile(r"^(?:(\d+)P(?:\(tp(\d+)\))?:(\d+)D(?:\(tp(\d+)\))?|(\d+)C(?:\(tp(\d+)\))?)$", re.IGNORECASE)


@dataclass(frozen=True)
class Shape:
    """P prefill + D decode nodes; P = 0 is D colocated nodes (each prefills everything itself). Each pool's
    nodes have a tensor-parallel width (`prefill_tp`, `decode_tp`: ranks a node, one core or GPU each);
    a colocated shape's width is `decode_tp` (its `prefill_tp` is 1)."""

    prefill: int
    decode: int
    prefill_tp: int = 1
    decode_tp: int = 1

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(f"a shape needs >= 0 prefill and >= 1 decode nodes, got {self.prefill}:{self.decode}")
        for name in ("prefill_tp", "decode_tp"):
            w = getattr(self, name)
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise ValueError(f"a shape's {name} must be an integer >= 1, got {w!r}")
        if self.prefill == 0 and self.prefill_tp != 1:
            raise ValueError(f"a colocated shape has no prefill pool: its width is decode_tp, got prefill_tp "
                             f"{self.prefill_tp}")

    @property
    def nodes(self) -> int:
        return self.prefill + self.decode

    @property
    def cores(self) -> int:
        """The ranks of every node (a TP-w node runs w): the cores, or GPUs, the shape occupies."""
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    @property
    def colocated(self) -> bool:
        return self.prefill == 0

    @property
    def tp(self) -> bool:
        """Whether some pool is wider than one rank."""
        return max(self.prefill_tp, self.decode_tp) > 1

    @property
    def label(self) -> str:
        """"1P:2D" / "2C" at TP 1; "1P(tp2):2D(tp1)" / "2C(tp2)" otherwise (`Shape.parse` reads both)."""
        if self.colocated:
            return f"{self.decode}C" + (f"(tp{self.decode_tp})" if self.tp else "")
        if not self.tp:
            return f"{self.prefill}P:{self.decode}D"
        return f"{self.prefill}P(tp{self.prefill_tp}):{self.decode}D(tp{self.decode_tp})"

    @classmethod
    def parse(cls, text: str) -> Shape:
        """A label back to its shape: "1P:2D", "2C", "1P(tp2):2D(tp1)", "2C(tp2)" (a width left out is 1;
        case and spaces ignored). Raises ValueError."""
        m = _SHAPE_RE.match("".join(str(text).split()))
        if m is None:
            raise ValueError(f"bad shape {text!r}: expected PP:DD (e.g. 1P:2D), NC (e.g. 2C), or with TP widths "
                             f"1P(tp2):2D(tp1), 2C(tp2)")
        p, ptp, d, dtp, c, ctp = m.groups()
        if c is not None:
            return cls(0, int(c), 1, int(ctp or 1))
        if int(p) == 0:
            raise ValueError(f"bad shape {text!r}: 0 prefill nodes is a colocated shape, written {d}C")
        return cls(int(p), int(d), int(ptp or 1), int(dtp or 1))

    def with_tp(self, prefill_tp: int, decode_tp: int) -> Shape:
        """The same node counts at these widths (a colocated shape takes `decode_tp`)."""
        return Shape(self.prefill, self.decode, prefill_tp if self.prefill else 1, decode_tp)


@dataclass(frozen=True)
class SimRequest:
    """One request: arrival (s from the start), prompt and output token counts."""

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class NodeSettings:
    """The engine and decode-node settings every simulated node runs with."""

    block_size: int
    num_kv_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    local_prefill_threshold: int

    def __post_init__(self) -> None:
        if min(self.block_size, self.num_kv_blocks, self.max_num_batched_tokens, self.max_num_seqs) < 1:
            raise ValueError(f"node settings must be positive: {self}")
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be >= 0")

    @classmethod
    def of(cls, profile: Profile, **overrides: int) -> NodeSettings:
        """The profile's engine facts, with `overrides` (field name -> value) applied."""
        e = profile.engine
        base = dict(block_size=e.block_size, num_kv_blocks=e.num_kv_blocks,
                    max_num_batched_tokens=e.max_num_batched_tokens, max_num_seqs=e.max_num_seqs,
                    local_prefill_threshold=e.local_prefill_threshold)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


@dataclass(frozen=True)
class Overheads:
    """What serving costs beyond the engine steps a profile times: the nodes' own work around their steps
    (gRPC, KV sends and receives, streaming), and the processes outside the nodes on a request's path (the
    frontend, the clients: "host"). The default costs nothing. `bench/shapes.py` measures them here."""

    latency_s: float = 0.0  # added to every token's arrival at the client (HTTP, tokenizing, gRPC hops)
    latency_per_prompt_token_s: float = 0.0  # and per prompt token (tokenizing, the request's bytes)
    prefill_cpu_per_request_s: float = 0.0  # a prefill node's CPU outside its engine steps, per prompt
    decode_cpu_per_remote_request_s: float = 0.0  # a decode node's CPU outside its steps, per request prefilled
    decode_cpu_per_local_request_s: float = 0.0  # elsewhere (reserving, receiving K/V) or here
    decode_cpu_per_token_s: float = 0.0  # and per streamed token
    host_cpu_per_request_s: float = 0.0  # the frontend's and clients' CPU per request
    host_cpu_per_token_s: float = 0.0  # and per streamed token
    host_cores: int = 0  # cores the nodes share with them (0: they have their own); a node rank has a core of its own

    WINDOW_S = 1.0  # a step is stretched by the host CPU of the last second
    MAX_SHARE = 0.5  # a node's thread and a runnable host thread on one core each get half of it

    def __post_init__(self) -> None:
        costs = (self.latency_s, self.latency_per_prompt_token_s, self.prefill_cpu_per_request_s,
                 self.decode_cpu_per_remote_request_s, self.decode_cpu_per_local_request_s, self.decode_cpu_per_token_s,
                 self.host_cpu_per_request_s, self.host_cpu_per_token_s, self.host_cores)
        if min(costs) < 0:
            raise ValueError(f"overheads must be >= 0: {self}")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n", encoding="utf-8")

    @property
    def host_shares_cores(self) -> bool:
        return self.host_cores > 0 and (self.host_cpu_per_request_s > 0 or self.host_cpu_per_token_s > 0)

    def host_share(self, shape: Shape, prefill_node: bool, cpu_per_s: float) -> float:
        """The fraction of one node's core the host processes take when they use `cpu_per_s` CPU seconds
        a second. They use the cores no node has first; the rest lands on the prefill nodes of a
        disaggregated shape (a decode node steps back to back while it has sequences, a prefill node
        sleeps between prompts, so the scheduler wakes the frontend and clients on its core and they share
        it once a prompt comes), and on every node of a colocated one."""
        need = cpu_per_s - max(0, self.host_cores - shape.cores)  # a TP-w node's ranks take w cores
        if not self.host_shares_cores or need <= 0 or (shape.prefill and not prefill_node):
            return 0.0
        return min(self.MAX_SHARE, need / (shape.prefill or shape.decode))


def load_overheads(path: str | Path) -> Overheads:
    """Reads an `Overheads` JSON file (`Overheads.save`). Raises ValueError (bad content) or OSError."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return Overheads(**data)
    except (json.JSONDecodeError, TypeError) as err:
        raise ValueError(f"{path}: not an overheads file: {err}") from None


class _Events:
    """The event queue: callbacks ordered by time, then by scheduling order (deterministic ties)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._n = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._n), fn))

    def run(self) -> None:
        while self._heap:
            self.now, _, fn = heapq.heappop(self._heap)
            fn()


@dataclass
class SimResult:
    """One simulated run: the shape, the offered rate, the per-request records and their summary."""

    shape: Shape
    rate: float | None
    records: list[RequestRecord]
    summary: Summary
    preemptions: int


class Simulation:
    """One run of `requests` on `shape`. Build, then `run()` once."""

    def __init__(self, profile: Profile, shape: Shape, requests: list[SimRequest],
                 settings: NodeSettings | None = None, overheads: Overheads | None = None) -> None:
        self.profile, self.shape = profile, shape
        # Each pool is timed by the profile of its TP width (ValueError when the profile lacks it); the K/V
        # transfer by the prefill pool's (the sending side's) fit.
        self.decode_profile = profile.at_tp(shape.decode_tp)
        self.prefill_profile = profile.at_tp(shape.prefill_tp) if shape.prefill else self.decode_profile
        settings = settings or NodeSettings.of(profile)
        base, wide = profile.engine.num_kv_blocks, self.decode_profile.engine.num_kv_blocks
        if wide != base:  # a TP-w decode node holds what the profile measured at w (scaled as the settings are)
            settings = replace(settings, num_kv_blocks=max(1, round(settings.num_kv_blocks * wide / base)))
        self.settings = settings
        self.overheads = overheads or Overheads()
        self._host_cpu: deque[tuple[float, float]] = deque()  # (when, host CPU seconds) of the last WINDOW_S
        self._host_cpu_sum = 0.0  # their sum
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.index))
        self.events = _Events()
        self.prefill_nodes = [PrefillNode(self, i) for i in range(shape.prefill)]
        self.decode_nodes = [DecodeNode(self, i) for i in range(shape.decode)]
        self.channel_free: dict[tuple[int, int], float] = {}  # pair channel -> when its last send ends
        self.seqs: list[Seq] = []
        self.preemptions = 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.settings.block_size)

    def step_s(self, node: Stepper, plan: list[tuple[Seq, int]]) -> float:
        """One node step's time: the profile's for the plan's work plus the node's own CPU around it
        (`Stepper.own_cpu_s`), stretched by the host processes' share of the node's core."""
        prof = self.prefill_profile if isinstance(node, PrefillNode) else self.decode_profile
        t = prof.step_s(*Stepper.step_cost(plan)) + node.own_cpu_s(plan)
        o = self.overheads
        if o.host_shares_cores:
            horizon = self.events.now - Overheads.WINDOW_S
            while self._host_cpu and self._host_cpu[0][0] < horizon:
                self._host_cpu_sum -= self._host_cpu.popleft()[1]
            t /= 1.0 - o.host_share(self.shape, isinstance(node, PrefillNode), self._host_cpu_sum / Overheads.WINDOW_S)
        return t

    def _host_used(self, t: float, cpu_s: float) -> None:
        """The host processes spend `cpu_s` CPU seconds at `t` (when they share the nodes' cores)."""
        if self.overheads.host_shares_cores:
            self._host_cpu.append((t, cpu_s))
            self._host_cpu_sum += cpu_s

    def emit(self, seq: Seq, t: float) -> None:
        """A token leaves its node at `t` (it reaches the client `overheads.latency_s` later)."""
        self._host_used(t, self.overheads.host_cpu_per_token_s)
        if seq.first_s is None:
            seq.first_s = t
        else:
            assert seq.last_s is not None
            seq.gaps.append(t - seq.last_s)
        seq.last_s = t
        seq.generated += 1
        seq.tokens += 1
        if seq.generated >= seq.req.output_tokens:
            seq.end_s = t

    def fail(self, seq: Seq, node: DecodeNode, error: str) -> None:
        """A request the pool can never fit ends as the scheduler rejects it: with an error before its first
        token, else cut short (finish_reason "length": the client has a response)."""
        if not seq.generated:
            seq.error = error
        seq.end_s = self.events.now
        node.outstanding -= 1

    def _arrive(self, req: SimRequest) -> None:
        self._host_used(self.events.now, self.overheads.host_cpu_per_request_s)
        seq = Seq(req, req.prompt_tokens)
        self.seqs.append(seq)
        d = min(self.decode_nodes, key=lambda n: (n.outstanding, n.index))
        d.outstanding += 1
        if not self.prefill_nodes or req.prompt_tokens < self.settings.local_prefill_threshold:
            seq.local = True
            d.add_local(seq)
            return
        p = min(self.prefill_nodes, key=lambda n: (n.outstanding, n.index))
        p.outstanding += 1
        d.add_remote(seq, p.index)

    def run(self, slos: list[SLO] | None = None, attainment: float = 0.9, rate: float | None = None) -> SimResult:
        """Simulates every request to its end; returns the records and their summary."""
        for req in self.requests:
            self.events.at(req.arrival_s, lambda r=req: self._arrive(r))
        self.events.run()
        for node in self.decode_nodes:
            assert node.free == self.settings.num_kv_blocks and not node.running, "blocks leaked"
            assert node.outstanding == 0
        o = self.overheads
        records = [self._record(s, o.latency_s + o.latency_per_prompt_token_s * s.req.prompt_tokens)
                   for s in self.seqs]
        start = min((r.arrival_s for r in self.requests), default=0.0)
        end = max((s.end_s or 0.0 for s in self.seqs), default=start)
        return SimResult(self.shape, rate, records, summarize(records, end - start, slos, attainment),
                         self.preemptions)

    @staticmethod
    def _record(seq: Seq, latency_s: float) -> RequestRecord:
        req = seq.req
        rec = RequestRecord(index=req.index, start_s=req.arrival_s, max_tokens=req.output_tokens,
                            usage_prompt_tokens=req.prompt_tokens)
        if seq.error is not None or seq.end_s is None or seq.first_s is None:
            rec.fail(seq.error or "unfinished", "the simulated pool cannot fit the request")
            return rec
        rec.ok, rec.finish_reason = True, "length"
        rec.ttft_s = seq.first_s + latency_s - req.arrival_s
        rec.itl_s = seq.gaps
        rec.chunks = seq.generated
        rec.usage_output_tokens = seq.generated
        rec.finish(seq.end_s + latency_s - req.arrival_s)
        return rec


def simulate(profile: Profile, shape: Shape, requests: list[SimRequest], slos: list[SLO] | None = None,
             attainment: float = 0.9, settings: NodeSettings | None = None, rate: float | None = None,
             overheads: Overheads | None = None) -> SimResult:
    """One simulated run (see `Simulation`)."""
    return Simulation(profile, shape, requests, settings, overheads).run(slos, attainment, rate)

