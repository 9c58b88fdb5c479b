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
`pdserve bench`). Deterministic: no clock and no randomness beyond the workload's seeded draws.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loadgen.client import RequestRecord
from loadgen.metrics import SLO, Summary, summarize
from planner.profile_model import Profile


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


@dataclass(eq=False)
class _Seq:
    """One request's state in the simulation (its owner: the node it is on)."""

    req: SimRequest
    tokens: int  # prompt + tokens generated so far
    computed: int = 0  # tokens whose K/V are in the node's cache
    generated: int = 0
    blocks: int = 0  # blocks held on the decode node
    first_s: float | None = None
    last_s: float | None = None
    gaps: list[float] = field(default_factory=list)
    end_s: float | None = None
    error: str | None = None

    @property
    def prefilling(self) -> bool:
        # As engine.sequence: prompt (or prompt + output after preemption) not all in the cache yet.
        return self.computed < self.tokens - 1


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


class _Stepper:
    """A node that runs one engine step at a time while it has work."""

    def __init__(self, sim: Simulation, index: int) -> None:
        self.sim, self.index = sim, index
        self.busy = False
        self.outstanding = 0  # requests routed here and not done with this node (routing's load)

    def kick(self) -> None:
        """Starts a step if idle and there is work it can do: at the current time, but after the events
        already queued for it (requests arriving at the same instant join the same step)."""
        if not self.busy:
            self.busy = True
            self.sim.events.at(self.sim.events.now, self._start)

    def _start(self) -> None:
        plan = self.plan()
        if not plan:
            self.busy = False
            return
        t = self.sim.profile.step_s(*self.step_cost(plan))
        self.sim.events.at(self.sim.events.now + t, lambda: self._end(plan))

    def _end(self, plan: list[tuple[_Seq, int]]) -> None:
        self.apply(plan)  # may kick this node (a request ended): still busy, so that starts nothing yet
        self.busy = False
        self.kick()

    @staticmethod
    def step_cost(plan: list[tuple[_Seq, int]]) -> tuple[int, int, int, float]:
        decodes = [s for s, n in plan if n == 1 and not s.prefilling]
        chunks = [(s, n) for s, n in plan if n > 1 or s.prefilling]
        return (len(decodes), sum(s.tokens for s in decodes), sum(n for _, n in chunks),
                float(sum(n * (s.computed + n) for s, n in chunks)))

    def plan(self) -> list[tuple[_Seq, int]]:
        raise NotImplementedError

    def apply(self, plan: list[tuple[_Seq, int]]) -> None:
        raise NotImplementedError


class _PrefillNode(_Stepper):
    """Prompts chunked FCFS under the token budget; a finished prompt's first token goes to the client
    and its K/V to the decode node (its KV capacity is not modelled)."""

    def __init__(self, sim: Simulation, index: int) -> None:
        super().__init__(sim, index)
        self.queue: deque[tuple[_Seq, int]] = deque()  # (request, its decode node)

    def plan(self) -> list[tuple[_Seq, int]]:
        cfg, budget, out = self.sim.settings, self.sim.settings.max_num_batched_tokens, []
        for seq, _ in itertools.islice(self.queue, cfg.max_num_seqs):
            if budget <= 0:
                break
            n = min(seq.tokens - seq.computed, budget)
            out.append((seq, n))
            budget -= n
        return out

    def apply(self, plan: list[tuple[_Seq, int]]) -> None:
        now = self.sim.events.now
        for seq, n in plan:
            seq.computed += n
        while self.queue and self.queue[0][0].computed == self.queue[0][0].tokens:
            seq, d = self.queue.popleft()
            self.outstanding -= 1
            self.sim.emit(seq, now)
            self.sim.decode_nodes[d].prefilled(seq, self.index)


