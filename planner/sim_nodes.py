"""The simulated nodes of `planner.sim`: a request's state, and prefill and decode nodes that step as the
real ones schedule (see `planner.sim` for what is modelled)."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.planner.sim import SimRequest, Simulation


@dataclass(eq=False)
class Seq:
    """One request's state in the simulation (its owner: the node it is on)."""

    req: SimRequest
    tokens: int  # prompt + tokens generated so far
    computed: int = 0  # tokens whose K/V are in the node's cache
    generated: int = 0
    blocks: int = 0  # blocks held on the decode node
    local: bool = False  # prefilled by its decode node
    joined: bool = False  # a decode node step has emitted one of its tokens (its per-request overhead paid)
    first_s: float | None = None
    last_s: float | None = None
    gaps: list[float] = field(default_factory=list)
    end_s: float | None = None
    error: str | None = None

    @property
    def prefilling(self) -> bool:
        # As engine.sequence: prompt (or prompt + output after preemption) not all in the cache yet.
        return self.computed < self.tokens - 1


class Stepper:
    """A node that runs one engine step at a time while it has work."""

    def __init__(self, sim: Simulation, index: int) -> None:
        self.sim, self.index = sim, index
        self.busy = False
        self.retry = False  # the last plan preempted and started nothing: plan again at once
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
            if self.retry:  # as the engine loop: an empty step that preempted is followed by another
                self.retry = False
                self.kick()
            return
        t = self.sim.step_s(self, plan)
        self.sim.events.at(self.sim.events.now + t, lambda: self._end(plan))

    def _end(self, plan: list[tuple[Seq, int]]) -> None:
        self.apply(plan)  # may kick this node (a request ended): still busy, so that starts nothing yet
        self.between_steps()
        self.busy = False
        self.kick()

    def between_steps(self) -> None:
        """What the node's engine thread does after a step, before it plans the next (nothing here)."""

    @staticmethod
    def step_cost(plan: list[tuple[Seq, int]]) -> tuple[int, int, int, float]:
        decodes = [s for s, n in plan if n == 1 and not s.prefilling]
        chunks = [(s, n) for s, n in plan if n > 1 or s.prefilling]
        return (len(decodes), sum(s.tokens for s in decodes), sum(n for _, n in chunks),
                float(sum(n * (s.computed + n) for s, n in chunks)))

    def own_cpu_s(self, plan: list[tuple[Seq, int]]) -> float:
        """The node's CPU around this step beyond the engine's (`Overheads`); may mark sequences as charged."""
        raise NotImplementedError

    def plan(self) -> list[tuple[Seq, int]]:
        raise NotImplementedError

    def apply(self, plan: list[tuple[Seq, int]]) -> None:
        raise NotImplementedError


class PrefillNode(Stepper):
    """Prompts chunked FCFS under the token budget; a finished prompt's first token goes to the client
    and its K/V to the decode node (its KV capacity is not modelled)."""

    def __init__(self, sim: Simulation, index: int) -> None:
        super().__init__(sim, index)
        self.queue: deque[tuple[Seq, int]] = deque()  # (request, its decode node)

    def own_cpu_s(self, plan: list[tuple[Seq, int]]) -> float:
        # per prompt this step finishes (the first token, the KV send)
        done = sum(1 for s, n in plan if s.computed + n >= s.tokens)
        return done * self.sim.overheads.prefill_cpu_per_request_s

    def plan(self) -> list[tuple[Seq, int]]:
        cfg, budget, out = self.sim.settings, self.sim.settings.max_num_batched_tokens, []
        for seq, _ in itertools.islice(self.queue, cfg.max_num_seqs):
            if budget <= 0:
                break
            n = min(seq.tokens - seq.computed, budget)
            out.append((seq, n))
            budget -= n
        return out

    def apply(self, plan: list[tuple[Seq, int]]) -> None:
        now = self.sim.events.now
        for seq, n in plan:
            seq.computed += n
        while self.queue and self.queue[0][0].computed == self.queue[0][0].tokens:
            seq, d = self.queue.popleft()
            self.outstanding -= 1
            self.sim.emit(seq, now)
            self.sim.decode_nodes[d].prefilled(seq, self.index)


