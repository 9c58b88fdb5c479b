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
- a step's time: `Profile.step_s` (fixed cost + decodes + K/V read + prefill tokens + attention).

Not modelled: prefix-cache hits, the prefill node's own KV capacity, network contention between pairs,
the frontend's CPU, failures. Output: one `loadgen.client.RequestRecord` a request, summarised by
`loadgen.metrics.summarize` (the same TTFT/TPOT/ITL/e2e, SLO, attainment and goodput definitions as
`pdserve bench`). The nodes are in `planner.sim_nodes`. Deterministic: no clock and no randomness beyond the workload's seeded draws.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from loadgen.client import RequestRecord
from loadgen.metrics import SLO, Summary, summarize
from planner.profile_model import Profile
from planner.sim_nodes import DecodeNode, PrefillNode, Seq


@dataclass(frozen=True)
class Shape:
    """P prefill + D decode nodes; P = 0 is D colocated nodes (each prefills everything itself)."""

    prefill: int
    decode: int

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(f"a shape needs >= 0 prefill and >= 1 decode nodes, got {self.prefill}:{self.decode}")

    @property
    def nodes(self) -> int:
        return self.prefill + self.decode

    @property
    def colocated(self) -> bool:
        return self.prefill == 0

    @property
    def label(self) -> str:
        return f"{self.decode}C" if self.colocated else f"{self.prefill}P:{self.decode}D"


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
                 settings: NodeSettings | None = None) -> None:
        self.profile, self.shape = profile, shape
        self.settings = settings or NodeSettings.of(profile)
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.index))
        self.events = _Events()
        self.prefill_nodes = [PrefillNode(self, i) for i in range(shape.prefill)]
        self.decode_nodes = [DecodeNode(self, i) for i in range(shape.decode)]
        self.channel_free: dict[tuple[int, int], float] = {}  # pair channel -> when its last send ends
        self.seqs: list[Seq] = []
        self.preemptions = 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.settings.block_size)

    def emit(self, seq: Seq, t: float) -> None:
        """A token reaches the client at `t`."""
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
        seq = Seq(req, req.prompt_tokens)
        self.seqs.append(seq)
        d = min(self.decode_nodes, key=lambda n: (n.outstanding, n.index))
        d.outstanding += 1
        if not self.prefill_nodes or req.prompt_tokens < self.settings.local_prefill_threshold:
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
        records = [self._record(s) for s in self.seqs]
        start = min((r.arrival_s for r in self.requests), default=0.0)
        end = max((s.end_s or 0.0 for s in self.seqs), default=start)
        return SimResult(self.shape, rate, records, summarize(records, end - start, slos, attainment),
                         self.preemptions)

    @staticmethod
    def _record(seq: Seq) -> RequestRecord:
        req = seq.req
        rec = RequestRecord(index=req.index, start_s=req.arrival_s, max_tokens=req.output_tokens,
                            usage_prompt_tokens=req.prompt_tokens)
        if seq.error is not None or seq.end_s is None or seq.first_s is None:
            rec.fail(seq.error or "unfinished", "the simulated pool cannot fit the request")
            return rec
        rec.ok, rec.finish_reason = True, "length"
        rec.ttft_s = seq.first_s - req.arrival_s
        rec.itl_s = seq.gaps
        rec.chunks = seq.generated
        rec.usage_output_tokens = seq.generated
        rec.finish(seq.end_s - req.arrival_s)
        return rec


def simulate(profile: Profile, shape: Shape, requests: list[SimRequest], slos: list[SLO] | None = None,
             attainment: float = 0.9, settings: NodeSettings | None = None, rate: float | None = None) -> SimResult:
    """One simulated run (see `Simulation`)."""
    return Simulation(profile, shape, requests, settings).run(slos, attainment, rate)