class _DecodeNode(_Stepper):
    """Continuous batching as `engine.scheduler` does it, plus the reservation queue of remote prefills."""

    def __init__(self, sim: Simulation, index: int) -> None:
        super().__init__(sim, index)
        self.free = sim.settings.num_kv_blocks
        self.waiting: deque[_Seq] = deque()  # computed here: new local prompts and preempted sequences
        self.reserving: deque[tuple[_Seq, int]] = deque()  # (request, its prefill node), waiting for blocks
        self.landed: deque[_Seq] = deque()
        self.running: list[_Seq] = []  # start order: the last one is preempted first

    # ---------------------------------------------------------------------------- arrivals

    def add_local(self, seq: _Seq) -> None:
        self.waiting.append(seq)
        self.kick()

    def add_remote(self, seq: _Seq, p: int) -> None:
        self.reserving.append((seq, p))
        self.admit_reservations()

    def admit_reservations(self) -> None:
        """Reserves blocks for queued remote prompts (FIFO) and hands them to their prefill node."""
        sim = self.sim
        while self.reserving:
            seq, p = self.reserving[0]
            need = sim.blocks_for(seq.tokens)
            if need > sim.settings.num_kv_blocks:
                self.reserving.popleft()
                sim.prefill_nodes[p].outstanding -= 1
                sim.fail(seq, self, "abort")
                continue
            if need > self.free:
                break
            self.reserving.popleft()
            self.free -= need
            seq.blocks = need
            sim.prefill_nodes[p].queue.append((seq, self.index))
            sim.prefill_nodes[p].kick()

    def prefilled(self, seq: _Seq, p: int) -> None:
        """The prefill node sampled the first token: done, or the K/V ship over the pair channel."""
        if seq.generated >= seq.req.output_tokens:
            self.release(seq)
            return
        sim = self.sim
        start = max(sim.events.now, sim.channel_free.get((p, self.index), 0.0))
        end = start + sim.profile.transfer_s(seq.req.prompt_tokens)
        sim.channel_free[(p, self.index)] = end
        sim.events.at(end, lambda: self._land(seq))

    def _land(self, seq: _Seq) -> None:
        seq.computed = seq.tokens - 1
        self.landed.append(seq)
        self.kick()

    def release(self, seq: _Seq) -> None:
        """A request is done here: its blocks are freed."""
        self.free += seq.blocks
        seq.blocks = 0
        self.outstanding -= 1
        assert 0 <= self.free <= self.sim.settings.num_kv_blocks
        self.admit_reservations()
        self.kick()

    # ---------------------------------------------------------------------------- one step

    def _alloc(self, seq: _Seq, n: int) -> bool:
        need = self.sim.blocks_for(seq.computed + n) - seq.blocks
        if need > self.free:
            return False
        if need > 0:
            self.free -= need
            seq.blocks += need
        return True

    def _preempt(self, seq: _Seq, plan: list[tuple[_Seq, int]]) -> None:
        self.running.remove(seq)
        plan[:] = [(s, n) for s, n in plan if s is not seq]
        self.free += seq.blocks
        seq.blocks = seq.computed = 0
        self.waiting.appendleft(seq)
        self.sim.preemptions += 1

    def _alloc_or_preempt(self, seq: _Seq, n: int, plan: list[tuple[_Seq, int]]) -> bool:
        while not self._alloc(seq, n):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def plan(self) -> list[tuple[_Seq, int]]:
        cfg = self.sim.settings
        budget, plan = cfg.max_num_batched_tokens, []
        preempted = self.sim.preemptions
        for decoding in (True, False):
            for seq in list(self.running):
                if budget <= 0:
                    break
                if seq not in self.running or seq.prefilling == decoding:
                    continue
                n = 1 if decoding else min(seq.tokens - seq.computed, budget)
                if not self._alloc_or_preempt(seq, n, plan):
                    break
                plan.append((seq, n))
                budget -= n
            if decoding:  # landed sequences only decode: they join ahead of prefill work
                while self.landed and len(self.running) < cfg.max_num_seqs and budget > 0:
                    if not self._alloc(self.landed[0], 1):
                        break
                    seq = self.landed.popleft()
                    self.running.append(seq)
                    plan.append((seq, 1))
                    budget -= 1
        if self.sim.preemptions != preempted:  # blocks just ran short: start nothing new
            return plan
        while self.waiting and len(self.running) < cfg.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if self.sim.blocks_for(seq.tokens) > cfg.num_kv_blocks:
                self.waiting.popleft()
                self.sim.fail(seq, self, "abort")
                continue
            n = min(seq.tokens - seq.computed, budget)
            if not self._alloc(seq, n):
                break
            self.waiting.popleft()
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
        return plan

    def apply(self, plan: list[tuple[_Seq, int]]) -> None:
        now = self.sim.events.now
        for seq, n in plan:
            seq.computed += n
            if seq.computed < seq.tokens:
                continue
            self.sim.emit(seq, now)
            if seq.generated >= seq.req.output_tokens:
                self.running.remove(seq)
                self.release(seq)


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
        self.prefill_nodes = [_PrefillNode(self, i) for i in range(shape.prefill)]
        self.decode_nodes = [_DecodeNode(self, i) for i in range(shape.decode)]
        self.channel_free: dict[tuple[int, int], float] = {}  # pair channel -> when its last send ends
        self.seqs: list[_Seq] = []
        self.preemptions = 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.settings.block_size)

    def emit(self, seq: _Seq, t: float) -> None:
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

    def fail(self, seq: _Seq, node: _DecodeNode, error: str) -> None:
        """A request the pool can never fit ends with an error (as the scheduler rejects it)."""
        seq.error, seq.end_s = error, self.events.now
        node.outstanding -= 1

    def _arrive(self, req: SimRequest) -> None:
        seq = _Seq(req, req.prompt_tokens)
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
    def _record(seq: _Seq) -> RequestRecord:
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