class DecodeNode(Stepper):
    """Continuous batching as `engine.scheduler` does it, plus the reservation queue of remote prefills."""

    def __init__(self, sim: Simulation, index: int) -> None:
        super().__init__(sim, index)
        self.free = sim.settings.num_kv_blocks
        self.waiting: deque[Seq] = deque()  # computed here: new local prompts and preempted sequences
        self.reserving: deque[tuple[Seq, int]] = deque()  # (request, its prefill node), waiting for blocks
        self.landed: deque[Seq] = deque()
        self.running: list[Seq] = []  # start order: the last one is preempted first

    # ---------------------------------------------------------------------------- arrivals

    def add_local(self, seq: Seq) -> None:
        self.waiting.append(seq)
        self.kick()

    def add_remote(self, seq: Seq, p: int) -> None:
        # The engine thread reserves blocks between steps: a request that arrives mid-step waits for the
        # step to end (on a busy decode node that is most of a step's time added to its TTFT).
        self.reserving.append((seq, p))
        if not self.busy:
            self.admit_reservations()

    def between_steps(self) -> None:
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

    def prefilled(self, seq: Seq, p: int) -> None:
        """The prefill node sampled the first token: done, or the K/V ship over the pair channel."""
        if seq.generated >= seq.req.output_tokens:
            self.release(seq)
            return
        sim = self.sim
        start = max(sim.events.now, sim.channel_free.get((p, self.index), 0.0))
        end = start + sim.prefill_profile.transfer_s(seq.req.prompt_tokens)
        sim.channel_free[(p, self.index)] = end
        sim.events.at(end, lambda: self._land(seq))

    def _land(self, seq: Seq) -> None:
        seq.computed = seq.tokens - 1
        self.landed.append(seq)
        self.kick()

    def release(self, seq: Seq) -> None:
        """A request is done here: its blocks are freed."""
        self.free += seq.blocks
        seq.blocks = 0
        self.outstanding -= 1
        assert 0 <= self.free <= self.sim.settings.num_kv_blocks
        self.admit_reservations()
        self.kick()

    # ---------------------------------------------------------------------------- one step

    def own_cpu_s(self, plan: list[tuple[Seq, int]]) -> float:
        # per token emitted, and per request at its first emitting step here (reserving, receiving K/V)
        o, t = self.sim.overheads, 0.0
        for s, n in plan:
            if s.computed + n < s.tokens:
                continue
            t += o.decode_cpu_per_token_s
            if not s.joined:
                s.joined = True
                t += o.decode_cpu_per_local_request_s if s.local else o.decode_cpu_per_remote_request_s
        return t

    def _alloc(self, seq: Seq, n: int) -> bool:
        need = self.sim.blocks_for(seq.computed + n) - seq.blocks
        if need > self.free:
            return False
        if need > 0:
            self.free -= need
            seq.blocks += need
        return True

    def _preempt(self, seq: Seq, plan: list[tuple[Seq, int]]) -> None:
        self.running.remove(seq)
        plan[:] = [(s, n) for s, n in plan if s is not seq]
        self.free += seq.blocks
        seq.blocks = seq.computed = 0
        self.waiting.appendleft(seq)
        self.sim.preemptions += 1

    def _alloc_or_preempt(self, seq: Seq, n: int, plan: list[tuple[Seq, int]]) -> bool:
        while not self._alloc(seq, n):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def plan(self) -> list[tuple[Seq, int]]:
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
            self.retry = not plan
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

    def apply(self, plan: list[tuple[Seq, int]]) -> None:
        now = self.sim.events.now
        for seq, n in plan:
            seq.computed += n
            if seq.computed < seq.tokens:
                continue
            self.sim.emit(seq, now)
            if seq.generated >= seq.req.output_tokens:
                self.running.remove(seq)
                self.release(seq)
